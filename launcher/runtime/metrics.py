"""What rank 0 reports: plain log lines (greppable in any scheduler's log), RUN_DIR/metrics.jsonl
(one JSON object per logged step, plus event lines), the sinks the recipe selects (training.tracking:
TensorBoard in RUN_DIR/tensorboard, Weights & Biases under the run's id), and a rich progress bar only when a
person is watching a terminal.

Per logged step, what a GPU user watches: tokens/s and the time per step over the log window, MFU against the
device's dense peak, and memory as the maximum over ranks (with the rank that holds it; with pipelines rank 0 is
rarely the peak rank): the caching allocator's active and reserved peaks in the window, its allocation retries
and OOMs in the window (retries are the first sign of fragmentation), and the host's resident set. On a CPU the
GPU-only fields are null, never invented.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..jobenv import METRICS_FILE, read_metrics, span
from .checkpoint.disk import write_file_durably
from .failures import ConfigError

MB = 2**20
MEMORY_FIELDS = ("active_peak_mb", "reserved_peak_mb", "alloc_retries", "ooms", "host_rss_mb")
# What the sinks get of a step record: the figures a curve is drawn of (not the time, the ETA or the peak's rank).
SINK_FIELDS = ("loss", "lr", "tokens_per_s", "step_time_s", "grad_norm", "mfu", "loss_scale", *MEMORY_FIELDS)
SINKS = ("tensorboard", "wandb")  # training.tracking's fields, each named as the package it needs


def check_tracking(tracking) -> None:
    """On every rank, before anything is built: a selected sink whose package is missing ends the run at once
    (CONFIG), rather than after the queue and the set-up, or on rank 0 alone."""
    for sink in SINKS:
        if getattr(tracking, sink) and importlib.util.find_spec(sink) is None:
            raise ConfigError(
                f"training.tracking.{sink} is on, but the {sink} package is not installed in the job's Python",
                fix=f"pip install {sink} (or 'dtlaunch[track]') where the job runs, or set "
                f"training.tracking.{sink}: false",
            )


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

    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, is_gpu: bool, keep_with: Path | None = None):
        """`keep_with`: storage that outlives the node (the checkpoints' bucket, when the run directory is on a
        node's disk): the records are copied there at each checkpoint and at the end, and a run directory that
        holds fewer records than that copy (a fresh node after a recovery) starts from it."""
        self.enabled, self.total_steps, self.is_gpu = enabled, total_steps, is_gpu
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.keep_with = keep_with
        self._file = None
        self._tb: Any = None  # torch.utils.tensorboard.SummaryWriter, made at the first figure (open_sinks)
        self._tb_dir: Path | None = None
        self._wandb: Any = None  # the wandb Run
        self._wandb_from = 0  # the first step the W&B run accepts (a resumed run's history goes up to it)
        self._resumed_at = 0  # the step this attempt resumed from: TensorBoard hides what an earlier one wrote after
        self._progress = None
        self._mfu_error_shown = False
        self._started = time.monotonic()  # this attempt's start: the step line's elapsed time
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._take_kept()
        self._file = open(self.path, "a", buffering=1)
        if sys.stdout.isatty():
            try:
                from rich.progress import Progress

                self._progress = Progress(transient=True)
                self._task = self._progress.add_task("training", total=total_steps)
                self._progress.start()
            except Exception:
                self._progress = None

    def open_sinks(self, tracking, *, run_id: str, name: str, config: dict) -> None:
        """The sinks training.tracking selects (rank 0; check_tracking has found their packages). W&B: the run
        `run_id` in resume="allow" mode, so every attempt of a dtlaunch run (a requeue, a restart, a resubmission
        with the same run id) continues one W&B run."""
        if not self.enabled:
            return
        if tracking.tensorboard:
            self._tb_dir = self.run_dir / "tensorboard"
        if tracking.wandb:
            # imported only here (it takes seconds), by name: typing does not depend on the optional package
            wandb = importlib.import_module("wandb")

            project = tracking.wandb_project or os.environ.get("WANDB_PROJECT") or name
            try:
                self._wandb = wandb.init(
                    id=run_id,
                    resume="allow",
                    project=project,
                    name=name,
                    config=config,
                    # WANDB_DIR, when set, is the user's choice; else the run's files stay with the run
                    dir=None if os.environ.get("WANDB_DIR") else str(self.run_dir),
                    # the job's log already holds every line; capturing the console would rewire stdout
                    settings=wandb.Settings(console="off"),
                )
            except wandb.errors.UsageError as e:  # no API key, a bad entity: the recipe's or the job's setup
                raise ConfigError(
                    f"W&B refused the run: {e}",
                    fix="pass the key with secrets: [WANDB_API_KEY] (exported where you launch), set "
                    "WANDB_MODE=offline in env to sync later, or set training.tracking.wandb: false",
                ) from None
            except Exception as e:  # W&B unreachable: not worth losing the training run for
                self.log(f"WARNING: W&B did not start ({type(e).__name__}: {e}); training goes on without it")
                return
            self._wandb_from = int(self._wandb.step)
            if self._wandb.offline:  # each attempt writes a directory of its own, all with the run's id
                where = Path(self._wandb.dir).parent
                self.log(
                    f"W&B run {run_id} in project {project}, offline in {where} (upload: wandb sync {where}; "
                    "after the first attempt's, a later attempt's with wandb sync --append)"
                )
            else:
                self.log(f"W&B run {run_id} in project {project}: {self._wandb.url}")

    def _scalars(self, step: int, figures: dict[str, Any]) -> None:
        """The numbers of one record to the selected sinks; what is not a finite number (None) is left out."""
        values = {k: float(v) for k, v in figures.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if self._tb_dir is not None:
            if self._tb is None:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: TensorBoard hides what a failed attempt wrote past the checkpoint this one resumed
                self._tb = SummaryWriter(
                    str(self._tb_dir), purge_step=self._resumed_at + 1 if self._resumed_at else None
                )
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None and step >= self._wandb_from:  # W&B drops (and warns about) earlier steps
            self._wandb.log(values, step=step)

    def _write(self, obj: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(obj, sort_keys=True) + "\n")

    def log(self, msg: str) -> None:
        if self.enabled:
            print(f"dtlaunch: {msg}", flush=True)

    def event(self, name: str, **fields: Any) -> None:
        if self.enabled:
            self._write({"event": name, "time": round(time.time(), 3), **fields})
            if name == "resume":
                self._resumed_at = int(fields.get("step") or 0)
            if name == "checkpoint":
                self._keep()

    def _take_kept(self) -> None:
        """Start from the kept copy when it holds more than this run directory (a node that never ran the job,
        or one that ran an earlier attempt only)."""
        kept = self.keep_with / METRICS_FILE if self.keep_with is not None else None
        try:
            if kept is not None and kept.stat().st_size > (self.path.stat().st_size if self.path.exists() else 0):
                write_file_durably(self.path, kept.read_bytes())
        except OSError as e:  # the history is for reports; training goes on without it
            self.log(f"WARNING: cannot restore the run's records from {kept}: {e}")

    def _keep(self) -> None:
        if self.keep_with is None or self._file is None:
            return
        try:
            self._file.flush()
            self.keep_with.mkdir(parents=True, exist_ok=True)
            write_file_durably(self.keep_with / METRICS_FILE, self.path.read_bytes())
        except OSError as e:
            self.log(f"WARNING: cannot copy the run's records to {self.keep_with}: {e}")

    def validation(self, step: int, val_loss: float, *, sequences: int, seconds: float) -> None:
        """The held-out loss at `step`: a record of its own in metrics.jsonl (step, val_loss) and the sinks."""
        if not self.enabled:
            return
        self._write({"step": step, "val_loss": val_loss, "val_sequences": sequences, "time": round(time.time(), 3)})
        print(
            f"step {step}/{self.total_steps} | val_loss {val_loss:.4f} | {sequences} sequences in {seconds:.1f}s",
            flush=True,
        )
        self._scalars(step, {"val_loss": val_loss})

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
        rec["steps"] = self.total_steps  # the run's length as this attempt trains it (`status` shows step/steps)
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
        self._scalars(step, {k: rec.get(k) for k in SINK_FIELDS})
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            run, self._wandb = self._wandb, None
            try:
                run.finish()
            except Exception as e:  # the run's files are written; a failed upload must not fail the job
                self.log(f"WARNING: W&B did not finish cleanly ({type(e).__name__}: {e})")
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._keep()
            self._file.close()
            self._file = None


__all__ = [
    "MEMORY_FIELDS",
    "MFUError",
    "MemoryWindow",
    "Metrics",
    "RankFigures",
    "check_tracking",
    "device_peak_tflops",
    "mfu",
    "read_metrics",
]
