"""A recipe's layout scaled down to run here (`dtlaunch rehearse`): the same strategy, tensor and pipeline degrees,
pipeline schedule, sequence parallelism, activation checkpointing and gradient accumulation, on a model shrunk
in width and depth so that every mesh dimension keeps its degree, on CPU ranks (gloo). Pure: recipe data in,
recipe data out, with a list of what had to change and why. The runs themselves are cli/rehearse.py's.

Why these sizes:
- heads = 2 x tp (at least 8) and kv_heads half as many (grouped-query attention as in the recipes' models), so
  each tensor rank holds whole heads; hidden 16 per head (128 at least: smaller, the fixed costs of a step
  outweigh the tensors the plan sizes); the SwiGLU width a multiple of 8 x tp;
- two layers per pipeline stage (interleaved 1F1B has two stages per rank), four without a pipeline;
- vocabulary 512 and sequence 64: both divide by every tensor degree up to 64 (sequence parallelism splits the
  sequence over the tensor group);
- fp32 arithmetic and deterministic kernels: layouts then differ from one rank only by the order of sums (about
  1e-6 on the loss over the first steps), so a parity tolerance of 1e-5 separates rounding from a real fault (a
  lost gradient shard or a wrong stage split moves the loss by more than 1e-3). bf16 or fp16 would hide such a
  fault under their own rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .pipeline import STAGES_PER_RANK

MAX_RANKS = 8  # what 2 CPU cores run in a few minutes (a tp x pp x dp world of 8 tiny ranks)
STEPS = 8  # every run's training.steps: the learning-rate schedule is the same in all of them
FIRST = 4  # steps compared for parity: AdamW turns rounding into chaos after a few steps
PARITY_TOL = 1e-5  # absolute, on the loss (see the module docstring)
RESUME_TOL = 1e-4  # after a reshard and a resume: the weights have passed through a save and another layout
MEMORY_TOL = 0.10  # the plan's tensors against a rank's counted peak, relative
SEQ = 64
VOCAB = 512


@dataclass
class Rehearsal:
    nproc: int  # ranks of the rehearsal layout
    layout: dict  # the recipe's layout, scaled down (recipe data)
    control: dict  # the same model, data and batch on one rank, no parallelism
    other: dict  # another layout of the same ranks (data parallel only): the reshard target
    degrees: dict[str, int]  # tp, pp, dp of the rehearsal layout
    full: dict[str, int]  # the same of the recipe's plan
    changes: list[str] = field(default_factory=list)


def _shape(tp: int, pp: int, schedule: str | None) -> dict[str, Any]:
    heads = max(8, 2 * tp)
    hidden = 16 * heads
    step = 8 * tp
    ffn = math.ceil(hidden * 2.75 / step) * step
    layers = 2 * pp * STAGES_PER_RANK.get(schedule or "1f1b", 1) if pp > 1 else 4
    return {
        "architecture": "llama",
        "layers": layers,
        "hidden": hidden,
        "ffn_hidden": ffn,
        "heads": heads,
        "kv_heads": heads // 2,
        "vocab": VOCAB,
        "seq_len": SEQ,
    }


def _degrees(lay, world: int, max_ranks: int, changes: list[str]) -> tuple[int, int, int]:
    """(tp, pp, dp) of the rehearsal: the recipe's, dp cut to 2 (then 1), tp and pp to 2 only when still too many."""
    tp, pp, dp = lay.tp, lay.pp, lay.dp
    if lay.shard is not None and 1 < lay.shard < dp:
        changes.append("hybrid sharding on one node: its replicas across nodes are not rehearsed")
    rdp = min(dp, 2)
    if tp * pp * rdp > max_ranks and rdp > 1:
        rdp = 1
    if tp * pp * rdp > max_ranks and tp > 2:
        changes.append(f"tensor {tp} -> 2: tensor x pipeline needs more than {max_ranks} ranks")
        tp = 2
    if tp * pp * rdp > max_ranks and pp > 2:
        changes.append(f"pipeline {pp} -> 2: tensor x pipeline needs more than {max_ranks} ranks")
        pp = 2
    if rdp != dp:
        changes.append(f"data parallel {dp} -> {rdp}: {world} ranks -> {tp * pp * rdp}")
    return tp, pp, rdp


def scale_down(recipe, plan, max_ranks: int = MAX_RANKS) -> Rehearsal:
    """The rehearsal of `recipe` as planned: its layout on at most `max_ranks` CPU ranks, dp reduced first."""
    lay = plan.layout
    full = {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "world": plan.world_size}
    changes: list[str] = []
    tp, pp, rdp = _degrees(lay, plan.world_size, max_ranks, changes)
    nproc = tp * pp * rdp
    ga = min(lay.grad_accum, 4)
    if pp > 1:  # each pipeline rank needs micro-batches to fill its stages; interleaving wants a multiple of pp
        ga = 2 * pp
    if ga != lay.grad_accum:
        changes.append(f"grad_accum {lay.grad_accum} -> {ga}")
    micro = 2
    model = _shape(tp, pp, lay.pp_schedule)
    changes.append(
        f"model: {model['layers']} layers x {model['hidden']} hidden, {model['heads']} heads ({model['kv_heads']} "
        f"kv), vocab {VOCAB}, sequence {SEQ} (the recipe's: {plan.params:,} parameters, sequence {plan.seq_len})"
    )
    if recipe.model.hf is not None:
        changes.append("model.hf: a Llama of the sizes above stands in for the Hugging Face model")
    if recipe.entrypoint is not None:
        changes.append("entrypoint: dtlaunch's own trainer trains the layout; the recipe's script is not run")
    if lay.precision != "fp32":
        changes.append(f"precision {lay.precision} -> fp32 (parity must tell a fault from rounding)")
    if lay.offload != "none":
        changes.append(f"offload {lay.offload} -> none (CPU ranks have no device memory to offload from)")
    strategy = lay.strategy
    training = {
        "micro_batch": micro,
        "global_batch": micro * rdp * ga,
        "steps": STEPS,
        "lr": recipe.training.lr,
        "warmup_steps": 2,
        "grad_clip": recipe.training.grad_clip or 1.0,
        "seed": recipe.training.seed,
        "deterministic": True,
        "preflight": False,
        "log_every": 1,
        "timeout_seconds": 30,
        "init_timeout_seconds": 120,
        "data": {"source": "synthetic", "num_tokens": 1 << 16},
    }
    parallelism = {
        "strategy": strategy,
        "tensor": tp,
        "pipeline": pp,
        "precision": "fp32",
        "activation_checkpointing": lay.activation_checkpointing,
        "offload": "none",
        "grad_accum": ga,
    }
    if tp > 1:
        parallelism["sequence_parallel"] = lay.sequence_parallel
    if pp > 1:
        parallelism["pipeline_schedule"] = lay.pp_schedule
    base = {
        "name": f"{recipe.name}-rehearsal",
        "model": model,
        "resources": {"accelerator": f"cpu:{nproc}", "nodes": 1, "network": "loopback"},
        "training": training,
        "checkpoint": {"every": FIRST, "keep": 10, "export": "none"},
        # no restarts: each run ends with its workers' own exit code, which is what the checks read
        "targets": {"default": "local", "local": {"max_restarts": 0}},
    }
    layout = {**base, "parallelism": parallelism}
    control = {
        **base,
        "name": f"{recipe.name}-control",
        "resources": {"accelerator": "cpu:1", "nodes": 1, "network": "loopback"},
        "parallelism": {
            "strategy": "ddp",
            "precision": "fp32",
            "activation_checkpointing": "none",
            "offload": "none",
            "grad_accum": rdp * ga,
        },
    }
    other: dict[str, Any] = {
        **base,
        "name": f"{recipe.name}-resharded",
        "resources": {"accelerator": f"cpu:{nproc}", "nodes": 1, "network": "loopback"},
        "parallelism": {
            "strategy": "fsdp" if strategy != "fsdp" or tp * pp > 1 else "ddp",
            "precision": "fp32",
            "activation_checkpointing": "none",
            "offload": "none",
            "grad_accum": max(1, training["global_batch"] // (micro * nproc)),
        },
    }
    if training["global_batch"] % (micro * nproc):  # the data-parallel layout must see the same batch
        other["training"] = {**training, "micro_batch": 1}
        other["parallelism"]["grad_accum"] = training["global_batch"] // nproc
    degrees = {"tp": tp, "pp": pp, "dp": rdp}
    return Rehearsal(nproc, layout, control, other, degrees, full, changes)
