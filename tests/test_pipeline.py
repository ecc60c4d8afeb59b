"""The planner's pipeline (launcher.plan.pipeline) against torch.distributed.pipelining itself: the order of
operations it replays for interleaved 1F1B is torch's, rank by rank; the micro-batches it keeps in flight
follow the schedule chosen; and the split into stages is the one the runtime makes, for the tiny test model
and for Llama 3 405B."""

from __future__ import annotations

import pytest

from launcher.catalog import PRESETS
from launcher.plan.layout import Layout
from launcher.plan.memory import breakdown
from launcher.plan.params import count_params, layer_params, layer_params_per_rank
from launcher.plan.parts import part_of, rank_params
from launcher.plan.pipeline import _interleaved_ops, in_flight, schedule_problem, stage_layers, stages_of_rank


def torch_order(pp: int, v: int, m: int, rank: int) -> list[tuple[str, int]]:
    """torch's own ScheduleInterleaved1F1B order for one rank (its per-rank computation, without stages)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    s = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    s.n_local_stages, s.pp_group_size, s._n_microbatches = v, pp, m
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    return [
        ("F" if a.computation_type == _ComputationType.FORWARD else "B", a.stage_index)
        for a in s._calculate_single_rank_operations(rank)
        if a is not None
    ]


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (2, 6), (4, 4), (4, 8), (4, 12), (8, 8), (8, 16), (8, 32)])
def test_interleaved_order_is_torchs(pp, m):
    for rank in range(pp):
        assert _interleaved_ops(rank, pp, 2, m) == torch_order(pp, 2, m, rank), (pp, m, rank)


def alive_most(ops, weights) -> float:
    alive = best = 0.0
    for kind, stage in ops:
        alive += weights[stage] if kind == "F" else -weights[stage]
        best = max(best, alive)
    return best


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 16), (4, 4)])
def test_in_flight_follows_the_schedule(pp, m):
    """1F1B: stage r holds min(m, pp - r) micro-batches (torch's warm-up count); interleaved: the most forwards
    without their backward in torch's order, weighted by each stage's blocks. Interleaving holds more on the
    first rank ([Narayanan et al. 2021]: (1 + (pp - 1) / (pp v)) x 1F1B's)."""
    blocks = stage_layers(126, 2 * pp)
    for rank in range(pp):
        assert in_flight("1f1b", pp, m, rank, {rank: 1.0}) == min(m, pp - rank)
        ids = stages_of_rank(rank, pp, "interleaved_1f1b")
        w = {i: float(blocks[i]) for i in ids}
        assert in_flight("interleaved_1f1b", pp, m, rank, w) == alive_most(torch_order(pp, 2, m, rank), w)
    one = in_flight("1f1b", pp, m, 0, {0: 1.0}) * 126 / pp
    halves = {i: 126 / (2 * pp) for i in stages_of_rank(0, pp, "interleaved_1f1b")}
    two = in_flight("interleaved_1f1b", pp, m, 0, halves)
    assert two > one if m > pp else two == one  # with m == pp both hold every micro-batch of the rank's blocks


def test_stage_split_counts_the_embedding_and_the_head_as_blocks():
    assert stage_layers(126, 8) == [15] + [16] * 6 + [15]  # Llama 3 405B: 128 "blocks" in 8 equal stages
    assert stage_layers(4, 2) == [2, 2]  # the tiny model
    assert stage_layers(4, 4) == [1, 2, 1, 0]  # interleaved on 2 ranks: the last stage is the head alone
    assert sum(stage_layers(80, 16)) == 80
    with pytest.raises(ValueError):
        stage_layers(4, 7)


def test_schedules_refuse_what_torch_refuses():
    assert schedule_problem("1f1b", 4, 2, 32) and "1F1B needs" in schedule_problem("1f1b", 4, 2, 32)
    assert schedule_problem("1f1b", 4, 4, 32) is None
    assert "multiple" in schedule_problem("interleaved_1f1b", 4, 9, 32)  # 2 rounds of 4: 9 does not split
    assert schedule_problem("interleaved_1f1b", 4, 3, 32) is None  # one round of 3
    assert "stages" in schedule_problem("interleaved_1f1b", 4, 8, 4)


def test_rank_parameters_add_up_to_the_model():
    """Every pipeline rank's parameters, times the tensor-parallel degree, add up to the model's count, but for
    what tensor parallelism keeps whole on every rank (norm weights)."""
    sh = PRESETS["llama3-405b"]
    assert layer_params_per_rank(sh, 1) == layer_params(sh)
    for tp, pp, sched in ((1, 1, "1f1b"), (8, 1, "1f1b"), (8, 4, "1f1b"), (8, 4, "interleaved_1f1b"), (1, 8, "1f1b")):
        lay = Layout(strategy="fsdp", dp=1, tp=tp, pp=pp, grad_accum=8, pp_schedule=sched)
        total = sum(rank_params(sh, "llama", 0, lay, part_of(sh, lay, r)) for r in range(pp))
        whole_per_rank = (2 * sh.layers + 1) * sh.hidden  # the norms, whole on each tensor-parallel rank
        assert total * tp == pytest.approx(count_params(sh) + (tp - 1) * whole_per_rank, rel=1e-12), (tp, pp)


def test_405b_pipeline_ranks_under_each_schedule():
    """Llama 3 405B at tp 8 x pp 8: the first rank holds the most activations, more under interleaving; and
    the gradients torch's stages accumulate unsharded through the step (fp32, every parameter of the rank's
    stages) make the end of backward the peak, whatever the schedule."""
    from launcher.plan.moments import timeline

    sh = PRESETS["llama3-405b"]
    n = count_params(sh)
    acts = {}
    for sched in ("1f1b", "interleaved_1f1b"):
        lay = Layout(
            strategy="fsdp",
            dp=2,
            tp=8,
            pp=8,
            grad_accum=16,
            precision="bf16",
            sequence_parallel=True,
            activation_checkpointing="full",
            pp_schedule=sched,
        )
        per_rank = [
            timeline(
                sh, "llama", rank_params(sh, "llama", n, lay, part_of(sh, lay, r)), 8192, lay, part_of(sh, lay, r)
            )["layer backward"]["activations"]
            for r in range(8)
        ]
        assert per_rank[0] == max(per_rank)
        acts[sched] = per_rank[0]
        mem = breakdown(sh, "llama", n, 8192, lay, 80e9)
        assert mem.peak_at.startswith("end of backward on pipeline rank")
        assert mem.grads > 4 * rank_params(sh, "llama", n, lay, part_of(sh, lay, 0))
    assert acts["interleaved_1f1b"] > acts["1f1b"]
