"""FLOPs, step time, total time, dollars and the checkpoint interval. Pure arithmetic."""

from __future__ import annotations

import math

from ..catalog import ModelShape
from .pipeline import STAGES_PER_RANK


def flops_per_token(n_params: int, shape: ModelShape | None, seq: int) -> float:
    """Model FLOPs per trained token: 6N for the matmuls (Kaplan et al. 2020) plus attention scores,
    12 * layers * hidden * seq (Chowdhery et al. 2022, PaLM, appendix B)."""
    attn = 12 * shape.layers * shape.hidden * seq if shape is not None else 0
    return 6 * n_params + attn


def recompute_factor(activation_checkpointing: str) -> float:
    """Extra hardware FLOPs for recomputation: full recompute repeats the forward (8N instead of 6N);
    selective recomputes SwiGLU's down projection and elementwise ops (~1/3 of MLP forward, ~5% in all)."""
    return {"full": 4 / 3, "selective": 1.05}.get(activation_checkpointing, 1.0)


def pipeline_bubble(pp: int, micro_batches: int, schedule: str) -> float:
    """The fraction of a step a pipeline's ranks wait: (pp - 1) / (v * m + pp - 1) for m micro-batches and v
    stages per rank (Narayanan et al. 2021: 1F1B's bubble, and interleaving's v-fold smaller one)."""
    if pp <= 1:
        return 0.0
    v = STAGES_PER_RANK.get(schedule, 1)
    return (pp - 1) / (v * micro_batches + pp - 1)


def step_seconds(flops_per_step: float, world: int, peak_tflops: float, mfu: float, layout) -> float:
    """Time of one optimizer step: the model FLOPs (with recomputation) at an assumed MFU over every GPU's dense
    peak while it computes, and a pipeline's bubble on top. The MFU is of the busy time: a measured one
    (launcher.plan.ledger) has the bubble taken out, so it carries over to another pipeline depth."""
    busy = flops_per_step * recompute_factor(layout.activation_checkpointing) / (world * peak_tflops * 1e12 * mfu)
    return busy / (1 - pipeline_bubble(layout.pp, layout.grad_accum, layout.pp_schedule))


def checkpoint_bytes(n_params: int, optimizer: str) -> float:
    """What a full training checkpoint writes: fp32 weights plus optimizer moments (12 bytes/param for AdamW)."""
    moments = 8 if optimizer == "adamw" else 4
    return n_params * (4 + moments)


def checkpoint_write_seconds(n_params: int, optimizer: str, nodes: int, storage_gbps_per_node: float) -> float:
    """Every node writes its shards in parallel (DCP / DeepSpeed each rank writes its own files)."""
    return checkpoint_bytes(n_params, optimizer) / (nodes * storage_gbps_per_node * 1e9)


def young_daly_interval(write_seconds: float, mtbf_seconds: float) -> float:
    """Optimal checkpoint interval, first order: sqrt(2 * delta * M) (Young 1974; Daly 2006)."""
    return math.sqrt(2 * write_seconds * mtbf_seconds)


def availability_interval(write_seconds: float, mtbf_seconds: float, recovery_seconds: float) -> float:
    """The interval of work between checkpoints that maximises availability (useful time / allocated time) when
    each failure also costs a recovery R (detection, requeue, restart, restore), as Saxena et al. 2024
    (arXiv 2410.18124) frame it. One cycle is tau of work and a write delta; failures arrive at rate 1/M, each
    losing half a cycle on average plus R, so availability is
        A(tau) = tau / ((tau + delta)(1 + R/M) + (tau + delta)^2 / (2M)),
    maximal at tau = sqrt(2 delta (M + R) + delta^2). It tends to Young/Daly's sqrt(2 delta M) when delta and R
    are small beside M, and grows with R: a costly recovery makes each failure dearer than the saves."""
    d = write_seconds
    return math.sqrt(2 * d * (mtbf_seconds + recovery_seconds) + d * d)
