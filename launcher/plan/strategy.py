"""The decision rules for `strategy: auto`, each choice with its reasons.

Rules, in order (the usual practice, e.g. the ZeRO paper sec. 5 and PyTorch's FSDP guidance):
1. DDP (ZeRO-1 in the DeepSpeed family) if everything fits: least communication.
2. FSDP grad-op / ZeRO-2 if the optimizer state does not fit.
3. FSDP full shard / ZeRO-3 if the parameters do not; across nodes, hybrid sharding if it also fits.
4. Then activation checkpointing (selective, then full).
5. Then CPU offload (optimizer, then parameters).
6. Tensor parallelism inside a node for models over ~80B parameters or when a layer does not fit,
   then pipeline parallelism across nodes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..catalog import ModelShape
from .memory import GB, Layout, Memory, breakdown

TP_PARAM_THRESHOLD = 80e9  # Megatron/Llama practice: beyond ~70B, TP within the node pays for itself


@dataclass(frozen=True)
class Context:
    """What is fixed while we search: the model and the machine."""

    shape: ModelShape | None
    arch: str
    n_params: int
    seq: int
    gpu_bytes: float
    is_gpu: bool
    per_node: int
    nodes: int

    def memory(self, lay: Layout) -> Memory:
        return breakdown(self.shape, self.arch, self.n_params, self.seq, lay, self.gpu_bytes, self.is_gpu)


def family(backend: str) -> list[str]:
    return ["zero1", "zero2", "zero3"] if backend == "deepspeed" else ["ddp", "fsdp_grad_op", "fsdp"]


def offload_for(strategy: str, offload: str) -> str:
    """The offload a strategy can really do: DDP none; FSDP2 offloads params+grads+optimizer together."""
    if strategy == "ddp":
        return "none"
    if strategy in ("fsdp", "hybrid", "fsdp_grad_op") and offload == "optimizer":
        return "params" if strategy != "fsdp_grad_op" else "none"
    if strategy in ("zero1", "zero2", "fsdp_grad_op") and offload == "params":
        return "optimizer" if strategy != "fsdp_grad_op" else "none"
    return offload


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def _describe(lay: Layout) -> str:
    extra = []
    if lay.activation_checkpointing != "none":
        extra.append(f"{lay.activation_checkpointing} activation checkpointing")
    if lay.offload != "none":
        extra.append(f"{lay.offload} offload")
    if lay.tp > 1 or lay.pp > 1:
        extra.append(f"tp={lay.tp} pp={lay.pp}")
    return lay.strategy + (f" ({', '.join(extra)})" if extra else "")


def _largest_tp(ctx: Context) -> int:
    """The largest TP degree within a node that divides the attention heads (and kv heads)."""
    best = 1
    for t in range(1, min(ctx.per_node, 8) + 1):
        if ctx.per_node % t:
            continue
        if ctx.shape is not None and (ctx.shape.heads % t or ctx.shape.kv_heads % t):
            continue
        best = t
    return best


def choose(ctx: Context, base: Layout, strategy: str, backend: str, ac: str, offload: str,
           tp_fixed: bool, pp_fixed: bool) -> tuple[Layout, list[str]]:
    """Pick the layout: the first (strategy, checkpointing, offload) that fits, with the reasons."""
    reasons: list[str] = []
    tps = [base.tp]
    if strategy == "auto" and not tp_fixed and base.tp == 1:
        t = _largest_tp(ctx)
        if t > 1:
            if ctx.n_params > TP_PARAM_THRESHOLD:
                reasons.append(f"{ctx.n_params / 1e9:.0f}B parameters > {TP_PARAM_THRESHOLD / 1e9:.0f}B: tensor parallel {t} within each node")
                tps = [t]
            else:
                tps = [1, t]
    strategies = [strategy] if strategy != "auto" else family(backend)
    acs = [ac] if ac != "auto" else ["none", "selective", "full"]
    offloads = [offload] if offload != "auto" else ["none", "optimizer", "params"]
    world = base.dp * base.tp * base.pp
    last: tuple[Layout, Memory] | None = None
    for tp in tps:
        pps = [base.pp]
        if strategy == "auto" and not pp_fixed and base.pp == 1 and ctx.nodes > 1 and tp > 1:
            pps = [1] + [p for p in range(2, ctx.nodes + 1) if ctx.nodes % p == 0 and (ctx.shape is None or ctx.shape.layers >= p)]
        for pp in pps:
            dp = max(world // (tp * pp), 1)
            shaped = replace(base, tp=tp, pp=pp, dp=dp)
            if (tp, pp) != (tps[0], pps[0]):
                reasons.append(f"nothing fits at tp={last[0].tp} pp={last[0].pp}; trying tp={tp} pp={pp}" if last else f"trying tp={tp} pp={pp}")
            for off in offloads:
                for a in acs:
                    tried = []
                    for s in strategies:
                        lay = replace(shaped, strategy=s, activation_checkpointing=a, offload=offload_for(s, off))
                        if s == "hybrid" and not lay.shard:
                            lay = replace(lay, shard=ctx.per_node)
                        mem = ctx.memory(lay)
                        last = (lay, mem)
                        if mem.fits:
                            if strategy == "auto" and s in ("fsdp",) and ctx.nodes > 1 and dp > ctx.per_node:
                                hyb = replace(lay, strategy="hybrid", shard=max(ctx.per_node // (tp * pp), 1))
                                if hyb.shard > 1 and ctx.memory(hyb).fits:
                                    reasons.append(f"hybrid sharding also fits ({_gb(ctx.memory(hyb).total)}): shard inside each node, "
                                                   f"replicate across nodes, so parameter all-gathers stay on the node's fast links")
                                    lay = hyb
                                    mem = ctx.memory(hyb)
                            reasons.extend(tried)
                            reasons.append(f"{_describe(lay)} fits: {_gb(mem.total)} of {_gb(mem.gpu)} per GPU")
                            return lay, reasons
                        tried.append(f"{_describe(lay)} needs {_gb(mem.total)} > {_gb(mem.gpu)} "
                                     f"(states {_gb(mem.params + mem.grads + mem.optimizer)}, activations {_gb(mem.activations)})")
                    if len(strategies) > 1 or len(acs) > 1:
                        reasons.extend(tried)
    assert last is not None
    reasons.append(f"nothing fits: the smallest layout tried, {_describe(last[0])}, needs {_gb(last[1].total)} per GPU; "
                   f"add GPUs or nodes, raise tensor/pipeline, or lower micro_batch or seq_len")
    return last[0], reasons


def grad_accum_for(global_batch: int | None, micro_batch: int, dp: int, grad_accum) -> tuple[int, int]:
    """(grad_accum, global_batch): global = micro_batch * dp * grad_accum; derive whichever is 'auto'."""
    if isinstance(grad_accum, int):
        return grad_accum, global_batch if global_batch is not None else micro_batch * dp * grad_accum
    if global_batch is None:
        return 1, micro_batch * dp
    return max(1, math.ceil(global_batch / (micro_batch * dp))), global_batch
