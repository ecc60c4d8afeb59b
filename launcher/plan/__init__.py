"""Recipe -> Plan: what fits, which strategy and why, how long and how much. Pure, no I/O.

The Plan is the typed seam between the layers: `render` and the runtime take a Plan; the plan file a job
reads holds it as msgspec encodes it (`launcher.planfile`), and `Plan.to_dict()` is the `plan --json` report.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from msgspec.structs import replace

from ..recipe import Recipe
from ..strategies import STRATEGIES, offload_for
from . import cost
from .batch import batch_problem, grad_accum_for
from .layout import Layout
from .memory import NOT_MODELLED, UNITS, Memory
from .params import count_params
from .strategy import Context, Request, choose, prefer_once_per_step


class Plan(msgspec.Struct):
    """The resolved job: everything `render` and the runtime need, and what `plan --json` prints."""

    params: int
    world_size: int
    nodes: int
    gpus_per_node: int
    accelerator: str
    layout: Layout
    global_batch: int
    seq_len: int
    steps: int | None  # None: the recipe gives no training length (memory and strategy only)
    tokens_per_step: int
    reasons: list[str]
    memory: Memory
    candidates: list[tuple[str, Memory]]
    flops_per_step: float
    step_seconds: float
    usd: float | None
    checkpoint_every: int
    checkpoint_write_seconds: float
    notes: list[str] = msgspec.field(default_factory=list)

    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def grad_accum(self) -> int:
        return self.layout.grad_accum

    @property
    def total_hours(self) -> float | None:
        return None if self.steps is None else self.steps * self.step_seconds / 3600

    def to_dict(self) -> dict[str, Any]:
        """The `plan --json` contract (users script against it; keep keys stable): the layout's fields at the top
        level, derived figures besides. A report, never read back: the plan file is the struct itself."""
        lay = self.layout
        layout = msgspec.to_builtins(lay)
        layout["shard"] = lay.shard_group
        layout["pipeline_schedule"] = layout.pop("pp_schedule")
        return {
            "params": self.params,
            "world_size": self.world_size,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "accelerator": self.accelerator,
            **layout,
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
            "cost": {"usd": None if self.usd is None else round(self.usd, 2)},
            "checkpoint": {"every_steps": self.checkpoint_every, "write_seconds": self.checkpoint_write_seconds},
            "not_modelled": list(NOT_MODELLED),
            "units": dict(UNITS),
        }


def make_plan(recipe: Recipe) -> Plan:
    model, par, res, tr = recipe.model, recipe.parallelism, recipe.resources, recipe.training
    shape = model.shape()
    arch = model.architecture
    n = count_params(shape, arch) if shape is not None else int(model.params or 0)  # the schema requires one
    seq = model.seq()
    dev = res.device()
    world = res.world_size
    notes = []
    if shape is None:
        notes.append("model given by `params` only: activations are not estimated (give a preset or shape for them)")
    tp, pp = (1 if d == "auto" else d for d in (par.tensor, par.pipeline))
    dp = par.data if isinstance(par.data, int) else max(world // (tp * pp), 1)
    grad_accum, _ = grad_accum_for(tr.global_batch, tr.micro_batch, dp, par.grad_accum)
    base = Layout(
        strategy="ddp",
        dp=dp,
        tp=tp,
        pp=pp,
        precision=par.precision,
        micro_batch=tr.micro_batch,
        grad_accum=grad_accum,
        sequence_parallel=par.sequence_parallel is True,
        optimizer=tr.optimizer,
        shard=res.per_node if par.strategy == "hybrid" else None,
        pp_schedule=par.pipeline_schedule,
        grad_reduce="once_per_step" if par.grad_reduce == "once_per_step" else "every_micro_batch",
    )
    ctx = Context(shape, arch, n, seq, dev.memory_gb * 1e9, dev.is_gpu, res.per_node, res.nodes)
    hf = model.hf_config is not None
    searched_sp = par.strategy == "auto" and par.sequence_parallel == "auto" and not hf
    req = Request(
        par.strategy,
        par.backend,
        par.activation_checkpointing,
        par.offload,
        tp_fixed=par.tensor != "auto",
        pp_fixed=par.pipeline != "auto",
        global_batch=tr.global_batch,
        grad_accum=par.grad_accum,
        sequence_parallel=None if searched_sp else par.sequence_parallel is True,
        hf=hf,
    )
    lay, reasons = choose(ctx, base, req)  # sized at the grad_accum of the degrees it chose
    _, global_batch = grad_accum_for(tr.global_batch, tr.micro_batch, lay.dp, par.grad_accum)
    problem = batch_problem(tr.global_batch, tr.micro_batch, lay.dp, par.grad_accum)
    if problem:  # said here as validate says it, so that `plan` never prints a product that is not the batch
        notes.append(
            f"{problem[0]}: each step would run micro_batch x dp x grad_accum = "
            f"{lay.micro_batch * lay.dp * lay.grad_accum} sequences, not global_batch {global_batch} "
            f"(fix: {problem[1]})"
        )
    if par.grad_reduce == "auto":
        lay, why = prefer_once_per_step(ctx, lay)
        reasons += why
    mem = ctx.memory(lay)
    candidates = []
    for s, sp in STRATEGIES.items():
        c = replace(
            lay,
            strategy=s.value,
            offload=offload_for(s, lay.offload),
            shard=(lay.shard or res.per_node) if sp.replicate_across_nodes else None,
        )
        if par.grad_reduce == "auto":  # each strategy with the reduction it would get
            c = prefer_once_per_step(ctx, replace(c, grad_reduce="every_micro_batch"))[0]
        candidates.append((s.value, ctx.memory(c)))
    tokens_per_step = global_batch * seq
    if tr.steps is not None:
        steps: int | None = tr.steps
    elif tr.tokens is not None:
        steps = math.ceil(tr.tokens / tokens_per_step)
    else:
        steps = None
        notes.append("no training length (training.steps or training.tokens): time and cost need one")
    flops = cost.flops_per_token(n, shape, seq) * tokens_per_step
    step_s = cost.step_seconds(flops, world, dev.peak_tflops, res.mfu, lay)
    write_s = cost.checkpoint_write_seconds(n, tr.optimizer, res.nodes, res.storage_gbps_per_node)
    if isinstance(recipe.checkpoint.every, int):
        every = recipe.checkpoint.every
    else:
        interval = cost.young_daly_interval(write_s, res.gpu_mtbf_hours * 3600 / world)
        every = max(1, round(interval / step_s)) if step_s > 0 else 1
        if steps is not None:
            every = min(steps, every)
    usd = None if steps is None else steps * step_s / 3600 * world * dev.usd_per_hour
    return Plan(
        params=n,
        world_size=world,
        nodes=res.nodes,
        gpus_per_node=res.per_node,
        accelerator=dev.name,
        layout=lay,
        global_batch=global_batch,
        seq_len=seq,
        steps=steps,
        tokens_per_step=tokens_per_step,
        reasons=reasons,
        memory=mem,
        candidates=candidates,
        flops_per_step=flops,
        step_seconds=step_s,
        usd=usd,
        checkpoint_every=every,
        checkpoint_write_seconds=write_s,
        notes=notes,
    )


__all__ = ["Plan", "Layout", "Memory", "make_plan"]
