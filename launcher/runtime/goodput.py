"""The goodput ledger: where a run's time went, by cause, with what each cause cost at the plan's prices
(`dtlaunch status NAME --goodput`, `plot --goodput`), and the checkpoint interval the run's own failures call
for (printed there; applied at a restart with `checkpoint.adapt`). Pure functions of the records.
Goodput = useful training time / allocated time.

Read from the run's own records (metrics.jsonl): each attempt begins with its `start` event; `preflight` ends the
checks; the first logged step (less its own steps' time) begins training; a `checkpoint` stalls it (all of a
synchronous save, an async one's wait and staging); the attempt ends with its last record (the job script's
`exited` record, where it writes one). Steps an attempt trained past the checkpoint the next attempt resumed from
were trained twice: lost work. Between two attempts lies the recovery (restart, requeue).

Allocated time is the time the job held its nodes. Each `start` record carries its allocation's start
(jobenv.ALLOCATION_START, set by the job script), so an attempt in a new allocation (a requeue, a recovery onto
fresh nodes, a resubmission) splits the time since the one before ended, where the job script recorded that end:
until the new allocation began the job was queued, holding nothing (not allocated); from then on, recovery. An
end that went unrecorded counts as allocated throughout, and so does everything without allocation starts
(torchrun run by hand). The queue before the first allocation is not allocated time either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..jobenv import EXITED_EVENT, METRICS_FILE, read_metrics, span

CAUSES = (
    ("queue", "queued, holding no nodes (not allocated)"),
    ("preflight", "pre-training checks"),
    ("startup", "start-up: model build, restore"),
    ("useful", "training (useful)"),
    ("lost", "lost work: steps trained again after a failure"),
    ("checkpoint", "checkpoint stalls"),
    ("ending", "after the last step: hang detection, final save, exit"),
    ("recovery", "between attempts, allocated: restart, requeue"),
)


@dataclass
class Attempt:
    start: float
    end: float
    allocation: float | None = None  # its allocation's start (the start record's allocation_start)
    exited: bool = False  # the job script recorded the training's exit (jobenv.EXITED_EVENT): its end is known
    from_step: int = 0
    last_step: int | None = None
    preflight_end: float | None = None
    first_step_start: float | None = None
    last_step_time: float | None = None
    stall: float = 0.0
    records: list[dict] = field(default_factory=list)


def checkpoint_stall(r: dict) -> float:
    """How long a checkpoint record's save held training: its `stalled` (an async save: the previous save's wait
    and the staging), else all of a synchronous save's `seconds` (records written before `stalled` was)."""
    if isinstance(r.get("stalled"), (int, float)):
        return float(r["stalled"])
    if not r.get("asynchronous") and isinstance(r.get("seconds"), (int, float)):
        return float(r["seconds"])
    return 0.0


def attempts(records: list[dict]) -> list[Attempt]:
    """The run's attempts, each from its `start` event to its last record."""
    out: list[Attempt] = []
    for r in records:
        t = r.get("time")
        if not isinstance(t, (int, float)):
            continue
        if r.get("event") == "start" or not out:
            began = r.get("allocation_start")
            out.append(Attempt(start=t, end=t, allocation=began if isinstance(began, (int, float)) else None))
        a = out[-1]
        a.end = max(a.end, t)
        a.records.append(r)
        ev = r.get("event")
        if ev == "preflight":
            a.preflight_end = t
        elif ev == EXITED_EVENT:
            a.exited = True
        elif ev == "resume" and isinstance(r.get("step"), int):
            a.from_step = r["step"]
        elif ev == "checkpoint":
            a.stall += checkpoint_stall(r)
        elif ev is None and isinstance(r.get("step"), int) and "loss" in r:
            if a.first_step_start is None:
                window = float(r.get("step_time_s") or 0.0) * max(1, r["step"] - a.from_step)
                a.first_step_start = max(t - window, a.preflight_end or a.start)
            a.last_step, a.last_step_time = r["step"], t
    return out


def kept_steps(runs: list[Attempt], i: int) -> int:
    """The steps attempt `i` trained that count: up to the step the next attempt resumed from."""
    a = runs[i]
    if a.last_step is None:
        return 0
    next_from = runs[i + 1].from_step if i + 1 < len(runs) else a.last_step
    return max(0, min(a.last_step, next_from) - a.from_step)


def began(runs: list[Attempt]) -> float:
    """When the run's first allocation began (its first attempt's start when the records do not say)."""
    a = runs[0]
    return min(a.allocation, a.start) if a.allocation is not None else a.start


def queued_between(a: Attempt, b: Attempt) -> float:
    """The time between attempts a and b that the job held no nodes: from a's end to b's allocation's start,
    when b began a new allocation and the job script recorded a's end; 0 for a restart within a's allocation,
    and 0 when a's end went unrecorded (a lost VM's records end at its last checkpoint, well before it was gone:
    the time is counted as allocated, recovery)."""
    if b.allocation is None or b.allocation == a.allocation or not a.exited:
        return 0.0
    return min(max(0.0, b.allocation - a.end), max(0.0, b.start - a.end))


def allocated(runs: list[Attempt]) -> float:
    """The run's allocated time: from its first allocation's start to the last attempt's end, less the time it
    was queued between allocations."""
    if not runs:
        return 0.0
    return runs[-1].end - began(runs) - sum(queued_between(a, b) for a, b in zip(runs, runs[1:], strict=False))


def ledger(records: list[dict], created: float | None = None) -> dict[str, float]:
    """Seconds by cause (CAUSES), plus `allocated`, `goodput` (useful / allocated), `elapsed` (the first allocation's
    start to the last end, the queue between allocations included) and `goodput_elapsed` (useful / elapsed)."""
    runs = attempts(records)
    secs = dict.fromkeys((k for k, _ in CAUSES), 0.0)
    if not runs:
        return {**secs, "allocated": 0.0, "goodput": 0.0, "elapsed": 0.0, "goodput_elapsed": 0.0}
    if created is not None:
        secs["queue"] = max(0.0, began(runs) - created)
    secs["startup"] += runs[0].start - began(runs)  # the job script's work before the first attempt's start
    for i, a in enumerate(runs):
        pre_end = a.preflight_end if a.preflight_end is not None else a.start
        secs["preflight"] += pre_end - a.start
        if a.first_step_start is None or a.last_step_time is None or a.last_step is None:
            secs["startup"] += a.end - pre_end  # never trained a step
        else:
            secs["startup"] += a.first_step_start - pre_end
            stall = min(a.stall, a.last_step_time - a.first_step_start)
            training = a.last_step_time - a.first_step_start - stall
            trained = max(1, a.last_step - a.from_step)
            kept = kept_steps(runs, i)
            secs["useful"] += training * kept / trained
            secs["lost"] += training * (trained - kept) / trained
            secs["checkpoint"] += stall
            secs["ending"] += a.end - a.last_step_time
        if i + 1 < len(runs):
            queued = queued_between(a, runs[i + 1])
            secs["queue"] += queued
            secs["recovery"] += max(0.0, runs[i + 1].start - a.end) - queued
    total = allocated(runs)
    elapsed = runs[-1].end - began(runs)
    return {
        **secs,
        "allocated": total,
        "goodput": secs["useful"] / total if total > 0 else 0.0,
        "elapsed": elapsed,
        "goodput_elapsed": secs["useful"] / elapsed if elapsed > 0 else 0.0,
    }


def interruptions(runs: list[Attempt]) -> list[int]:
    """The attempts that were interrupted: those another attempt followed without their having ended the run
    (the last attempt is running, ended the run, or has not been requeued yet: it never counts)."""
    return [i for i, a in enumerate(runs[:-1]) if not any(r.get("event") == "end" for r in a.records)]


def measured_interval(records: list[dict]) -> dict | None:
    """The checkpoint interval re-derived from what happened: the time between interruptions (allocated time /
    interruptions), the mean measured checkpoint write and the mean recovery (from an attempt's last step to the
    next one's first: hang detection, requeue, restart, restore) give Young/Daly's interval and the
    availability-optimal one (plan/cost.py); in steps at the mean logged step time, from the availability-optimal
    one. None until the run has been interrupted, has saved and has trained a step."""
    from ..plan.cost import availability_interval, young_daly_interval

    runs = attempts(records)
    hit = interruptions(runs)
    writes = [
        r["seconds"] for r in records if r.get("event") == "checkpoint" and isinstance(r.get("seconds"), (int, float))
    ]
    times = [r["step_time_s"] for r in records if isinstance(r.get("step_time_s"), (int, float)) and "loss" in r]
    if not hit or not writes or not times:
        return None
    recovery = 0.0
    for i in hit:
        a, b = runs[i], runs[i + 1]
        resumed = b.first_step_start if b.first_step_start is not None else (b.preflight_end or b.start)
        recovery += resumed - (a.last_step_time if a.last_step_time is not None else a.end)
    between = allocated(runs) / len(hit)
    write = sum(writes) / len(writes)
    step = sum(times) / len(times)
    seconds = availability_interval(write, between, recovery / len(hit))
    return {
        "between_interruptions_s": between,
        "write_s": write,
        "recovery_s": recovery / len(hit),
        "step_s": step,
        "young_daly_s": young_daly_interval(write, between),
        "interval_s": seconds,
        "every": max(1, round(seconds / step)),
    }


def _plan(run_dir: Path) -> dict:
    """The run's resolved plan (run_dir/plan.json), {} when there is none."""
    try:
        plan = json.loads((run_dir / "plan.json").read_text()).get("plan", {})
        return plan if isinstance(plan, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def usd_per_second(plan: dict) -> float | None:
    """The plan's price of the job's GPUs per second (its cost over its planned time); None on a CPU."""
    usd, steps, step_s = plan.get("usd"), plan.get("steps"), plan.get("step_seconds")
    try:
        return float(usd) / (float(steps) * float(step_s)) if usd and steps and step_s else None
    except (TypeError, ValueError):
        return None


def _span(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else span(seconds)


def report(run_dir: Path, created: float | None = None, plan_dir: Path | None = None) -> list[str]:
    """The ledger as lines: each cause's time, share of the allocated time and cost; then goodput. The prices are
    the plan's in `plan_dir` (a SLURM job's submit directory, above its run), run_dir by default."""
    records = read_metrics(run_dir) if (run_dir / METRICS_FILE).exists() else []
    led = ledger(records, created)
    n = len(attempts(records))
    if not n:
        return [f"{run_dir}: no records yet ({METRICS_FILE}): the job has not started"]
    plan = _plan(plan_dir or run_dir)
    rate = usd_per_second(plan)
    alloc = led["allocated"] or 1.0
    lines = [f"goodput of {run_dir} ({n} attempt(s)):"]
    for key, what in CAUSES:
        s = led[key]
        share = "" if key == "queue" else f" {s / alloc:6.1%}"
        cost = f"  ${s * rate:,.2f}" if rate is not None and key != "queue" else ""
        lines.append(f"  {what:<52} {_span(s):>8}{share}{cost}")
    cost = f"  ${alloc * rate:,.2f}" if rate is not None else ""
    lines.append(f"  {'allocated (the job holding its nodes)':<52} {_span(led['allocated']):>8}{cost}")
    lines.append(f"  goodput = useful / allocated = {led['goodput']:.1%}")
    if led["elapsed"] > led["allocated"]:
        lines.append(
            f"  (useful / elapsed, the queue between allocations included: {led['goodput_elapsed']:.1%} of "
            f"{_span(led['elapsed'])})"
        )
    advice = measured_interval(records)
    if advice is not None:
        planned = plan.get("checkpoint_every") if isinstance(plan.get("checkpoint_every"), int) else None
        lines.append(
            f"  checkpoint interval from this run: every {advice['every']} steps "
            f"({_span(advice['interval_s'])}, availability-optimal; Young/Daly {_span(advice['young_daly_s'])}): "
            f"an interruption every {_span(advice['between_interruptions_s'])}, a save {advice['write_s']:.2f}s, "
            f"a recovery {_span(advice['recovery_s'])}, a step {advice['step_s']:.3g}s"
        )
        if planned:
            lines.append(
                f"  the plan's: every {planned} steps (checkpoint.every sets it; checkpoint.adapt: true applies "
                "this run's interval at each restart)"
            )
    return lines
