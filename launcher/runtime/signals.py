"""Preemption: the handler only records the signal; the training loop acts at the next step boundary.

Checkpointing inside a signal handler fails intermittently (it can interrupt a collective or a write),
so the handler sets a flag, and all ranks agree on it (MAX over ranks) before saving: a signal that
reached only some ranks (SLURM sends USR2 to the batch shell's children) still stops everyone together.
USR1 is left alone: NCCL uses it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable

DEFAULT_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class PreemptionFlag:
    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS):
        self.signals = tuple(signals)
        self.received: str | None = None
        self.received_at: float | None = None  # monotonic time of the first signal
        self._previous: dict[int, object] = {}

    def install(self) -> PreemptionFlag:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - the signal API's signature
        if self.received is None:
            self.received = signal.Signals(signum).name
            self.received_at = time.monotonic()


PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux; a no-op elsewhere).

    torchrun starts its workers in sessions of their own, so killing a job's process group leaves them
    running, training and checkpointing into a directory nobody follows any more. With this, a worker whose
    torchrun dies gets SIGTERM (which it treats as a preemption: checkpoint, exit), and a torchrun whose
    launch script dies does the same for its workers.
    """
    import ctypes
    import os

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before we asked: act now
        os.kill(os.getpid(), sig)
