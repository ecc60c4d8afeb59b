"""The `strategy: auto` decision rules on several models and cluster sizes."""

import pytest

from launcher.plan import make_plan
from launcher.recipe import load_text


def plan_for(model: str, accel: str, nodes: int = 1, extra: str = "", training: str = "micro_batch: 1, steps: 10"):
    return make_plan(
        load_text(f"""
name: t
model: {{{model}}}
parallelism: {{strategy: auto{extra}}}
resources: {{accelerator: "{accel}", nodes: {nodes}}}
training: {{{training}}}
""")
    )


def test_small_model_uses_ddp():
    p = plan_for("params: 1000000000, seq_len: 2048", "H100:8")
    assert p.strategy == "ddp" and p.memory.fits
    assert p.layout.activation_checkpointing == "none" and p.layout.offload == "none"
    assert any("ddp" in r and "fits" in r for r in p.reasons)


def test_7b_on_a100s_shards_the_optimizer_before_the_weights():
    # DDP needs 16 B/param = 108 GB for 6.7B; grad-op keeps 2 B/param of weights + sharded rest.
    p = plan_for("preset: llama2-7b, seq_len: 2048", "A100-80GB:8")
    assert p.strategy == "fsdp_grad_op" and p.memory.fits
    assert any(r.startswith("ddp needs") for r in p.reasons)


def test_deepspeed_family_names_zero_stages():
    p = plan_for("preset: llama2-13b, seq_len: 2048", "A100-80GB:8", extra=", backend: deepspeed")
    assert p.strategy in ("zero2", "zero3") and p.memory.fits


def test_70b_needs_full_sharding_and_checkpointing():
    p = plan_for("preset: llama3-70b, seq_len: 8192", "H100:8", nodes=8)
    assert p.strategy in ("fsdp", "hybrid") and p.memory.fits
    assert p.layout.activation_checkpointing in ("selective", "full")
    assert p.layout.tp == 1  # 70.6B is under the TP threshold


def test_405b_gets_tensor_parallel_within_the_node():
    p = plan_for("preset: llama3-405b, seq_len: 8192", "H100:8", nodes=16)
    assert p.layout.tp == 8
    assert p.layout.tp * p.layout.pp * p.layout.dp == p.world_size
    assert p.memory.fits
    assert any("tensor parallel 8" in r for r in p.reasons)


def test_nothing_fits_says_so():
    p = plan_for("preset: llama3-405b, seq_len: 8192", "L4:1")
    assert not p.memory.fits
    assert "nothing fits" in p.reasons[-1]


def test_more_gpus_shrink_sharded_memory():
    small = plan_for(
        "preset: llama2-13b, seq_len: 4096", "A100-80GB:8", nodes=1, extra=", activation_checkpointing: full"
    )
    big = plan_for(
        "preset: llama2-13b, seq_len: 4096", "A100-80GB:8", nodes=4, extra=", activation_checkpointing: full"
    )
    assert big.memory.total <= small.memory.total


def test_explicit_strategy_is_respected_even_if_it_does_not_fit():
    p = plan_for("preset: llama2-70b", "A100:8")
    q = make_plan(
        load_text("""
name: t
model: {preset: llama2-70b}
parallelism: {strategy: ddp}
resources: {accelerator: "A100:8"}
training: {steps: 10}
""")
    )
    assert q.strategy == "ddp" and not q.memory.fits
    assert p.strategy != "ddp"


def test_batch_split_and_time_and_cost():
    p = plan_for(
        "preset: llama3-8b, seq_len: 8192", "H100:8", nodes=2, training="micro_batch: 1, global_batch: 256, steps: 100"
    )
    assert p.grad_accum * p.layout.micro_batch * p.layout.dp == 256
    assert p.tokens_per_step == 256 * 8192
    # 6N + attention flops per token, at the assumed MFU over 16 H100s
    flops = (6 * p.params + 12 * 32 * 4096 * 8192) * 256 * 8192
    assert p.flops_per_step == flops
    assert p.usd > 0 and p.step_seconds > 0


def test_checkpoint_interval_follows_young_daly():
    """More GPUs -> shorter MTBF -> checkpoint more often (in time)."""
    a = plan_for("preset: llama3-8b", "H100:8", nodes=1, training="micro_batch: 1, global_batch: 64, steps: 100000")
    b = plan_for("preset: llama3-8b", "H100:8", nodes=16, training="micro_batch: 1, global_batch: 1024, steps: 100000")
    assert b.checkpoint_every * b.step_seconds < a.checkpoint_every * a.step_seconds


def _accumulating_recipe(
    strategy: str,
    accel: str,
    grad_reduce: str = "auto",
    preset: str = "llama3-8b",
    ac: str = "auto",
    global_batch: int = 64,
    nodes: int = 1,
):
    return load_text(f"""
name: t
model: {{preset: {preset}, seq_len: 2048}}
parallelism: {{strategy: {strategy}, grad_reduce: {grad_reduce}, activation_checkpointing: {ac}}}
resources: {{accelerator: "{accel}", nodes: {nodes}}}
training: {{micro_batch: 1, global_batch: {global_batch}, steps: 10}}
""")


def _accumulating(*args, **kw):
    return make_plan(_accumulating_recipe(*args, **kw))


def test_fsdp_reduces_once_per_step_when_the_unsharded_gradients_fit():
    """8B on 8 x H100: the unsharded fp32 gradients (32 GB) fit beside the sharded states, so the plan picks one
    reduce-scatter per step, and its memory counts them; the per-micro-batch plan is the smaller one."""
    once = _accumulating("fsdp", "H100:8")
    every = _accumulating("fsdp", "H100:8", "every_micro_batch")
    assert once.layout.grad_accum == 8 and once.layout.grad_reduce == "once_per_step" and once.memory.fits
    assert any("once per step" in r and "fits" in r for r in once.reasons)
    assert every.layout.grad_reduce == "every_micro_batch"
    # the difference at the peak is the unsharded fp32 gradients less the sharded ones: 4 B x n x (1 - 1/8)
    extra = 4 * once.params * (1 - 1 / 8)
    assert once.memory.grads - every.memory.grads == pytest.approx(extra, rel=0.02)


def test_fsdp_keeps_reducing_every_micro_batch_when_the_unsharded_gradients_do_not_fit():
    """70B on 4 nodes of 8 x H100: the sharded states fit (16 B x 70B / 32), the unsharded fp32 gradients
    (4 B x 70B = 282 GB per GPU) never would."""
    p = _accumulating("fsdp", "H100:8", preset="llama3-70b", ac="full", global_batch=128, nodes=4)
    assert p.layout.grad_reduce == "every_micro_batch" and p.memory.fits and p.layout.grad_accum == 4
    assert any("each of the 4 micro-batches" in r and "would need" in r for r in p.reasons)


def test_once_per_step_applies_only_where_fsdp2_accumulates():
    """DDP reduces once per step anyway, DeepSpeed by its own schedule; with one micro-batch there is nothing to
    accumulate. The plan then says nothing about it and its memory is what it was."""
    for strategy in ("ddp", "zero2", "zero3"):
        p = _accumulating(strategy, "H100:8", preset="llama3-8b")
        assert not p.layout.reduces_once_per_step
        assert not any("once per step" in r for r in p.reasons), strategy
    single = _accumulating("fsdp", "H100:8", global_batch=8)
    assert single.layout.grad_accum == 1 and not single.layout.reduces_once_per_step


def test_grad_reduce_survives_the_plan_file(tmp_path):
    """The plan file holds the Plan as msgspec encodes it: the job reads back exactly what was planned."""
    from launcher import planfile

    recipe = _accumulating_recipe("fsdp", "H100:8")
    p = make_plan(recipe)
    (tmp_path / "plan.json").write_text(planfile.dumps(recipe, p))
    _, back, doc = planfile.read(tmp_path / "plan.json")
    assert back == p and back.layout.grad_reduce == "once_per_step"
    assert doc["plan"]["layout"]["grad_reduce"] == "once_per_step"
    assert p.to_dict()["grad_reduce"] == "once_per_step"


def _405b(*sets: str):
    from launcher.recipe import load
    from testpaths import RECIPES

    return load(str(RECIPES / "llama3-405b.yaml"), ["resources.nodes=32", *sets])


@pytest.mark.parametrize(
    "sets, problem",
    [
        # global_batch 16 of micro-batches of 2 over tp8 pp8 (dp 4) is 2 micro-batches per step, and 1F1B needs 8
        (("training.global_batch=16", "training.micro_batch=2"), "1F1B needs at least as many micro-batches"),
        # the runtime refuses fp16 under a pipeline (the loss, which the scaler scales, is on the last stage only)
        (
            ("training.global_batch=64", "training.micro_batch=2", "parallelism.precision=fp16"),
            "fp16 loss scaling is not supported with pipeline parallelism",
        ),
    ],
)
def test_auto_does_not_pick_a_pipeline_the_job_could_not_run(sets, problem):
    """The search skips a tensor/pipeline degree validate would refuse, with the rule's own words; what it picks
    then passes validate's pipeline rules (here: no pipeline at all, since none runs)."""
    from launcher.plan.pipeline import schedule_problem
    from launcher.validate import validate

    r = _405b("parallelism.sequence_parallel=false", *sets)
    p = make_plan(r)
    lay = p.layout
    assert schedule_problem(lay.pp_schedule, lay.pp, lay.grad_accum, 126) is None
    assert not {"pipeline-schedule", "fp16-pipeline"} & {f.rule for f in validate(r, p)}
    assert any("pp=8 not tried: " + problem in reason for reason in p.reasons)


def test_auto_turns_on_sequence_parallelism_with_tensor_parallelism():
    """Llama 3 70B at 8192 tokens, micro-batch 1, no activation checkpointing, on 8 x 8 H100: without sequence
    parallelism only parameter offload fits at tensor 8; with it (the norms and the residual stream split over the
    sequence too) plain FSDP does. A recipe that writes sequence_parallel keeps its choice."""
    recipe = """
name: t
model: {preset: llama3-70b, seq_len: 8192}
parallelism: {strategy: auto, activation_checkpointing: none%s}
resources: {accelerator: "H100:8", nodes: 8}
training: {micro_batch: 1, global_batch: 512, steps: 10}
"""
    p = make_plan(load_text(recipe % ""))
    assert p.memory.fits and p.layout.tp == 8 and p.layout.sequence_parallel and p.layout.offload == "none"
    assert p.to_dict()["sequence_parallel"] is True
    assert any(r.startswith("sequence parallelism with tensor 8") for r in p.reasons)
    off = make_plan(load_text(recipe % ", sequence_parallel: false"))
    assert not off.layout.sequence_parallel and off.memory.total > p.memory.total
    assert not any(r.startswith("sequence parallelism") for r in off.reasons)
