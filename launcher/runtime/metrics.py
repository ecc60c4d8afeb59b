"""What rank 0 reports: plain log lines (greppable in any scheduler's log), RUN_DIR/metrics.jsonl
(one JSON object per logged step, plus event lines), TensorBoard when it is installed, and a rich
progress bar only when a person is watching a terminal.

Per logged step, what a GPU user watches: tokens/s and the time per step over the log window, MFU against the
device's dense peak, and memory as the maximum over ranks (with the rank that holds it; with pipelines rank 0 is
rarely the peak rank): the caching allocator's active and reserved peaks in the window, its allocation retries
and OOMs in the window (retries are the first sign of fragmentation), and the host's resident set. On a CPU the
GPU-only fields are null, never invented.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..jobenv import METRICS_FILE, read_metrics, span

MB = 2**20
MEMORY_FIELDS = ("active_peak_mb", "reserved_peak_mb", "alloc_retries", "ooms", "host_rss_mb")


def host_rss_bytes() -> int | None:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with dtlaunch[train]
        return None
    return psutil.Process().memory_info().rss


class MemoryWindow:
    """This rank's memory figures since the previous `read()` (a log window)."""

    def __init__(self, is_gpu: bool):
        self.is_gpu = is_gpu
        self._retries = self._ooms = 0

    def read(self) -> dict[str, float | None]:
        out: dict[str, float | None] = dict.fromkeys(MEMORY_FIELDS)
        rss = host_rss_bytes()
        out["host_rss_mb"] = None if rss is None else rss / MB
        if self.is_gpu:
            st = torch.cuda.memory_stats()
            retries, ooms = st.get("num_alloc_retries", 0), st.get("num_ooms", 0)
            out.update(
                active_peak_mb=st.get("active_bytes.all.peak", 0) / MB,
                reserved_peak_mb=st.get("reserved_bytes.all.peak", 0) / MB,
                alloc_retries=retries - self._retries,
                ooms=ooms - self._ooms,
            )
            self._retries, self._ooms = retries, ooms
            torch.cuda.reset_peak_memory_stats()
        return out


def device_peak_tflops(is_gpu: bool) -> tuple[float | None, str]:
    """(dense bf16 peak of this process's GPU, its name); (None, name) when the table does not know it."""
    if not is_gpu:
        return None, "cpu"
    from ..catalog import DEVICE_PEAK_TFLOPS

    name = torch.cuda.get_device_name()
    return DEVICE_PEAK_TFLOPS.get(name), name


class MFUError(ValueError):
    """An MFU above 100%: the peak table or the FLOP count is wrong, and the figure must not be shown."""


def mfu(tokens_per_s: float, devices: int, flops_per_token: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: the model's FLOPs per second (no recomputation counted) over every device's dense
    peak. None without a known peak (a CPU, an unknown GPU)."""
    if not peak_tflops or devices < 1:
        return None
    value = tokens_per_s * flops_per_token / (devices * peak_tflops * 1e12)
    if value > 1.0:
        raise MFUError(
            f"MFU {value:.0%} is above 100%: the dense peak ({peak_tflops:g} TFLOPS) or the model's FLOPs "
            f"per token ({flops_per_token:.3g}) is wrong for this device"
        )
    return value


@dataclass
class RankFigures:
    """The maximum of each memory figure over ranks, and the rank that holds the largest (reserved on GPU, RSS)."""

    values: dict[str, float | None]
    peak_rank: int | None
    ranks: int = 1

    @classmethod
    def of(cls, rows: list[dict[str, float | None]], is_gpu: bool) -> RankFigures:
        values: dict[str, float | None] = {}
        for k in MEMORY_FIELDS:
            known = [v for r in rows if (v := r.get(k)) is not None]
            values[k] = max(known) if known else None
        key = "reserved_peak_mb" if is_gpu else "host_rss_mb"
        ranked = [(r[key], i) for i, r in enumerate(rows) if r.get(key) is not None]
        return cls(values, max(ranked)[1] if ranked else None, len(rows))


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
        self._mfu_error_shown = False
        self._started = time.monotonic()  # this attempt's start: the step line's elapsed time
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

    def step(
        self,
        step: int,
        *,
        loss: float,
        lr: float,
        tokens_per_s: float,
        step_time: float,
        grad_norm: float | None,
        memory: RankFigures | None = None,
        mfu: float | None = None,
        mfu_error: str | None = None,
        extra: dict | None = None,
    ) -> None:
        """One logged step: `tokens_per_s` and `step_time` over the log window, memory over ranks."""
        if not self.enabled:
            return
        mem = memory.values if memory is not None else dict.fromkeys(MEMORY_FIELDS)
        rec = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "tokens_per_s": round(tokens_per_s, 1),
            "step_time_s": round(step_time, 4),
            "grad_norm": grad_norm,
            "time": round(time.time(), 3),
            # three significant figures: a small model's MFU on a large GPU is well under 0.01%, not 0
            "mfu": None if mfu is None else float(f"{mfu:.3g}"),
            "peak_rank": memory.peak_rank if memory else None,
            **{k: (None if v is None else round(v, 1)) for k, v in mem.items()},
            **(extra or {}),
        }
        if mfu_error:
            rec["mfu_error"] = mfu_error
            if not self._mfu_error_shown:
                self.log(f"ERROR: {mfu_error}; MFU is not reported")
                self._mfu_error_shown = True
        eta = max(0, self.total_steps - step) * step_time  # at the rate of the last log window
        rec["eta_s"] = round(eta, 1)
        self._write(rec)
        line = (
            f"step {step}/{self.total_steps} ({step / max(1, self.total_steps):.0%}) | loss {loss:.4f} | lr {lr:.2e} | "
            f"{_fmt_rate(tokens_per_s)} tok/s | {step_time * 1e3:.0f} ms/step | "
            f"elapsed {span(time.monotonic() - self._started)} | eta {span(eta)}"
        )
        if mfu is not None:
            line += f" | mfu {mfu:.1%}"
        where = (
            f" (rank {memory.peak_rank})"
            if memory is not None and memory.peak_rank is not None and memory.ranks > 1
            else ""
        )
        active, reserved = mem.get("active_peak_mb"), mem.get("reserved_peak_mb")  # read together (memory_stats)
        if active is not None and reserved is not None:
            line += f" | mem {active / 1024:.1f}/{reserved / 1024:.1f} GiB{where}"
            if mem.get("alloc_retries"):
                line += f" | alloc retries {mem['alloc_retries']:.0f}"
        elif mem.get("host_rss_mb") is not None:
            line += f" | rss {mem['host_rss_mb']:.0f} MB{where}"
        if grad_norm is not None:
            line += f" | grad_norm {grad_norm:.3f}"
        print(line, flush=True)
        if self._tb is not None:
            self._tb.add_scalar("loss", loss, step)
            self._tb.add_scalar("lr", lr, step)
            self._tb.add_scalar("tokens_per_s", tokens_per_s, step)
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


__all__ = [
    "MEMORY_FIELDS",
    "MFUError",
    "MemoryWindow",
    "Metrics",
    "RankFigures",
    "device_peak_tflops",
    "mfu",
    "read_metrics",
]
