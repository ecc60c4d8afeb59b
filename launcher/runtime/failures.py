"""Errors the runtime turns into a message and a distinct exit code (never a traceback).

The exit code tells the wrapper what to do: CONFIG = fix the recipe, PREFLIGHT = fix the nodes,
HANG = restart and resume, PREEMPTED = requeue and resume.
"""

from __future__ import annotations

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


class StorageError(RuntimeFailure):
    """Checkpoint storage is full or read-only, or reads kept failing: nothing was marked or deleted."""

    exit_code = ExitCode.STORAGE


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
    return any(
        m in text
        for m in (
            "gloo",
            "Gloo",
            "NCCL",
            "Connection closed by peer",
            "Connection reset by peer",
            "EnforceNotMet",
            "Broken pipe",
        )
    )
