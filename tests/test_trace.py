"""The planner pinned to the runtime's code: PyTorch's memory tracker runs the runtime's own model, FSDP2
wrapping, loss and optimizer on fake tensors (`launcher.trace`), and every term of every moment of the step
must match the planner's formulas (`launcher.plan.moments`). A change to the model, the loss or the wrapping
that moves memory fails here, not in a job on an H100.

The expectations are the tracker's measurements, never the planner's own numbers; the planner is what is
tested. Fast by design (~20 s): the tiny preset is traced whole, an 8B shape at 3 and 5 layers and
extrapolated (each moment's memory is affine in the depth; one test checks that claim on real traces).
"""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.plan import make_plan
from launcher.plan.moments import timeline
from launcher.plan.params import count_params
from launcher.recipe import load
from launcher.trace import TraceError, check_plan, check_torch, trace
from launcher.trace.report import WARN_RATIO, compare
from testpaths import RECIPES

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators")

# Every term within 1% of the tracker's bytes, or within 64 KiB for the tiny model's smallest terms
# (AdamW's per-tensor step counters, FSDP2's padding of each shard to the world size).
TOLERANCE = 0.01
FLOOR = 64 * 1024


def _plan(name: str, *sets: str):
    recipe = load(str(RECIPES / name), list(sets))
    return recipe, make_plan(recipe)


def _planned(recipe, plan):
    return timeline(recipe.model.shape(), recipe.model.architecture, plan.params, plan.seq_len, plan.layout)


def _assert_matches(planned, traced, exact_split: bool):
    """At the traced peak, every term within TOLERANCE (or FLOOR); the peak at the same moment; every other
    moment's total within the 10% that `plan --trace` warns at (a moment is a stretch of the step, and away from
    the peak a small model's second-order temporaries may sit elsewhere in it than the planner assumes)."""
    assert set(planned) <= set(traced.moments), "the trace must see every moment the planner describes"
    assert max(planned, key=lambda m: sum(planned[m].values())) == traced.peak_at, "the peak is at another moment"
    for row in compare(planned[traced.peak_at], traced.moments[traced.peak_at], exact_split):
        assert abs(row.planned - row.traced) <= max(TOLERANCE * row.traced, FLOOR), (
            f"at the peak ({traced.peak_at}): {row.term} planned {row.planned:,.0f} B, traced {row.traced:,.0f} B"
        )
    for moment in planned:
        p, t = sum(planned[moment].values()), traced.totals[moment]
        assert p == pytest.approx(t, rel=WARN_RATIO), f"{moment}: planned {p:,.0f} B, traced {t:,.0f} B"
    # the moments the planner leaves out are below others it has: clipping and zero_grad below its optimizer
    # step, the gap between micro-steps below the next micro-step's forward (which holds all that and more)
    assert traced.totals.get("step", 0) <= traced.totals["optimizer step"]
    assert traced.totals.get("between micro-steps", 0) <= traced.totals["forward"]


@pytest.fixture(scope="module")
def tiny():
    recipe, plan = _plan("tiny.yaml")  # fsdp, fp32, no checkpointing, grad_accum 2 on 2 ranks
    return recipe, plan, trace(recipe, plan)


def test_tiny_preset_traced_in_full_matches_the_planner_term_by_term(tiny):
    recipe, plan, traced = tiny
    assert traced.exact and traced.depths == [recipe.model.shape().layers]
    _assert_matches(_planned(recipe, plan), traced, exact_split=False)
    # It fits with room to spare, so the plan reduces once per step: in the last micro-step, before any unit's
    # backward, every rank holds every unsharded fp32 gradient of the first one (4 bytes per parameter) and
    # no sharded gradient yet.
    assert plan.layout.grad_reduce == "once_per_step"
    n = count_params(recipe.model.shape())
    assert traced.moments["loss backward"]["grads"] == pytest.approx(4 * n, rel=1e-3)
    # after the step's reduce-scatters only the sharded ones are left, as with a reduce every micro-step
    assert traced.moments["optimizer step"]["grads"] == pytest.approx(4 * n / plan.world_size, rel=1e-3)


def test_8b_shape_extrapolated_from_3_and_5_layers_matches_the_planner():
    """The shipped 8B layout (FSDP, no checkpointing, micro-batch 1 of 8192 tokens, 128K vocabulary)."""
    recipe, plan = _plan(
        "llama3-8b.yaml",
        "parallelism.strategy=fsdp",
        "parallelism.activation_checkpointing=none",
        "parallelism.offload=none",
        "training.micro_batch=1",
        "parallelism.grad_reduce=every_micro_batch",
    )
    traced = trace(recipe, plan, depths=(3, 5))
    assert not traced.exact and traced.layers == 32
    _assert_matches(_planned(recipe, plan), traced, exact_split=True)
    assert traced.peak_at == "head backward"
    # Gradient accumulation keeps only the sharded fp32 gradients between micro-steps (4 bytes per parameter
    # over the world), never an unsharded copy: at the loss, no FSDP buffer is alive at all.
    loss = traced.moments["loss backward"]
    assert loss["grads"] == pytest.approx(4 * count_params(recipe.model.shape()) / plan.world_size, rel=1e-3)
    assert loss.get("buffers", 0) == 0


def test_small_vocabulary_shape_peaks_at_the_second_layers_backward():
    """Llama 2 13B's layout of the shipped ZeRO-3 recipe, on FSDP (32K vocabulary, no GQA, full checkpointing,
    micro-batch 4): a block is larger than the head, so the second layer in backward, holding the first one's
    reduce-scatter input, is the peak."""
    recipe, plan = _plan("llama2-13b-zero3.yaml", "parallelism.strategy=fsdp", "parallelism.offload=none")
    traced = trace(recipe, plan, depths=(3, 5))
    _assert_matches(_planned(recipe, plan), traced, exact_split=True)
    assert traced.peak_at == "layer backward"


@pytest.mark.parametrize(
    "sets",
    [
        # bf16, SwiGLU recomputed, one micro-step (gradients appear unit by unit)
        ("parallelism.precision=bf16", "parallelism.activation_checkpointing=selective", "training.global_batch=8"),
        # bf16, blocks recomputed, reshard_after_forward=False (every unit stays gathered through the loss)
        (
            "parallelism.precision=bf16",
            "parallelism.activation_checkpointing=full",
            "parallelism.strategy=fsdp_grad_op",
        ),
        # hybrid sharding, reducing once per step (the plan's choice here: it fits)
        (
            "parallelism.precision=bf16",
            "parallelism.strategy=hybrid",
            "resources.accelerator=cpu:1",
            "resources.nodes=2",
        ),
        # hybrid sharding, reduce-scatter every micro-step, all-reduce across replicas at the last one
        (
            "parallelism.precision=bf16",
            "parallelism.strategy=hybrid",
            "resources.accelerator=cpu:1",
            "resources.nodes=2",
            "parallelism.grad_reduce=every_micro_batch",
        ),
        # fp32, sharded gradients accumulated across micro-steps (reduce-scatter on each)
        ("parallelism.grad_reduce=every_micro_batch",),
        # bf16: each micro-step's 16-bit gradients added into the kept fp32 ones
        ("parallelism.precision=bf16", "parallelism.grad_reduce=once_per_step"),
        # tied embeddings (one weight in the root): the head's gradient waits in autograd for the embedding's
        ("model.tied_embeddings=true",),
        ("model.tied_embeddings=true", "parallelism.precision=bf16", "parallelism.grad_reduce=every_micro_batch"),
        # fp16 with dynamic loss scaling (the default): the scaler's overflow check reads a value fake tensors lack
        ("parallelism.precision=fp16",),
    ],
    ids=[
        "bf16-selective-one-micro-step",
        "bf16-full-grad_op",
        "bf16-hybrid-once",
        "bf16-hybrid-every-micro",
        "fp32-every-micro",
        "bf16-once",
        "tied-fp32-once",
        "tied-bf16-every-micro",
        "fp16-dynamic-loss-scaling",
    ],
)
def test_tiny_variants_match_the_planner(sets):
    recipe, plan = _plan("tiny.yaml", *sets)
    _assert_matches(_planned(recipe, plan), trace(recipe, plan), exact_split=False)


def test_two_depths_extrapolate_to_the_full_trace():
    """The claim the fast trace rests on: from 3 layers on, each moment's memory is affine in the depth."""
    recipe, plan = _plan("tiny.yaml", "model.layers=6")
    full = trace(recipe, plan, depths=(6,))
    line = trace(recipe, plan, depths=(3, 4))  # extrapolated to 6
    assert full.exact and not line.exact and line.layers == 6
    for moment, total in full.totals.items():
        assert line.totals[moment] == pytest.approx(total, rel=1e-9, abs=1), moment


def test_plan_trace_prints_the_comparison_as_json(tiny, monkeypatch):
    import launcher.trace

    monkeypatch.setattr(launcher.trace, "trace", lambda recipe, plan: tiny[2])  # traced above already
    res = CliRunner().invoke(cli, ["plan", str(RECIPES / "tiny.yaml"), "--trace", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["memory"]["peak_at"] == d["trace"]["peak_at"]
    assert set(d["trace"]["terms"]) == {"params", "grads", "optimizer", "buffers", "activations + loss", "total"}
    assert d["trace"]["warnings"] == [] and d["trace"]["fits"]


def test_deepspeed_cannot_be_traced_and_says_what_to_do():
    res = CliRunner().invoke(cli, ["plan", str(RECIPES / "llama2-13b-zero3.yaml"), "--trace"], standalone_mode=False)
    assert isinstance(res.exception, TraceError)
    assert "cannot be traced" in str(res.exception) and "parallelism.strategy=fsdp" in str(res.exception)


def test_a_refused_trace_still_prints_the_plan_as_json():
    """`--trace --json` on a plan that cannot be traced: the plan on stdout with the refusal in "trace", then the
    error and its exit code, as text mode prints the plan and then the error."""
    res = CliRunner().invoke(
        cli, ["plan", str(RECIPES / "llama2-13b-zero3.yaml"), "--trace", "--json"], standalone_mode=False
    )
    assert isinstance(res.exception, TraceError) and res.exception.exit_code == 2
    d = json.loads(res.stdout)
    assert d["strategy"] == "zero3" and d["memory"]["total"] > 0
    assert d["trace"] == {"refused": res.exception.message, "fix": res.exception.fix}
    assert "cannot be traced" in d["trace"]["refused"]


@pytest.mark.parametrize(
    "sets, says, fix",
    [
        # the runtime builds Llama blocks only: a GPT plan traced as a Llama would compare two different models
        (("model.architecture=gpt",), "architecture 'gpt' cannot be traced", "model.architecture=llama"),
        # FSDP2 offloads the optimizer only with the parameters: the refusal says why it names params
        (
            ("parallelism.offload=optimizer", "resources.accelerator=H100:2"),
            "the recipe asks for optimizer offload, which fsdp does as params offload",
            "parallelism.offload=none",
        ),
        # there is no model.shape field: name the fields there are
        (("model.preset=null", "model.params=1000000"), "given by `params` only", "model.layers/hidden"),
    ],
)
def test_untraceable_plans_are_refused_with_the_reason(sets, says, fix):
    recipe, plan = _plan("tiny.yaml", *sets)
    with pytest.raises(TraceError) as e:
        check_plan(recipe, plan)
    assert says in e.value.message and fix in e.value.fix


def test_trace_outside_the_supported_torch_range_is_an_error_with_a_fix(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.raises(TraceError, match="private torch APIs") as e:
        check_torch()
    assert "pip install" in e.value.fix


def test_trace_without_torch_is_an_error_with_a_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(TraceError, match="needs torch") as e:
        check_torch()
    assert "dtlaunch[trace]" in e.value.fix


@pytest.mark.parametrize(
    "sets",
    [
        ("parallelism.precision=fp32",),
        ("parallelism.precision=bf16",),
        ("parallelism.precision=bf16", "parallelism.activation_checkpointing=selective"),
    ],
    ids=["fp32", "bf16-autocast", "bf16-autocast-selective"],
)
def test_ddp_on_real_tensors_matches_the_planner(sets, tmp_path):
    """DDP cannot run on fake tensors (its C++ reducer and `module.to` need real storage), so its formulas are
    pinned on the tiny model's real tensors, in a gloo world of one rank (DDP keeps the same per rank at any
    world size): the whole step's peak under PyTorch's MemTracker against the planner's largest moment."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from launcher.runtime.engines import build_engine
    from launcher.runtime.models import build_model

    recipe, plan = _plan(
        "tiny.yaml", "parallelism.strategy=ddp", "resources.accelerator=cpu:1", "model.layers=2", *sets
    )
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        layout, _ = plan.layout.for_world(1)
        torch.manual_seed(0)
        module = build_model(recipe.model.shape(), layout.activation_checkpointing, device="cpu")
        training = recipe.training.replace(grad_clip=0.0)
        engine = build_engine(
            module, layout, recipe.replace(training=training), plan, 10, torch.device("cpu"), is_gpu=False
        )
        for group in engine.optimizer.param_groups:
            group["foreach"] = True  # as on CUDA
        batches = [torch.randint(0, 512, (layout.micro_batch, plan.seq_len + 1)) for _ in range(layout.grad_accum)]
        tracker = MemTracker()
        tracker.track_external(engine.model, engine.optimizer, *batches)
        with tracker:
            for it in range(2):
                if it:  # the second iteration, as the fake-tensor trace
                    gc.collect()
                    tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
                    tracker._peak_mem = {d: s["Total"] for d, s in tracker._peak_mem_snap.items()}
                for i in range(2):
                    tracker.reset_mod_stats()
                    engine.micro_step(batches[i][:, :-1], batches[i][:, 1:], last=i == 1)
                engine.step()
        traced = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    finally:
        dist.destroy_process_group()
    planned = max(sum(t.values()) for t in _planned(recipe, plan).values())
    assert planned == pytest.approx(traced, rel=TOLERANCE)
