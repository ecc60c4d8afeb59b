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
(PREFLIGHT) naming their node, which the SLURM job script excludes before it requeues the job. What a straggler
costs the rest, the other ranks' time waiting for it in collectives (CollectiveClock, read off the flight recorder),
goes with its record; it is not part of the verdict, since on gloo it is a lower bound wherever collectives are
waited for one by one (FSDP's all-gathers).
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


class CollectiveClock:
    """This rank's collectives since the last take, read from torch's flight recorder (its ring of each rank's
    recent collectives, TORCH_FR_BUFFER_SIZE in jobenv): on NCCL their time on the device (TORCH_NCCL_ENABLE_TIMING),
    which includes the wait for the last rank to arrive; on gloo, which records no durations, the host time each
    one was issued. Reading the ring is a host call, made at log steps: no device sync. The checkpoint and control
    groups' collectives and pipeline sends (stages differ by design) are left out."""

    def __init__(self, is_gpu: bool, skip_groups: frozenset[str] = frozenset()):
        self.is_gpu, self.skip_groups = is_gpu, skip_groups
        self._seen = -1

    def _entries(self) -> list[dict]:
        import pickle

        try:
            from torch._C import _distributed_c10d as c10d

            dump = c10d._dump_nccl_trace if self.is_gpu else c10d._dump_fr_trace  # type: ignore[attr-defined]
            return pickle.loads(dump(includeStackTraces=False)).get("entries", [])
        except Exception:  # noqa: BLE001 - no recorder (its buffer is 0), or a torch without it: nothing measured
            return []

    def take(self) -> tuple[float, float] | None:
        """(collectives, their total: device seconds on NCCL, issue times in host seconds on gloo) since the last
        take; None when the recorder has none or lacks their times."""
        entries = self._entries()
        skip = self.skip_groups
        new = [
            e
            for e in entries
            if e["record_id"] > self._seen and not e.get("is_p2p") and e["process_group"][0] not in skip
        ]
        self._seen = max((e["record_id"] for e in entries), default=self._seen)
        if not new:
            return None
        if self.is_gpu:  # a collective still running has no duration yet: the ranks compare how many they timed
            known = [d for e in new if (d := e.get("duration_ms")) is not None]
            return (len(known), sum(known) / 1e3) if known else None
        return len(new), sum(e["time_created_ns"] for e in new) / 1e9


def collective_waits(rows: list[tuple[float, float] | None], is_gpu: bool, steps: int) -> list[float] | None:
    """Seconds per step each rank waited in collectives for the last rank to arrive, from every rank's
    CollectiveClock.take(). On NCCL: a rank's device time in collectives beyond the least any rank spent (the last
    to arrive waits least), exact when the same rank arrives last throughout the window (a straggler), a lower
    bound otherwise. On gloo, which times nothing: how long before the latest rank a rank issued the window's
    collectives, on average; DDP and ZeRO issue a step's collectives without waiting for each, so their waits
    overlap and that lag is the step's wait; where each is waited for in turn (FSDP's all-gathers) the first wait
    brings the ranks back in step and the figure is a lower bound. Different nodes' host clocks must agree (NTP)
    for gloo's. None when a rank measured nothing or the ranks counted different collectives."""
    if not rows or any(r is None for r in rows) or len({r[0] for r in rows if r is not None}) != 1:
        return None
    count = next(r[0] for r in rows if r is not None)
    totals = [r[1] for r in rows if r is not None]
    if is_gpu:
        return [(t - min(totals)) / max(1, steps) for t in totals]
    return [(max(totals) - t) / max(1.0, count) for t in totals]


@dataclass(frozen=True)
class Straggler:
    rank: int
    node: str
    seconds: float  # its forward time per step
    median: float  # the median rank's
    windows: int  # log steps in a row it was this slow
    peers_waited: float | None = None  # seconds per step the other ranks waited in collectives (their median)

    @property
    def slower(self) -> float:
        return self.seconds / self.median if self.median > 0 else float("inf")

    def describe(self) -> str:
        return (
            f"rank {self.rank} on node {self.node}: forward {self.seconds:.3g} s per step, {self.slower:.1f}x the "
            f"median rank's {self.median:.3g} s ({self.windows} log step(s) in a row)"
            + (
                f"; the other ranks waited {self.peers_waited:.3g} s per step in collectives"
                if self.peers_waited is not None
                else ""
            )
        )

    def record(self) -> dict:
        return {
            "rank": self.rank,
            "node": self.node,
            "seconds": round(self.seconds, 6),
            "median": round(self.median, 6),
            "slower": round(self.slower, 3),
            "windows": self.windows,
            "peers_waited_s": None if self.peers_waited is None else round(self.peers_waited, 6),
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

    def update(self, seconds: list[float | None], waits: list[float] | None = None) -> list[Straggler]:
        """This log step's slow ranks, each with its streak; `persistent()` of them are past the window. `waits`:
        every rank's seconds per step in collectives (collective_waits), for what the slow ranks cost the rest."""
        slow = set(outliers(seconds))
        median = reference([s for s in seconds if s is not None])
        others = [w for r, w in enumerate(waits or []) if r not in slow]
        peers = statistics.median(others) if others else None
        out = []
        for r in range(len(self.streak)):
            self.streak[r] = self.streak[r] + 1 if r in slow else 0
            if r in slow:
                s = seconds[r]
                assert s is not None
                out.append(Straggler(r, self.nodes[r], s, median, self.streak[r], peers))
        self.last = out
        return out

    def persistent(self) -> list[Straggler]:
        return [s for s in self.last if s.windows >= self.windows]

    def newly_persistent(self) -> list[Straggler]:
        """The stragglers whose streak reached the window at this log step: named once per streak."""
        return [s for s in self.last if s.windows == self.windows]


__all__ = [
    "CollectiveClock",
    "ComputeClock",
    "Straggler",
    "StragglerWatch",
    "collective_waits",
    "outliers",
    "reference",
]
