"""Recipe -> Plan: what fits, which strategy and why, how long and how much. Pure, no I/O."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..recipe import Recipe
from . import cost
from .memory import ALL_STRATEGIES, Layout, Memory
from .params import count_params
from .strategy import Context, choose, grad_accum_for, offload_for


@dataclass
class Plan:
    """The resolved job: everything `render` and the runtime need, and what `plan --json` prints."""

    params: int
    world_size: int
    nodes: int
    gpus_per_node: int
    accelerator: str
    layout: Layout
    global_batch: int
    grad_accum: int
    seq_len: int
    steps: int
    tokens_per_step: int
    reasons: list[str]
    memory: Memory
    candidates: list[tuple[str, Memory]]
    flops_per_step: float
    step_seconds: float
    usd: float
    checkpoint_every: int
    checkpoint_write_seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def total_hours(self) -> float:
        return self.steps * self.step_seconds / 3600

    def to_dict(self) -> dict[str, Any]:
        """The `plan --json` contract (users script against it; keep keys stable)."""
        lay = self.layout
        return {
            "params": self.params,
            "world_size": self.world_size,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "accelerator": self.accelerator,
            "dp": lay.dp,
            "tp": lay.tp,
            "pp": lay.pp,
            "strategy": lay.strategy,
            "shard": lay.shard or lay.dp,
            "precision": lay.precision,
            "activation_checkpointing": lay.activation_checkpointing,
            "offload": lay.offload,
            "sequence_parallel": lay.sequence_parallel,
            "micro_batch": lay.micro_batch,
            "grad_accum": self.grad_accum,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "steps": self.steps,
            "tokens_per_step": self.tokens_per_step,
            "reasons": list(self.reasons),
            "notes": list(self.notes),
            "memory": self.memory.to_dict(),
            "candidates": [{"strategy": s, "memory": m.to_dict()} for s, m in self.candidates],
            "time": {
                "flops_per_step": self.flops_per_step,
                "step_seconds": self.step_seconds,
                "total_hours": self.total_hours,
            },
            "cost": {"usd": round(self.usd, 2)},
            "checkpoint": {"every_steps": self.checkpoint_every, "write_seconds": self.checkpoint_write_seconds},
        }


def make_plan(recipe: Recipe) -> Plan:
    m, par, res, tr = recipe.model, recipe.parallelism, recipe.resources, recipe.training
    shape = m.shape()
    arch = m.architecture
    n = count_params(shape, arch) if shape is not None else int(m.params)
    seq = m.seq()
    dev = res.device()
    world = res.world_size
    notes = []
    if shape is None:
        notes.append("model given by `params` only: activations are not estimated (give a preset or shape for them)")
    tp, pp = par.tensor, par.pipeline
    dp = par.data if isinstance(par.data, int) else max(world // (tp * pp), 1)
    grad_accum, global_batch = grad_accum_for(tr.global_batch, tr.micro_batch, dp, par.grad_accum)
    base = Layout(
        strategy="ddp", dp=dp, tp=tp, pp=pp, precision=par.precision, micro_batch=tr.micro_batch,
        microbatches=grad_accum, sequence_parallel=par.sequence_parallel, optimizer=tr.optimizer,
        shard=res.per_node if par.strategy == "hybrid" else 0,
    )
    ctx = Context(shape, arch, n, seq, dev.memory_gb * 1e9, dev.is_gpu, res.per_node, res.nodes)
    fields_set = par.model_fields_set
    lay, reasons = choose(ctx, base, par.strategy, par.backend, par.activation_checkpointing, par.offload,
                          tp_fixed="tensor" in fields_set, pp_fixed="pipeline" in fields_set)
    if lay.dp != dp:  # the search changed tp/pp: re-derive the batch split
        grad_accum, global_batch = grad_accum_for(tr.global_batch, tr.micro_batch, lay.dp, par.grad_accum)
    mem = ctx.memory(lay)
    candidates = []
    for s in ALL_STRATEGIES:
        c = Layout(**{**lay.__dict__, "strategy": s, "offload": offload_for(s, lay.offload),
                      "shard": (lay.shard or res.per_node) if s == "hybrid" else 0})
        candidates.append((s, ctx.memory(c)))
    tokens_per_step = global_batch * seq
    steps = tr.steps if tr.steps is not None else math.ceil(tr.tokens / tokens_per_step)
    flops = cost.flops_per_token(n, shape, seq) * tokens_per_step
    step_s = cost.step_seconds(flops, world, dev.peak_tflops, res.mfu, lay.activation_checkpointing)
    write_s = cost.checkpoint_write_seconds(n, par.precision, tr.optimizer, res.nodes, res.storage_gbps_per_node)
    if isinstance(recipe.checkpoint.every, int):
        every = recipe.checkpoint.every
    else:
        interval = cost.young_daly_interval(write_s, res.gpu_mtbf_hours * 3600 / world)
        every = max(1, min(steps, round(interval / step_s))) if step_s > 0 else steps
    usd = steps * step_s / 3600 * world * dev.usd_per_hour
    return Plan(
        params=n, world_size=world, nodes=res.nodes, gpus_per_node=res.per_node, accelerator=dev.name,
        layout=lay, global_batch=global_batch, grad_accum=grad_accum, seq_len=seq, steps=steps,
        tokens_per_step=tokens_per_step, reasons=reasons, memory=mem, candidates=candidates,
        flops_per_step=flops, step_seconds=step_s, usd=usd, checkpoint_every=every,
        checkpoint_write_seconds=write_s, notes=notes,
    )
