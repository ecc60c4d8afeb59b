"""What the ranks agree on, step by step, without making the host wait for the GPU.

Every step ends with one small collective over a gloo group of host numbers (`World.control_group`): each rank's
step number and whether a preemption signal reached it. So all ranks stop at the same step, and an off-by-one
divergence (which no timeout sees) ends the job at once with HANG; and since nothing in it comes from the GPU,
the host goes on queueing the next step while the GPU still runs this one (torchtitan reads the GPU only on
log steps too).

The loss is read only where the loop must decide something: a log step, a checkpoint, a stop, the last step.
Non-finite losses are counted on the device meanwhile (`NonFiniteWatch`), so a NaN between two log steps is
still seen, and no checkpoint is ever committed while the loss is not finite. At those steps every rank sends
one row of host numbers (its loss, the non-finite counts, its memory figures) and every rank gets all rows:
the mean loss, and the maximum of each memory figure with the rank that holds it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .failures import Diverged, HangError
from .stragglers import CollectiveClock, ComputeClock, StragglerWatch, collective_waits


@dataclass(frozen=True)
class Agreement:
    step: int
    stop: bool  # some rank received a preemption signal: every rank saves this step and exits
    signalled: tuple[int, ...] = ()

    @property
    def who(self) -> str:
        """The signalled ranks, for a log line: "rank 1", "ranks 0, 3"."""
        return f"rank{'s' if len(self.signalled) > 1 else ''} {', '.join(map(str, self.signalled))}"


def _all_gather_rows(local: torch.Tensor, group) -> torch.Tensor:
    """(world, n) rows of every rank's (n,) host tensor."""
    world = dist.get_world_size(group)
    out = torch.empty((world, local.numel()), dtype=local.dtype, device="cpu")
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local.view(1, -1), group=group)
    return out


AGREE, REPORT = 1.0, 2.0
# a report row: loss, three non-finite counts, five memory figures (metrics.MEMORY_FIELDS), forward seconds per step,
# the collectives counted since the last report and their total (stragglers.CollectiveClock)
PAYLOAD = 12


class StepSync:
    """The per-step agreement and the decision steps' gather, on `world.control_group` (host numbers only).

    Both exchange rows of one fixed size, (kind, step, preemption flag, payload): gloo aborts the process when a
    rank's message has another size than its peer expects, so a rank that skipped or repeated a collective must
    meet rows of the right size, whose kind and step then tell every rank that they are out of step (HANG)."""

    def __init__(self, world, skip: Callable[[int], bool] = lambda step: False):
        self.world = world
        self.skip = skip  # fault injection: this rank skips the agreement once (a desynchronised collective)

    @property
    def distributed(self) -> bool:
        return self.world.distributed and self.world.control_group is not None

    def _exchange(self, kind: float, step: int, flag: bool, payload: list[float | None]) -> list[list[float]]:
        row = [kind, float(step), 1.0 if flag else 0.0, *(math.nan if v is None else float(v) for v in payload)]
        assert len(row) <= 3 + PAYLOAD, "a row is one fixed size (PAYLOAD)"
        row += [math.nan] * (3 + PAYLOAD - len(row))
        local = torch.tensor(row, dtype=torch.float64, device="cpu")
        if not self.distributed or (kind == AGREE and self.skip(step)):
            return [local.tolist()]
        rows = _all_gather_rows(local, self.world.control_group).tolist()
        kinds, steps = [r[0] for r in rows], [int(r[1]) for r in rows]
        if min(steps) != max(steps):
            raise HangError(
                f"ranks disagree on the step number (per rank: {steps}); this rank is at step {step}",
                fix="a rank skipped or repeated work; restart from the last checkpoint",
                step=step,
            )
        if len(set(kinds)) > 1:
            what = {AGREE: "the step agreement", REPORT: "the log-step report"}
            per_rank = ", ".join(f"rank {r}: {what.get(k, k)}" for r, k in enumerate(kinds) if k != kind)
            raise HangError(
                f"ranks are out of step at step {step}: this rank was in {what[kind]}, {per_rank}",
                fix="a rank skipped or repeated a collective; restart from the last checkpoint",
                step=step,
            )
        return rows

    def agree(self, step: int, signalled: bool) -> Agreement:
        """Raises HangError if the ranks are not at the same step."""
        rows = self._exchange(AGREE, step, signalled, [])
        who = tuple(rank for rank, r in enumerate(rows) if r[2])
        return Agreement(step, bool(who), who)

    def gather(self, step: int, payload: list[float | None]) -> list[list[float | None]]:
        """Every rank's payload of host numbers at `step` (None travels as NaN and comes back as None)."""
        rows = self._exchange(REPORT, step, False, payload)
        return [[None if math.isnan(v) else v for v in r[3 : 3 + len(payload)]] for r in rows]


class NonFiniteWatch:
    """Non-finite losses in a row, counted on the device (no sync), read at the steps where the loop decides.

    `update(loss, step)` after each step; `take(step)` gives (the current run of non-finite steps, the longest run
    since the last take, the step that run ended at), still on the device. `decide(rows)` takes those from every
    rank and raises Diverged once a run reached `limit`; it returns whether the loss is finite now (a checkpoint
    may be written)."""

    def __init__(self, limit: int, device, log: Callable[[str], None]):
        self.limit, self.log = limit, log
        self.device = torch.device(device)
        self._state = torch.zeros(3, dtype=torch.int64, device=self.device)  # run, worst, worst's last step
        self.count = 0  # the run at the last read (0: the last decision saw a finite loss)

    @torch.no_grad()
    def update(self, loss: torch.Tensor | float, step: int) -> None:
        loss = torch.as_tensor(loss, device=self.device)
        bad = ~torch.isfinite(loss.detach().float())
        run = torch.where(bad, self._state[0] + 1, torch.zeros_like(self._state[0]))
        longer = run > self._state[1]
        self._state = torch.stack(
            (
                run,
                torch.where(longer, run, self._state[1]),
                torch.where(longer, torch.full_like(run, step), self._state[2]),
            )
        )

    def take(self, step: int) -> torch.Tensor:
        """At step `step`: (run, longest run, its last step) since the last take, still on the device; the next
        window starts from the current run."""
        state = self._state
        run = state[0]
        self._state = torch.stack((run, run, torch.where(run > 0, torch.full_like(run, step), torch.zeros_like(run))))
        return state

    def decide(self, runs: list[tuple[int, int, int]], step: int) -> bool:
        run = max(r[0] for r in runs)
        worst, end = max((r[1], r[2]) for r in runs)
        self.count = run
        if worst >= self.limit:
            raise Diverged(
                f"the loss was not finite for {worst} steps in a row (steps {end - worst + 1}-{end}); "
                "nothing was saved since, so the newest checkpoint is the last good one",
                fix="resume with a lower training.lr, more warmup_steps, or grad_clip; check the data",
                step=step,
            )
        if run:
            self.log(
                f"WARNING: the loss is not finite at step {step} ({run} step(s) in a row, of at most "
                f"{self.limit}); no checkpoint is saved while it is not finite"
            )
        return run == 0


def host_values(t: torch.Tensor) -> list:
    """Read a (small) device tensor on the host: the loop's one way of waiting for the GPU on purpose, so that a
    test can count it beside the implicit reads (float(), .item(), bool())."""
    return t.tolist()


def _counts(row: list[float | None]) -> tuple[int, int, int]:
    """A report row's non-finite counts (run, worst, its end step): whole numbers from the device, never NaN, so
    never None after the gather."""
    run, worst, end = row[1:4]
    assert run is not None and worst is not None and end is not None, row
    return int(run), int(worst), int(end)


def _scalar(v) -> float | None:
    if v is None:
        return None
    return float(v)  # a device tensor: read here, on a log step


class Reporter:
    """The steps where the loop decides something, and the log steps among them.

    `tick(info)` after every step (no sync: device counters only); `check(step, loss, log=...)` at a decision
    step: one device read of this rank's loss and non-finite counts, one gather of every rank's row; raises
    Diverged. `log(...)` then writes the step line: tokens/s and time per step over the window since the last
    logged step (reading the loss waited for the GPU, so the window's time is the GPU's), MFU, memory over ranks.
    """

    def __init__(
        self,
        sync: StepSync,
        watch: NonFiniteWatch,
        metrics,
        *,
        is_gpu: bool,
        tokens_per_step: int,
        flops_per_token: float,
        world_size: int,
        clock: ComputeClock | None = None,
        stragglers: StragglerWatch | None = None,
        collectives: CollectiveClock | None = None,
    ):
        import time

        from .metrics import MemoryWindow, device_peak_tflops

        self.sync, self.watch, self.metrics = sync, watch, metrics
        self.is_gpu, self.tokens_per_step, self.flops_per_token = is_gpu, tokens_per_step, flops_per_token
        self.world_size = world_size
        self.clock = clock if clock is not None else ComputeClock(is_gpu)
        self.stragglers = stragglers  # None: a world of one rank has no peers to be slower than
        self._forward: list[float | None] = []  # every rank's forward seconds per step at the last log step
        self.collectives = collectives  # None: no peers to wait for
        self._waits: list[float] | None = None  # every rank's seconds per step waiting in collectives, last window
        self._warm = False
        self.memory = MemoryWindow(is_gpu)
        self.peak_tflops, self.device_name = device_peak_tflops(is_gpu)
        if is_gpu and self.peak_tflops is None:
            metrics.log(
                f"note: no dense bf16 peak is known for {self.device_name!r} "
                "(launcher.catalog.DEVICE_PEAK_TFLOPS): MFU is not reported"
            )
        self._clock = time.perf_counter
        self._t0 = self._clock()
        self._steps = 0
        self._skipped: torch.Tensor | int = 0
        self._info: dict = {}

    def restart_window(self) -> None:
        self._t0, self._steps = self._clock(), 0

    def tick(self, info: dict) -> None:
        self._steps += 1
        self.clock.tick()
        self._info = info
        if info.get("skipped") is not None:
            self._skipped = self._skipped + info["skipped"]

    def check(self, step: int, loss, *, log: bool) -> tuple[float, bool, list[dict]]:
        """(mean loss over ranks, finite now, every rank's memory figures when `log`)."""
        from .metrics import MEMORY_FIELDS

        state = self.watch.take(step)
        t = torch.as_tensor(loss, device=state.device).detach().to(torch.float64).reshape(1)
        value, run, worst, end = host_values(torch.cat((t, state.to(torch.float64))))  # the step's one read
        mem = self.memory.read() if log else dict.fromkeys(MEMORY_FIELDS)
        forward = self.clock.take() if log else None  # after the read above: the window's work is done
        waited = self.collectives.take() if log and self.collectives is not None else None
        count, total = waited if waited is not None else (None, None)
        row = [value, run, worst, end, *(mem[k] for k in MEMORY_FIELDS), forward, count, total]
        rows = self.sync.gather(step, row)
        finite = self.watch.decide([_counts(r) for r in rows], step)
        losses = [r[0] for r in rows if r[0] is not None]  # None: a rank's loss was not finite
        mean = sum(losses) / len(losses) if len(losses) == len(rows) else math.nan
        memory = [dict(zip(MEMORY_FIELDS, r[4 : 4 + len(MEMORY_FIELDS)], strict=True)) for r in rows]
        if log:
            self._forward = [r[4 + len(MEMORY_FIELDS)] for r in rows]
            waits = [None if r[-2] is None or r[-1] is None else (r[-2], r[-1]) for r in rows]
            self._waits = collective_waits(waits, self.is_gpu, self._steps) if self._warm else None
            if self.stragglers is not None and self._warm:  # the attempt's first window warms up (lazy init)
                self.stragglers.update(self._forward, self._waits)
            self._warm = True
        return mean, finite, memory

    def log(self, step: int, loss: float, lr: float, memory: list[dict], extra: dict | None = None) -> None:
        from .metrics import MFUError, RankFigures, mfu

        seconds = self._clock() - self._t0
        steps = max(1, self._steps)
        tps = self.tokens_per_step * steps / seconds if seconds > 0 else 0.0
        value, error = None, None
        try:
            value = mfu(tps, self.world_size, self.flops_per_token, self.peak_tflops)
        except MFUError as e:
            error = str(e)
        info = self._info
        extra = dict(extra or {})
        if info.get("loss_scale") is not None:
            extra["loss_scale"] = _scalar(info["loss_scale"])
        skipped = int(self._skipped) if isinstance(self._skipped, int) else int(self._skipped.item())
        if skipped:
            extra["skipped_steps"] = skipped
        self._skipped = 0
        known = sorted(v for v in self._forward if v is not None)
        if known:
            extra["forward_s"] = {
                "min": round(known[0], 6),
                "median": round(statistics.median(known), 6),
                "max": round(known[-1], 6),
                "slowest_rank": max(range(len(self._forward)), key=lambda r: self._forward[r] or 0.0),
            }
        if self._waits is not None:
            extra["collective_wait_s"] = [round(w, 6) for w in self._waits]  # per rank, per step
        watch = self.stragglers
        if watch is not None and watch.last:  # every slow rank goes in the record, with its streak; the log
            # names a rank once, as its streak becomes persistent: one slow window is noise on a shared host, and
            # a line at every log step of a long streak would fill the log
            extra["stragglers"] = [s.record() for s in watch.last]
            for s in watch.newly_persistent():
                self.metrics.log(f"WARNING: straggler: {s.describe()}")
        self.metrics.step(
            step,
            loss=loss,
            lr=lr,
            tokens_per_s=tps,
            step_time=seconds / steps,
            grad_norm=_scalar(info.get("grad_norm")),
            memory=RankFigures.of(memory, self.is_gpu),
            mfu=value,
            mfu_error=error,
            extra=extra,
        )
        self.restart_window()


__all__ = ["Agreement", "NonFiniteWatch", "Reporter", "StepSync", "host_values"]
