"""Rules about what dtlaunch's runtime would refuse at start-up: found here, before the queue."""

from __future__ import annotations

import math
import os

from ..plan import Plan
from ..recipe import Recipe
from .core import rule


@rule("no-training-length", "error", "training.steps", "no training length", trainer_only=True)
def _length(r: Recipe, p: Plan):
    if p.steps is None:
        return (
            "the recipe gives neither training.steps nor training.tokens: `plan` can size memory, but a job needs "
            "to know when to stop",
            "set training.steps (or training.tokens)",
        )


@rule(
    "runtime-architecture",
    "error",
    "model.architecture",
    "an architecture the runtime does not build",
    trainer_only=True,
)
def _arch(r: Recipe, p: Plan):
    if r.model.architecture != "llama":
        return (
            f"the runtime trains llama decoders; architecture {r.model.architecture!r} is for planning only",
            "set model.architecture: llama (or use your own training script)",
        )


@rule("runtime-shape", "error", "model", "a model given only by its parameter count", trainer_only=True)
def _shape(r: Recipe, p: Plan):
    if r.model.shape() is None:
        return (
            "the runtime builds the model from its shape, and this one has only `params`",
            "give model.preset, or layers/hidden/ffn_hidden/heads/vocab",
        )


@rule(
    "deepspeed-model-parallel",
    "error",
    "parallelism",
    "DeepSpeed ZeRO with tensor or pipeline parallelism",
    trainer_only=True,
)
def _ds_mp(r: Recipe, p: Plan):
    lay = p.layout
    if (lay.tp > 1 or lay.pp > 1) and lay.spec.family.value == "deepspeed":
        return (
            f"the plan combines DeepSpeed {lay.strategy} with tensor {lay.tp} x pipeline {lay.pp}; dtlaunch's "
            "runtime runs tensor and pipeline parallelism with PyTorch (DTensor, torch.distributed.pipelining) "
            "and FSDP2, not with ZeRO",
            "set parallelism.backend: torch (or strategy: fsdp), or tensor: 1 and pipeline: 1",
        )


@rule(
    "tied-model-parallel",
    "error",
    "model.tied_embeddings",
    "tied embeddings with tensor or pipeline parallelism",
    trainer_only=True,
)
def _tied_mp(r: Recipe, p: Plan):
    s = r.model.shape()
    if s is not None and s.tied_embeddings and (p.layout.tp > 1 or p.layout.pp > 1):
        return (
            "the input and output embeddings share one weight, which tensor parallelism would split as two "
            "tensors and pipeline parallelism would put on the first and last stages",
            "use parallelism.tensor: 1 and pipeline: 1 for this model (FSDP shards it instead)",
        )


@rule("tp-shape", "error", "parallelism.tensor", "a model shape tensor parallelism cannot split", trainer_only=True)
def _tp_shape(r: Recipe, p: Plan):
    s, t = r.model.shape(), p.layout.tp
    if s is None or t == 1:
        return None
    bad = [f"{k} {v}" for k, v in (("ffn_hidden", s.ffn_hidden), ("vocab", s.vocab)) if v % t]
    if p.layout.sequence_parallel and p.seq_len % t:
        bad.append(f"seq_len {p.seq_len} (sequence parallelism splits it)")
    if bad:
        return (
            f"tensor {t} does not divide {', '.join(bad)}: the runtime splits the SwiGLU, the vocabulary (the "
            "embedding, the head and its logits) and, with sequence parallelism, the sequence evenly",
            "use a tensor degree that divides them (often 8, 4 or 2)",
        )


@rule("pipeline-schedule", "error", "parallelism.pipeline", "a pipeline its schedule cannot run", trainer_only=True)
def _pp_schedule(r: Recipe, p: Plan):
    from ..plan.pipeline import schedule_problem

    s = r.model.shape()
    problem = schedule_problem(
        p.layout.pp_schedule, p.layout.pp, p.layout.grad_accum, s.layers if s is not None else None
    )
    if problem:
        return (
            problem,
            "raise training.global_batch (more micro-batches per step), lower parallelism.pipeline, or "
            "set parallelism.pipeline_schedule: 1f1b",
        )


@rule(
    "fp16-pipeline", "error", "parallelism.precision", "fp16 loss scaling with pipeline parallelism", trainer_only=True
)
def _fp16_pp(r: Recipe, p: Plan):
    if p.layout.pp > 1 and p.layout.precision == "fp16":
        return (
            "fp16 needs loss scaling, and under a pipeline the loss exists on the last stage only: the runtime "
            "refuses it",
            "use parallelism.precision: bf16 (or fp32)",
        )


@rule(
    "hf-model-parallel",
    "error",
    "model.hf",
    "a Hugging Face model with pipeline or sequence parallelism",
    trainer_only=True,
)
def _hf_mp(r: Recipe, p: Plan):
    if r.model.hf_config is None:
        return None
    if p.layout.pp > 1:
        return (
            "pipeline parallelism splits dtlaunch's own Llama into stages; a transformers model builds its "
            "masks and rotary positions in the whole model's forward",
            "set parallelism.pipeline: 1",
        )
    if p.layout.tp > 1 and p.layout.sequence_parallel:
        return (
            "sequence parallelism splits the sequence between blocks, and transformers derives positions and "
            "the causal mask from the length a block gets",
            "set parallelism.sequence_parallel: false (tensor parallelism alone works for Llama-family models)",
        )


@rule("data-too-small", "error", "training.data.num_tokens", "less data than one global batch", trainer_only=True)
def _data_small(r: Recipe, p: Plan):
    d = r.training.data
    if d.source == "synthetic":
        sequences = (d.num_tokens - 1) // p.seq_len
        if sequences < p.global_batch:
            return (
                f"{d.num_tokens:,} synthetic tokens make {sequences} sequences of {p.seq_len}, fewer than one "
                f"global batch ({p.global_batch})",
                f"set training.data.num_tokens to at least {p.global_batch * p.seq_len + 1:,}",
            )


@rule("data-path", "warning", "training.data.path", "the data file does not exist here", trainer_only=True)
def _data_path(r: Recipe, p: Plan):
    d = r.training.data
    if d.source == "file" and d.path and "{" not in d.path and not os.path.exists(os.path.expanduser(d.path)):
        return (f"{d.path} does not exist on this machine", "check the path; it must exist on every node of the job")


@rule("entrypoint-missing", "error", "entrypoint.script", "the entrypoint script is not in its workdir")
def _entry_missing(r: Recipe, p: Plan):
    ep = r.entrypoint
    if ep is None or r.base_dir() is None and ep.workdir is None:
        return None
    from ..render.code import workdir

    wd = workdir(r)
    assert wd is not None  # the recipe has an entrypoint
    if not wd.is_dir():
        return (f"entrypoint.workdir {wd} is not a directory", "point it at your code (relative to the recipe file)")
    if ep.script is not None and not (wd / ep.script).is_file():
        return (
            f"{ep.script} is not in {wd}: the job runs a copy of entrypoint.workdir",
            "give the script's path relative to entrypoint.workdir (default: the recipe file's directory)",
        )
    return None


@rule(
    "step-longer-than-watchdog",
    "error",
    "training.timeout_seconds",
    "a step longer than the runtime's watchdog",
    trainer_only=True,
)
def _step_watchdog(r: Recipe, p: Plan):
    from ..jobenv import watchdog_seconds
    from ..render.torchrun import STEP_TIME_MARGIN

    step = STEP_TIME_MARGIN * p.step_seconds
    limit = watchdog_seconds(r.training.timeout_seconds)
    if step > limit:
        need = math.ceil((step - 60) / 2)
        return (
            f"a step is planned at {p.step_seconds:,.0f} s ({step:,.0f} s with the margin for a slower MFU), but the "
            f"runtime ends a rank that finishes no step for {limit:,.0f} s (2 x training.timeout_seconds + 60) "
            "with HANG: every step would end the job",
            f"set training.timeout_seconds to at least {need}, or make a step shorter (training.global_batch)",
        )


@rule("eval-pipeline", "error", "training.eval_every", "a validation loss with pipeline parallelism", trainer_only=True)
def eval_with_pipeline(r: Recipe, p: Plan):
    """Also the runtime's own refusal at start (a plan run by hand skips validation)."""
    if r.training.eval_every and p.layout.pp > 1:
        return (
            f"training.eval_every needs a forward pass outside the pipeline's schedule, which the pipeline engine "
            f"does not run (the plan's pipeline is {p.layout.pp})",
            "set training.eval_every: 0, or parallelism.pipeline: 1",
        )
