"""`dtlaunch plan --trace`: the planner's memory estimate checked against the runtime's own code.

The runtime's model and wrapping run one training step for the recipe under `FakeTensorMode` with PyTorch's
`FSDPMemTracker`, on a fake process group of the plan's world size (`fake.trace_step`), at two shallow depths
and a third that checks the line; `report` extrapolates to the recipe's depth and sets the result beside the
planner's moments. Needs torch (the `train` extra); nothing here imports it until a trace runs, so the CLI
stays light. The tracker and the fake process group are private torch APIs: `check_torch` pins the range they
were checked on.

Cannot be traced: a GPT architecture (the runtime builds Llama blocks only), DeepSpeed ZeRO (it allocates its
flat buffers and launches its own kernels outside what fake tensors can follow), FSDP2 CPU offload (it pins
host memory), pipeline layouts (the schedule runs the step's micro-batches across stages at once, not the
micro-steps the tracker follows), and a plain DDP layout (moving the model and building its C++ reducer need
real storage; its formulas are checked on the tiny model's real tensors by tests/test_trace.py instead).
Tensor and sequence parallel layouts are traced: DTensor's collectives run on the fake process group too.
"""

from __future__ import annotations

from ..errors import DtlaunchError
from ..strategies import Family
from .report import Point, TracedStep, extrapolate

# The torch versions whose private FSDPMemTracker / fake process group this was written against (the `train`
# extra's range). Outside it the internals the harness touches may have moved.
SUPPORTED_TORCH = ((2, 12), (2, 15))  # [lower, upper)
# Traced depths: the line from the first two, the third checks it. Three layers at least: a model of two is
# not yet shaped like a deep one (its second layer in backward prefetches the embedding, not a layer), and
# the second layer's backward is where a small-vocabulary model peaks.
DEPTHS = (3, 5, 7)


class TraceError(DtlaunchError):
    """The plan cannot be traced here; the message says why and what to do instead."""


def check_torch() -> str:
    """torch's version if it is installed and in the supported range; a TraceError otherwise."""
    try:
        import torch
    except ImportError:
        raise TraceError(
            "--trace runs the training code on fake tensors and needs torch, which is not installed",
            fix="pip install 'dtlaunch[trace]' (or plan without --trace)",
        ) from None
    version = torch.__version__.split("+")[0]
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    lo, hi = SUPPORTED_TORCH
    if not lo <= major_minor < hi:
        raise TraceError(
            f"--trace uses private torch APIs (torch.distributed._tools.FSDPMemTracker, the fake "
            f"process group) checked on torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1] - 1}; this is {version}",
            fix=f"install a torch in that range (pip install 'torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}'), "
            "or plan without --trace",
        )
    return version


def check_plan(recipe, plan) -> None:
    """A TraceError for what the trace cannot run, saying what to do instead."""
    lay = plan.layout
    if recipe.model.shape() is None:
        raise TraceError(
            "the model is given by `params` only: there is no model to trace",
            fix="give model.preset, or model.layers/hidden/ffn_hidden/heads/vocab",
        )
    if recipe.model.architecture != "llama":
        # the runtime builds Llama blocks only: a trace would size a SwiGLU model against the plan's GPT figures
        raise TraceError(
            f"architecture {recipe.model.architecture!r} cannot be traced: the runtime builds Llama "
            "decoders only, so the trace would run another model than the one planned",
            fix="trace the same shape as a Llama with --set model.architecture=llama",
        )
    if recipe.model.hf_config is not None or recipe.entrypoint is not None:
        raise TraceError(
            "--trace follows dtlaunch's own Llama training step; a Hugging Face model or your own "
            "entrypoint runs other code, which the planner estimates with the same formulas",
            fix="trace the same shape as a dtlaunch model (model.layers/hidden/... instead of model.hf)",
        )
    if lay.spec.family is Family.DEEPSPEED:
        raise TraceError(
            f"{lay.strategy} cannot be traced: DeepSpeed ZeRO allocates its flat buffers and runs its "
            "own kernels where fake tensors cannot follow; its estimate stays the planner's alone",
            fix="trace the same model with a torch strategy for the activations and loss, e.g. "
            "--set parallelism.strategy=fsdp --set parallelism.offload=none",
        )
    if lay.pp > 1:
        raise TraceError(
            f"pipeline={lay.pp} cannot be traced: the trace follows one rank's micro-steps, while a pipeline "
            "schedule runs the step's micro-batches together across its stages (the rehearsal checks a "
            "pipeline's memory on real ranks instead: dtlaunch rehearse --only memory)",
            fix="trace the same model with --set parallelism.pipeline=1 for the other terms",
        )
    if lay.offload != "none":
        asked = recipe.parallelism.offload
        if asked == "auto":
            how = " (the planner's choice for offload: auto)"
        elif asked != lay.offload:  # say why the plan's mode is not the one the recipe wrote
            how = (
                f" (the recipe asks for {asked} offload, which {lay.strategy} does as {lay.offload} offload: "
                "FSDP2's policy moves parameters, gradients and optimizer state together)"
            )
        else:
            how = ""
        raise TraceError(
            f"offload {lay.offload} cannot be traced: FSDP2's CPUOffloadPolicy pins host memory, which "
            f"fake tensors on a CPU cannot do{how}",
            fix="--set parallelism.offload=none to trace the rest",
        )
    if not lay.spec.sharded and not lay.model_parallel:  # with tensor/pipeline parallelism ddp runs on FSDP2
        raise TraceError(
            "ddp cannot be traced on fake tensors: moving the model and building DDP's C++ reducer "
            "need real storage (its formulas are checked on a small model's real tensors in the test "
            "suite)",
            fix="trace the same model with --set parallelism.strategy=fsdp for its activations and loss",
        )


def trace(recipe, plan, depths: tuple[int, ...] | None = None) -> TracedStep:
    """The traced step at the recipe's depth: the preset in full if it has at most DEPTHS[1] layers, else
    `DEPTHS` extrapolated. Raises TraceError for what cannot be traced."""
    check_plan(recipe, plan)
    check_torch()
    from .fake import fake_world, trace_step

    layers = recipe.model.shape().layers
    if depths is None:
        depths = (layers,) if layers <= DEPTHS[1] else tuple(d for d in DEPTHS if d < layers) or (layers,)
    points = []
    with fake_world(plan.world_size):
        for d in depths:
            snap = trace_step(recipe, plan, d)
            points.append(Point(d, snap.moments, snap.seconds, snap.collectives))
    return extrapolate(points, layers)


__all__ = ["TraceError", "TracedStep", "check_plan", "check_torch", "trace", "DEPTHS", "SUPPORTED_TORCH"]
