"""Errors the runtime turns into a message and a distinct exit code (never a traceback).

The exit code tells the wrapper what to do: CONFIG = fix the recipe, PREFLIGHT = fix the nodes,
HANG = restart and resume, PREEMPTED = requeue and resume.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from ..errors import DtlaunchError
from ..jobenv import ExitCode


class RuntimeFailure(DtlaunchError):
    exit_code = ExitCode.FAILED

    def __init__(self, message: str, fix: str | None = None, step: int | None = None):
        self.step = step
        super().__init__(message, fix)


class ConfigError(RuntimeFailure):
    """The recipe, plan or checkpoint layout cannot work; restarting will not help."""

    exit_code = ExitCode.CONFIG


class PreflightError(RuntimeFailure):
    """The environment is broken (rendezvous, bandwidth, disk, shm)."""

    exit_code = ExitCode.PREFLIGHT


class HangError(RuntimeFailure):
    """A collective timed out or the ranks disagreed on the step."""

    exit_code = ExitCode.HANG


class Diverged(RuntimeFailure):
    """The loss was not finite for several steps in a row; nothing was committed meanwhile."""

    exit_code = ExitCode.DIVERGED


class Preempted(RuntimeFailure):
    """A checkpoint was written after SIGUSR2/SIGTERM; the job should be requeued."""

    exit_code = ExitCode.PREEMPTED


TIMEOUT_MARKERS = ("timed out", "timeout", "watchdog caught collective operation timeout")


def is_timeout(exc: BaseException) -> bool:
    """True for a collective that gave up waiting (gloo: 'Timed out waiting ...ms', NCCL: watchdog)."""
    text = str(exc).lower()
    return any(m in text for m in TIMEOUT_MARKERS)


def is_comm_error(exc: BaseException) -> bool:
    """True for errors raised by the communication layer (a peer vanished, a mismatched collective)."""
    try:
        import torch.distributed as dist

        if isinstance(exc, getattr(dist, "DistError", ())):
            return True
    except Exception:  # pragma: no cover
        pass
    text = str(exc)
    return any(m in text for m in ("gloo", "Gloo", "NCCL", "Connection closed by peer", "Connection reset by peer",
                                   "EnforceNotMet", "Broken pipe"))


class NonFiniteLosses:
    """Steps in a row whose loss was NaN or inf, for the trainer and a user's script (`launcher.init()`) alike.
    While it is not finite nothing is saved (a NaN checkpoint would be committed and pruning would then delete
    the good ones); past `limit` steps in a row the run ends with Diverged, so the newest checkpoint is the
    last good one."""

    def __init__(self, limit: int, log: Callable[[str], None]):
        self.limit, self.log, self.count = limit, log, 0

    def check(self, loss: float, step: int) -> bool:
        """True when `loss` is finite; counts and warns otherwise, and raises Diverged at the limit."""
        if math.isfinite(loss):
            self.count = 0
            return True
        self.count += 1
        self.log(f"WARNING: loss is {loss} at step {step} ({self.count} of at most {self.limit} in a row); no "
                 "checkpoint is saved while it is not finite")
        if self.count >= self.limit:
            raise Diverged(f"the loss was not finite for {self.count} steps in a row (steps {step - self.count + 1}-"
                           f"{step}); nothing was saved since, so the newest checkpoint is the last good one",
                           fix="resume with a lower training.lr, more warmup_steps, or grad_clip; check the data",
                           step=step)
        return False
