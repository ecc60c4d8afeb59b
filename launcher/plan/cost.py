"""FLOPs, step time, total time, dollars and the checkpoint interval. Pure arithmetic."""

from __future__ import annotations

import math

from ..catalog import ModelShape


def flops_per_token(n_params: int, shape: ModelShape | None, seq: int) -> float:
    """Model FLOPs per trained token: 6N for the matmuls (Kaplan et al. 2020) plus attention scores,
    12 * layers * hidden * seq (Chowdhery et al. 2022, PaLM, appendix B)."""
    attn = 12 * shape.layers * shape.hidden * seq if shape is not None else 0
    return 6 * n_params + attn


def recompute_factor(activation_checkpointing: str) -> float:
    """Extra hardware FLOPs for recomputation: full recompute repeats the forward (8N instead of 6N);
    selective recomputes SwiGLU's down projection and elementwise ops (~1/3 of MLP forward, ~5% in all)."""
    return {"full": 4 / 3, "selective": 1.05}.get(activation_checkpointing, 1.0)


def step_seconds(flops_per_step: float, world: int, peak_tflops: float, mfu: float, ac: str) -> float:
    """Time of one optimizer step at an assumed model FLOPs utilisation over every GPU's dense peak."""
    return flops_per_step * recompute_factor(ac) / (world * peak_tflops * 1e12 * mfu)


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
