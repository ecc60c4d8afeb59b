"""What rank 0 reports: plain log lines (greppable in any scheduler's log), RUN_DIR/metrics.jsonl
(one JSON object per logged step, plus event lines), TensorBoard when it is installed, and a rich
progress bar only when a person is watching a terminal.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..jobenv import METRICS_FILE, read_metrics


def memory_mb(is_gpu: bool) -> float:
    """Peak memory of this rank: max_memory_allocated on GPU, peak RSS on CPU."""
    if is_gpu:
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _fmt_rate(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


class Metrics:
    """Rank 0 writes; other ranks' calls are no-ops, so callers need no rank checks."""

    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, is_gpu: bool):
        self.enabled, self.total_steps, self.is_gpu = enabled, total_steps, is_gpu
        self.path = Path(run_dir) / METRICS_FILE
        self._file = None
        self._tb = None
        self._progress = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        except Exception:
            self._tb = None
        if sys.stdout.isatty():
            try:
                from rich.progress import Progress

                self._progress = Progress(transient=True)
                self._task = self._progress.add_task("training", total=total_steps)
                self._progress.start()
            except Exception:
                self._progress = None

    def _write(self, obj: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(obj, sort_keys=True) + "\n")

    def log(self, msg: str) -> None:
        if self.enabled:
            print(f"dtlaunch: {msg}", flush=True)

    def event(self, name: str, **fields: Any) -> None:
        if self.enabled:
            self._write({"event": name, "time": round(time.time(), 3), **fields})

    def step(self, step: int, *, loss: float, lr: float, tokens: int, step_time: float, grad_norm: float | None,
             extra: dict | None = None) -> None:
        if not self.enabled:
            return
        tps = tokens / step_time if step_time > 0 else 0.0
        mem = memory_mb(self.is_gpu)
        rec = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": round(tps, 1), "step_time_s": round(step_time, 4),
               "mem_mb": round(mem, 1), "grad_norm": grad_norm, "time": round(time.time(), 3), **(extra or {})}
        self._write(rec)
        mem_name = "max_alloc" if self.is_gpu else "rss"
        line = (f"step {step}/{self.total_steps} | loss {loss:.4f} | lr {lr:.2e} | {_fmt_rate(tps)} tok/s | "
                f"{step_time * 1e3:.0f} ms/step | {mem_name} {mem:.0f} MB")
        if grad_norm is not None:
            line += f" | grad_norm {grad_norm:.3f}"
        print(line, flush=True)
        if self._tb is not None:
            self._tb.add_scalar("loss", loss, step)
            self._tb.add_scalar("lr", lr, step)
            self._tb.add_scalar("tokens_per_s", tps, step)
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


__all__ = ["Metrics", "memory_mb", "read_metrics"]
