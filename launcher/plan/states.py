"""Model states per GPU: the parameters, gradients and optimizer state each strategy keeps for the whole
step, and what its optimizer step adds. The moments of a step (`moments`) stand on these."""

from __future__ import annotations

import msgspec

from ..strategies import Family
from .layout import Layout


class States(msgspec.Struct, frozen=True):
    """Model states per GPU, bytes: what the strategy keeps for the whole step."""

    params: float
    grads: float
    optimizer: float
    step_temp: float  # extra optimizer memory during the optimizer step (torch AdamW's foreach temporary)
    step_grads: float = 0.0  # extra gradient memory during the optimizer step (DeepSpeed's fp32 partition)


def optimizer_state_bytes(precision: str, optimizer: str = "adamw") -> int:
    """Bytes of optimizer state per parameter: [ZeRO] K=12 for mixed-precision Adam (fp32 master + m + v)."""
    moments = 8 if optimizer == "adamw" else 4
    return moments + (4 if precision in ("bf16", "fp16") else 0)


def model_states(n: float, lay: Layout) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per GPU for `n` parameters in this model-parallel shard.

    [ZeRO] Rajbhandari et al. 2019, sec. 5, mixed-precision Adam: weights 2, grads 2, optimizer K=12 bytes per
    parameter; ZeRO-1 shards the optimizer over dp, ZeRO-2 also the gradients, ZeRO-3 also the weights.
    DDP and FSDP2 keep what torch keeps: fp32 weights (autocast, or FSDP2's sharded fp32 master) and fp32
    gradients; the fp32 weights double as the master copy, so the optimizer holds moments only (4+4+8 = 16
    bytes, [ZeRO]'s 2+2+12). FSDP2's gathered 16-bit weights are buffers (`moments`), not states.

    Offload. [ZeRO-Offload] Ren et al. 2021, sec. 3 (the offload strategy): only the 16-bit parameters stay on
    the GPU; the 16-bit gradients are moved to CPU memory as they are reduced (bucket by bucket, so the GPU
    holds the buckets: `moments.deepspeed_buffers`), and the fp32 master weights and Adam's moments live and are
    updated there.
    DeepSpeed's estimators say the same (`estimate_zero2_model_states_mem_needs(cpu_offload=True)`: 2 bytes
    per parameter on the GPU; ZeRO-3: the parameters' partition and the largest layer). FSDP2's
    CPUOffloadPolicy moves sharded parameters, gradients and optimizer state to the host.
    """
    mixed = lay.precision in ("bf16", "fp16")
    opt = optimizer_state_bytes(lay.precision, lay.optimizer)
    sp = lay.spec
    if sp.family is Family.TORCH:
        weight, grad, optim = 4, 4, opt - (4 if mixed else 0)
    else:
        w16 = 2 if mixed else 4
        weight, grad, optim = w16, w16, opt
    group = lay.shard_group
    p = weight * n / (group if "params" in sp.shards else 1)
    g = grad * n / (group if "grads" in sp.shards else 1)
    o = optim * n / (group if "optimizer" in sp.shards else 1)
    if lay.offload in ("optimizer", "params"):
        o = 0.0  # [ZeRO-Offload] / FSDP2 CPUOffloadPolicy: optimizer state in host memory
        g = 0.0  # [ZeRO-Offload]: gradients too (reduced into host memory); FSDP2 offloads them as well
    if lay.offload == "params":
        p = 0.0  # ZeRO-Infinity offload_param / FSDP2 CPUOffloadPolicy: only gathered units live on the GPU
    return p, g, o


# DeepSpeed ZeRO-3 steps its optimizer one sub-group of at most this many elements at a time (its default
# `sub_group_size`, which the rendered config leaves alone): the fp32 gradient of one sub-group exists at once.
DS_SUB_GROUP_SIZE = 1_000_000_000


def deepspeed_step_fp32_grads(n: float, lay: Layout) -> float:
    """Bytes of the fp32 gradient partition DeepSpeed builds for its optimizer step (no offload).

    ZeRO-1/2 (`stage_1_and_2.py`, step): the reduced 16-bit gradient partition is flattened and cast to fp32
    (`single_grad_partition`), the optimizer steps, and the copy is deleted ("get rid of the fp32 gradients");
    ZeRO-3 does the same per sub-group (`_prepare_fp32_grad_for_sub_group`). This is the 4 bytes per parameter
    by which DeepSpeed's estimators (18 bytes per parameter besides the 16-bit weights) exceed the ZeRO paper's
    2 + 12: alive in the optimizer step only, so the planner adds it to that moment, not to the whole step."""
    if lay.offload in ("optimizer", "params"):
        return 0.0  # the fp32 gradients are in host memory with the optimizer
    part = n / (lay.shard_group if "optimizer" in lay.spec.shards else 1)
    if "params" in lay.spec.shards:
        part = min(part, DS_SUB_GROUP_SIZE)
    return 4 * part


def fsdp_group(lay: Layout) -> int:
    """Ranks an FSDP2 unit is sharded over: the sharding group, or one for `ddp` in a tensor/pipeline layout
    (the runtime's FSDP2 with shard groups of one; `launcher.runtime.engines.mesh`)."""
    return lay.shard_group if lay.spec.sharded else 1


def states(n: float, lay: Layout) -> States:
    p, g, o = model_states(n, lay)
    # torch AdamW with foreach (its CUDA default) allocates sqrt(exp_avg_sq) for every parameter at once.
    temp = 4 * n / (lay.shard_group if "optimizer" in lay.spec.shards else 1) if lay.optimizer == "adamw" else 0.0
    if lay.spec.family is Family.DEEPSPEED:  # DeepSpeed steps its own flat fp32 partitions
        return States(p, g, o, 0.0, deepspeed_step_fp32_grads(n, lay))
    if o == 0:
        temp = 0.0  # offloaded states step on the host
    return States(p, g, o, temp)
