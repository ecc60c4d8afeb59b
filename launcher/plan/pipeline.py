"""Pipeline parallelism as the runtime runs it: which blocks each stage holds, and how many micro-batches'
activations a rank keeps alive at once under each schedule. Pure; the runtime splits the model with
`stage_layers` and the planner charges memory with `in_flight`, so both describe the same pipeline.

Schedules (torch.distributed.pipelining):
- `1f1b` (Schedule1F1B, one stage per rank): stage r runs min(m, pp - r) forwards before its first backward,
  then alternates one backward and one forward, so it never holds more than min(m, pp - r) micro-batches
  ([MLM3] sec. 4.2.3; Narayanan et al. 2021, sec. 2.2). It needs m >= pp micro-batches.
- `interleaved_1f1b` (ScheduleInterleaved1F1B, `STAGES_PER_RANK` stages per rank, rank r holding stages r,
  r + pp, ...): smaller bubbles for more activations in flight; `in_flight` replays torch's order of
  operations (its warm-up count and stage indices) to find the largest number alive on a rank.
"""

from __future__ import annotations

SCHEDULES = ("1f1b", "interleaved_1f1b")
STAGES_PER_RANK = {"1f1b": 1, "interleaved_1f1b": 2}  # torchtitan's default for looped schedules


def num_stages(pp: int, schedule: str) -> int:
    return pp * STAGES_PER_RANK[schedule]


def stage_layers(layers: int, stages: int) -> list[int]:
    """Transformer blocks of each stage, in order. The embedding and the head each count as one block
    (torchtitan's split), so 126 blocks make 8 stages of 16 "blocks": 15 + the embedding, 16, ..., 15 + the
    head. The first stages get the remainder. ValueError when there are more stages than blocks + 2."""
    if stages < 1:
        raise ValueError("a pipeline needs at least one stage")
    if stages == 1:
        return [layers]
    eff = layers + 2
    if stages > eff:
        raise ValueError(
            f"{stages} pipeline stages for {layers} blocks (+ the embedding and the head): some stages would be empty"
        )
    per, extra = divmod(eff, stages)
    counts = [per + (1 if i < extra else 0) for i in range(stages)]
    counts[0] -= 1
    counts[-1] -= 1
    return counts


def stages_of_rank(rank: int, pp: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank `rank` runs: r, r + pp, ... (looped placement)."""
    return [rank + k * pp for k in range(STAGES_PER_RANK[schedule])]


def schedule_problem(schedule: str, pp: int, micro_batches: int, layers: int | None) -> str | None:
    """Why torch's schedule (or the split into stages, when `layers` is given) would refuse this pipeline
    (None: it runs)."""
    if pp == 1:
        return None
    if schedule not in SCHEDULES:
        return f"unknown pipeline schedule {schedule!r} (known: {', '.join(SCHEDULES)})"
    stages = num_stages(pp, schedule)
    if layers is not None and stages > layers + 2:
        return (
            f"{schedule} with pipeline {pp} makes {stages} stages, more than the model's {layers} blocks plus "
            "the embedding and the head"
        )
    if schedule == "1f1b" and micro_batches < pp:
        return (
            f"1F1B needs at least as many micro-batches per step as pipeline stages: grad_accum {micro_batches} "
            f"< pipeline {pp}"
        )
    if schedule == "interleaved_1f1b":
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            return (
                f"interleaved 1F1B needs the micro-batches per step ({micro_batches}) to be a multiple of "
                f"{rounds} (micro-batches // pipeline)"
            )
    return None


def precision_problem(pp: int, precision: str) -> str | None:
    """Why the runtime would refuse a pipeline in this precision (None: it runs): fp16 needs loss scaling, and the
    loss exists on the last stage only (`runtime.engines.mesh` refuses it at start-up)."""
    if pp > 1 and precision == "fp16":
        return "fp16 loss scaling is not supported with pipeline parallelism: the loss exists on the last stage only"
    return None


def _interleaved_ops(rank: int, pp: int, v: int, m: int) -> list[tuple[str, int]]:
    """torch's ScheduleInterleaved1F1B order of (F|B, stage) for one rank, without its idle slots."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    total = v * m

    def fwd(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def bwd(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    ops: list[tuple[str, int]] = [("F", fwd(op)) for op in range(warmup)]
    for op in range(warmup, total):
        ops += [("F", fwd(op)), ("B", bwd(op))]
    ops += [("B", bwd(op)) for op in range(total, total + warmup)]
    return ops


def steady(schedule: str, pp: int, micro_batches: int, rank: int) -> bool:
    """Whether the rank runs a backward before its last forward of the step (a 1F1B steady state): if not, it
    runs every forward first, and its peak comes in the first micro-batch's backward."""
    if pp == 1:
        return micro_batches > 1
    if schedule == "1f1b":
        return micro_batches > pp - rank
    ops = _interleaved_ops(rank, pp, STAGES_PER_RANK[schedule], micro_batches)
    last_f = max(i for i, (kind, _) in enumerate(ops) if kind == "F")
    return any(kind == "B" for kind, _ in ops[:last_f])


def in_flight(schedule: str, pp: int, micro_batches: int, rank: int, weights: dict[int, float]) -> float:
    """The most activations pipeline rank `rank` holds at once: the largest sum, over the forwards it has run
    and not yet run backward for, of `weights[stage]` (e.g. the stage's blocks)."""
    if pp == 1:
        return weights.get(0, 0.0)
    if schedule == "1f1b":
        return min(micro_batches, pp - rank) * weights.get(rank, 0.0)
    alive = best = 0.0
    for kind, stage in _interleaved_ops(rank, pp, STAGES_PER_RANK[schedule], micro_batches):
        alive += weights.get(stage, 0.0) if kind == "F" else -weights.get(stage, 0.0)
        best = max(best, alive)
    return best
