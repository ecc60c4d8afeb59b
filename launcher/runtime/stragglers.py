"""Stragglers: a rank whose own compute stays slower than its peers', named with its node.

What is measured is each rank's forward time, the part of a step that waits for no peer under DDP and ZeRO
(FSDP2's all-gathers are prefetched on a stream of their own): a slow GPU or an overloaded host shows there,
while the time spent in collectives is the same on every rank (they all wait for the slowest). On a GPU the
forward is timed with CUDA events, read at log steps after the loss read has waited for the device anyway, so
timing adds no sync; on the CPU, with the host clock. A pipeline's schedule is not timed (its stages differ
by design).

At each log step every rank's forward time per step travels in the report row all ranks already exchange, so
every rank reaches the same verdict: a rank beyond the robust z-score cut (median and MAD over the ranks, the
MAD floored so that timing noise on identical ranks is no outlier) and at least MIN_SLOWDOWN slower than the
median, for WINDOWS log steps in a row, is a persistent straggler. `training.on_straggler` decides what
follows: `warn` names it in the log and metrics.jsonl; `exit` checkpoints, and the straggler's ranks exit 44
(PREFLIGHT) naming their node, which the SLURM job script excludes before it requeues the job.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

Z_CUT = 3.5  # the modified z-score's outlier cut (Iglewicz and Hoaglin)
MAD_FLOOR = 0.05  # the MAD is at least this fraction of the median: identical ranks differ by noise only
MIN_SLOWDOWN = 1.25  # a straggler is at least this much slower than the median rank
WINDOWS = 3  # log steps in a row before a straggler is persistent


class ComputeClock:
    """Times the forward passes of a log window (a context manager around each); `take()` gives the seconds
    per optimizer step since the last take. `throttle()`, run inside the timed part, is the test-only slow-rank
    fault (inject.Faults.slow_seconds)."""

    def __init__(self, is_gpu: bool, throttle: Callable[[], float] | None = None):
        self.is_gpu, self.throttle = is_gpu, throttle
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: torch.cuda.Event | None = None
        self._seconds = 0.0
        self._t0 = 0.0
        self._steps = 0
        self.timed = False  # some forward was timed in this window

    def __enter__(self) -> ComputeClock:
        if self.is_gpu:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.throttle is not None and (s := self.throttle()) > 0:
            time.sleep(s)
        if self.is_gpu:
            assert self._start is not None, "the clock is entered before it is left"
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self._seconds += time.perf_counter() - self._t0
        self.timed = True

    def tick(self) -> None:
        self._steps += 1

    def take(self) -> float | None:
        """Forward seconds per step in the window (None when nothing was timed); call after the window's work
        is done on the device (the log step's loss read)."""
        seconds = self._seconds + sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
        timed, steps = self.timed, max(1, self._steps)
        self._events, self._seconds, self._steps, self.timed = [], 0.0, 0, False
        return seconds / steps if timed else None


@dataclass(frozen=True)
class Straggler:
    rank: int
    node: str
    seconds: float  # its forward time per step
    median: float  # the median rank's
    windows: int  # log steps in a row it was this slow

    @property
    def slower(self) -> float:
        return self.seconds / self.median if self.median > 0 else float("inf")

    def describe(self) -> str:
        return (
            f"rank {self.rank} on node {self.node}: forward {self.seconds:.3g} s per step, {self.slower:.1f}x the "
            f"median rank's {self.median:.3g} s ({self.windows} log step(s) in a row)"
        )

    def record(self) -> dict:
        return {
            "rank": self.rank,
            "node": self.node,
            "seconds": round(self.seconds, 6),
            "median": round(self.median, 6),
            "slower": round(self.slower, 3),
            "windows": self.windows,
        }


def reference(known: list[float]) -> float:
    """The time a straggler is compared with: the median rank's; with fewer than three ranks the fastest one's
    (a median of two is their midpoint, from which neither is far)."""
    return statistics.median(known) if len(known) >= 3 else min(known, default=0.0)


def outliers(seconds: list[float | None]) -> list[int]:
    """The ranks whose time is a robust outlier on the slow side (against `reference`)."""
    known = [s for s in seconds if s is not None]
    if len(known) < 2:
        return []
    ref = reference(known)
    if ref <= 0:
        return []
    mad = statistics.median(abs(s - ref) for s in known) if len(known) >= 3 else 0.0
    scale = max(mad, MAD_FLOOR * ref)
    return [
        r
        for r, s in enumerate(seconds)
        if s is not None and 0.6745 * (s - ref) / scale > Z_CUT and s >= MIN_SLOWDOWN * ref
    ]


class StragglerWatch:
    """The verdict over log steps; the same on every rank, since every rank sees every rank's time."""

    def __init__(self, nodes: list[str], windows: int = WINDOWS):
        self.nodes, self.windows = nodes, windows
        self.streak = [0] * len(nodes)
        self.last: list[Straggler] = []  # this log step's slow ranks (persistent or not)

    def update(self, seconds: list[float | None]) -> list[Straggler]:
        """This log step's slow ranks, each with its streak; `persistent()` of them are past the window."""
        slow = set(outliers(seconds))
        median = reference([s for s in seconds if s is not None])
        out = []
        for r in range(len(self.streak)):
            self.streak[r] = self.streak[r] + 1 if r in slow else 0
            if r in slow:
                s = seconds[r]
                assert s is not None
                out.append(Straggler(r, self.nodes[r], s, median, self.streak[r]))
        self.last = out
        return out

    def persistent(self) -> list[Straggler]:
        return [s for s in self.last if s.windows >= self.windows]

    def newly_persistent(self) -> list[Straggler]:
        """The stragglers whose streak reached the window at this log step: named once per streak."""
        return [s for s in self.last if s.windows == self.windows]


__all__ = ["ComputeClock", "Straggler", "StragglerWatch", "outliers", "reference"]
