"""Per-GPU memory: model states, activations and buffers. Pure arithmetic, bytes everywhere.

Sources, cited at each formula:
- [ZeRO] Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 3 and 5.
- [MLM3] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4, Table 2.
- [FSDP2] PyTorch `fully_shard` docs: sharded fp32 parameters (DTensor), all-gathered per unit in
  MixedPrecisionPolicy.param_dtype and freed after forward (reshard_after_forward=True), gradients
  reduce-scattered in reduce_dtype into sharded fp32 gradients.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..catalog import ModelShape
from ..deepspeed_config import DS_ALLGATHER_BUCKET, DS_REDUCE_BUCKET
from ..jobenv import GB
from ..strategies import Family
from .layout import Layout
from .params import embedding_params, layer_params

# CUDA context, cuBLAS workspace and NCCL's own buffers on a GPU: ~1 GB measured on H100s with NCCL 2.2x.
GPU_CONTEXT_BYTES = 1.0 * GB
CPU_CONTEXT_BYTES = 0.2 * GB
# The caching allocator rarely packs perfectly; keep this fraction of the rest as slack.
FRAGMENTATION = 0.05
# DDP's gradient buckets (bucket_cap_mb=25), with gradient_as_bucket_view=True there is no full copy.
DDP_BUCKET_BYTES = 2 * 25 * 2**20


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    total: float
    gpu: float
    fits: bool

    def to_dict(self) -> dict:
        return {k: int(round(v)) if isinstance(v, float) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Memory":
        return cls(*(float(d[k]) for k in ("params", "grads", "optimizer", "activations", "buffers", "total", "gpu")),
                   bool(d["fits"]))


def optimizer_state_bytes(precision: str, optimizer: str = "adamw") -> int:
    """Bytes of optimizer state per parameter: [ZeRO] K=12 for mixed-precision Adam (fp32 master + m + v)."""
    moments = 8 if optimizer == "adamw" else 4
    return moments + (4 if precision in ("bf16", "fp16") else 0)


def model_states(n: float, lay: Layout) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per GPU for `n` parameters in this model-parallel shard.

    [ZeRO] sec. 5, mixed precision Adam: weights 2, grads 2, optimizer K=12 bytes per parameter;
    ZeRO-1 shards the optimizer over dp, ZeRO-2 also the gradients, ZeRO-3 also the weights.
    DDP and FSDP2 keep what torch keeps: fp32 weights (autocast or FSDP2's sharded fp32 master) and fp32 grads.
    """
    mixed = lay.precision in ("bf16", "fp16")
    w16 = 2 if mixed else 4
    opt = optimizer_state_bytes(lay.precision, lay.optimizer)
    sp = lay.spec
    if sp.family is Family.TORCH:
        # torch keeps fp32 params and grads (autocast, or FSDP2's sharded fp32 master), and the fp32 params
        # double as the master copy, so the optimizer holds moments only: 4+4+8 = 16 bytes, [ZeRO]'s 2+2+12.
        weight, grad, optim = 4, 4, opt - (4 if mixed else 0)
    else:
        weight, grad, optim = w16, w16, opt
    group = lay.shard_group
    p = weight * n / (group if "params" in sp.shards else 1)
    g = grad * n / (group if "grads" in sp.shards else 1)
    o = optim * n / (group if "optimizer" in sp.shards else 1)
    if sp.reshard_after_forward is False:
        # reshard_after_forward=False keeps the unsharded (param_dtype) weights from forward to backward.
        p += w16 * n
    if lay.offload in ("optimizer", "params"):
        o = 0.0  # ZeRO-Offload / FSDP2 CPUOffloadPolicy keep optimizer state in host memory
    if lay.offload == "params":
        if sp.family is Family.DEEPSPEED:
            p = 0.0  # ZeRO-Infinity offload_param: only gathered layers live on the GPU (in buffers)
        else:
            p, g = 0.0, 0.0  # FSDP2 CPUOffloadPolicy moves sharded params and grads to the host
    return p, g, o


def activation_bytes_per_layer(shape: ModelShape, arch: str, s: int, b: int, t: int, sp: bool, ac: str,
                               act_bytes: int = 2) -> float:
    """Activations kept for backward by one transformer layer, per GPU.

    GPT layer, [MLM3] Table 2 (16-bit activations, 1-byte dropout masks):
      no parallelism sbh(34 + 5as/h); TP sbh(10 + 24/t + 5as/(ht)); TP+SP sbh/t (34 + 5as/h);
      selective recompute drops the 5as^2b attention-score terms; full recompute keeps 2sbh (2sbh/t with SP).
    Llama layer, re-derived the same way for the model we train (RMSNorm, SwiGLU width f, GQA with g kv heads
    of a, SDPA/flash attention that stores q, k, v, the output O and an fp32 log-sum-exp, never s x s scores,
    and no dropout):
      replicated (outside TP regions): both RMSNorm inputs and outputs = 8sbh
      split by t: q 2sbh, k and v 4sbh*g/a, O 2sbh, lse 4asb, SwiGLU w1 out, w3 out, silu out, product = 8sbf
      => sbh(8 + (4 + 4g/a + 8f/h)/t) + 4asb/t; with SP everything is divided by t.
      selective = recompute w2(silu(w1 x) * w3 x) from (w1 x, w3 x): drops silu out and product, 4sbf/t.
      full = only the layer input, 2sbh (/t with SP).
    `act_bytes` = 4 doubles the 16-bit terms for fp32 training.
    """
    h, a = shape.hidden, shape.heads
    sbh = s * b * h
    scale = act_bytes / 2
    if ac == "full":
        return 2 * sbh * scale / (t if sp else 1)
    if arch == "gpt":
        scores = 5 * a * s / h
        if ac == "selective":
            scores = 0.0
        if sp:
            return sbh / t * (34 + scores) * scale
        return sbh * (10 + 24 / t + scores / t) * scale
    g, f = shape.kv_heads, shape.ffn_hidden
    replicated = 8 * sbh
    split = 4 * sbh + 4 * sbh * g / a + 8 * s * b * f
    if ac == "selective":
        split -= 4 * s * b * f
    lse = 4 * a * s * b  # always fp32
    if sp:
        return ((replicated + split) * scale + lse) / t
    return replicated * scale + (split * scale + lse) / t


def activations(shape: ModelShape, arch: str, seq: int, lay: Layout) -> float:
    """All activations of one pipeline stage, per GPU, at peak.

    Pipeline: with 1F1B the first stage holds min(pp, grad_accum) micro-batches in flight, each with its
    L/pp layers [MLM3 sec. 4.2.3]. Full recompute re-materialises one layer at a time during backward, so one
    full layer is added on top. Logits: the bf16 output 2sbV plus the fp32 copy the loss keeps 4sbV, split by t
    (vocabulary-parallel head).
    """
    act_bytes = 4 if lay.precision == "fp32" else 2
    layers_per_stage = math.ceil(shape.layers / lay.pp)
    in_flight = min(lay.pp, max(lay.grad_accum, 1)) if lay.pp > 1 else 1
    per = activation_bytes_per_layer(shape, arch, seq, lay.micro_batch, lay.tp, lay.sequence_parallel,
                                     lay.activation_checkpointing, act_bytes)
    total = per * layers_per_stage * in_flight
    if lay.activation_checkpointing == "full":
        total += activation_bytes_per_layer(shape, arch, seq, lay.micro_batch, lay.tp, lay.sequence_parallel,
                                            "none", act_bytes)
    logits = (2 * (act_bytes / 2) + 4) * seq * lay.micro_batch * shape.vocab / lay.tp
    return total + logits


def buffers(shape: ModelShape | None, arch: str, n: float, lay: Layout, is_gpu: bool, states_and_acts: float) -> float:
    """Transient and fixed memory beyond states and activations, documented term by term.

    - the device context: CUDA context, cuBLAS workspace, NCCL buffers (~1 GB on a GPU);
    - communication buffers of the strategy: DDP's 25 MB buckets; DeepSpeed's reduce/all-gather buckets
      (as rendered); for FSDP2/ZeRO-3 the largest unit all-gathered twice (current + prefetch) in 16-bit plus its
      unsharded gradient in fp32 before reduce-scatter [FSDP2];
    - allocator fragmentation, FRAGMENTATION x (states + activations).
    """
    w16 = 2 if lay.precision in ("bf16", "fp16") else 4
    ctx = GPU_CONTEXT_BYTES if is_gpu else CPU_CONTEXT_BYTES
    if shape is not None:
        unit = max(layer_params(shape, arch), embedding_params(shape, arch) / 2) / lay.tp
    else:
        unit = n / 40  # a typical block is ~1/40 of a model
    sp = lay.spec
    if not sp.sharded:  # DDP
        comm = DDP_BUCKET_BYTES
    elif sp.family is Family.DEEPSPEED and "params" not in sp.shards:  # ZeRO-1/2
        comm = (DS_REDUCE_BUCKET + DS_ALLGATHER_BUCKET) * w16
    elif sp.reshard_after_forward is False:
        comm = unit * 4  # one unit's unsharded fp32 gradient before reduce-scatter
    else:  # fsdp, hybrid, zero3
        comm = 2 * unit * w16 + unit * 4
    return ctx + comm + FRAGMENTATION * states_and_acts


def breakdown(shape: ModelShape | None, arch: str, n_params: int, seq: int, lay: Layout, gpu_bytes: float,
              is_gpu: bool = True) -> Memory:
    """The whole per-GPU picture for one layout."""
    n = n_params / (lay.tp * lay.pp)  # [ZeRO]/Megatron: TP and PP divide the parameters of each GPU
    p, g, o = model_states(n, lay)
    a = activations(shape, arch, seq, lay) if shape is not None else 0.0  # unknown without a shape; the plan says so
    b = buffers(shape, arch, n, lay, is_gpu, p + g + o + a)
    total = p + g + o + a + b
    return Memory(p, g, o, a, b, total, gpu_bytes, total <= gpu_bytes)
