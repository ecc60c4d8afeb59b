"""The decision rules for `strategy: auto`, each choice with its reasons.

Candidates are tried in one flat order, and the first that fits wins (the usual practice, e.g. the ZeRO
paper sec. 5 and PyTorch's FSDP guidance):
1. the least sharding first: DDP (ZeRO-1 in the DeepSpeed family), then grad-op sharding / ZeRO-2, then full
   sharding / ZeRO-3;
2. for each of those, activation checkpointing off, then selective, then full;
3. then CPU offload (optimizer, then parameters);
4. tensor parallelism inside a node for models over ~80B parameters (or when nothing else fits), then
   pipeline parallelism across nodes.
A full-sharding choice on several nodes is then promoted to hybrid sharding when that also fits.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import msgspec
from msgspec.structs import replace

from ..catalog import ModelShape
from ..jobenv import gb
from ..strategies import SEARCH_ORDER, Family, StrategyName, offload_for, spec
from .layout import Layout
from .memory import Memory, breakdown

TP_PARAM_THRESHOLD = 80e9  # Megatron/Llama practice: beyond ~70B, TP within the node pays for itself
MAX_TP = 8  # one NVLink domain


class Context(msgspec.Struct, frozen=True):
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


class Request(msgspec.Struct, frozen=True):
    """What the recipe asks for; "auto" leaves the choice to the search."""

    strategy: str
    backend: str
    activation_checkpointing: str
    offload: str
    tp_fixed: bool
    pp_fixed: bool


def describe(lay: Layout) -> str:
    extra = []
    if lay.activation_checkpointing != "none":
        extra.append(f"{lay.activation_checkpointing} activation checkpointing")
    if lay.offload != "none":
        extra.append(f"{lay.offload} offload")
    if lay.tp > 1 or lay.pp > 1:
        extra.append(f"tp={lay.tp} pp={lay.pp}")
    return lay.strategy + (f" ({', '.join(extra)})" if extra else "")


def divisors(n: int) -> list[int]:
    """All divisors of n in O(sqrt n): `nodes` may be large, and each divisor is a pipeline candidate."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def largest_tp(ctx: Context) -> int:
    """The largest TP degree within a node that divides the attention heads (and kv heads)."""
    best = 1
    for t in range(1, min(ctx.per_node, MAX_TP) + 1):
        if ctx.per_node % t:
            continue
        if ctx.shape is not None and (ctx.shape.heads % t or ctx.shape.kv_heads % t):
            continue
        best = t
    return best


def model_parallel_degrees(ctx: Context, base: Layout, req: Request) -> tuple[list[tuple[int, int]], list[str]]:
    """(tp, pp) pairs to try, in order, and why."""
    reasons: list[str] = []
    tps = [base.tp]
    if req.strategy == "auto" and not req.tp_fixed and base.tp == 1:
        t = largest_tp(ctx)
        if t > 1 and ctx.n_params > TP_PARAM_THRESHOLD:
            reasons.append(f"{ctx.n_params / 1e9:.0f}B parameters > {TP_PARAM_THRESHOLD / 1e9:.0f}B: "
                           f"tensor parallel {t} within each node")
            tps = [t]
        elif t > 1:
            tps = [1, t]
    pairs = []
    for tp in tps:
        pps = [base.pp]
        if req.strategy == "auto" and not req.pp_fixed and base.pp == 1 and ctx.nodes > 1 and tp > 1:
            layers = ctx.shape.layers if ctx.shape is not None else ctx.nodes
            pps = [p for p in divisors(ctx.nodes) if p <= layers]
        pairs += [(tp, pp) for pp in pps]
    return pairs, reasons


def candidates(ctx: Context, base: Layout, req: Request, tp: int, pp: int) -> Iterator[Layout]:
    """Every layout at this (tp, pp), cheapest first: offload, then checkpointing, then sharding vary."""
    strategies = [req.strategy] if req.strategy != "auto" else [s.value for s in SEARCH_ORDER[Family(req.backend)]]
    acs = [req.activation_checkpointing] if req.activation_checkpointing != "auto" else ["none", "selective", "full"]
    offloads = [req.offload] if req.offload != "auto" else ["none", "optimizer", "params"]
    dp = max((base.dp * base.tp * base.pp) // (tp * pp), 1)
    for off, ac, s in itertools.product(offloads, acs, strategies):
        shard = (base.shard or ctx.per_node) if spec(s).replicate_across_nodes else None
        yield replace(base, tp=tp, pp=pp, dp=dp, strategy=s, activation_checkpointing=ac,
                      offload=offload_for(s, off), shard=shard)


def prefer_hybrid(ctx: Context, lay: Layout, req: Request) -> tuple[Layout, list[str]]:
    """Full sharding across nodes -> hybrid (shard inside a node, replicate across nodes) when that fits too:
    the parameter all-gathers then stay on the node's fast links."""
    if req.strategy != "auto" or lay.strategy != StrategyName.FSDP or ctx.nodes == 1 or lay.dp <= ctx.per_node:
        return lay, []
    hyb = replace(lay, strategy=StrategyName.HYBRID.value, shard=max(ctx.per_node // (lay.tp * lay.pp), 1))
    mem = ctx.memory(hyb)
    if hyb.shard_group <= 1 or not mem.fits:
        return lay, []
    return hyb, [f"hybrid sharding also fits ({gb(mem.total)}): shard inside each node, replicate across nodes, "
                 f"so parameter all-gathers stay on the node's fast links"]


def prefer_once_per_step(ctx: Context, lay: Layout) -> tuple[Layout, list[str]]:
    """FSDP2 with several micro-batches per step: reduce-scatter once per step instead of once per micro-batch
    when the unsharded fp32 gradients that each rank then keeps between micro-batches fit as well. The
    reduce-scatters drop by a factor of grad_accum; on a small model, where those collectives are short and
    latency-bound, they are a large share of the step (measured: bench/trainer_overhead.py)."""
    once = replace(lay, grad_reduce="once_per_step")
    if lay.reduces_once_per_step or not once.reduces_once_per_step:
        return lay, []
    mem = ctx.memory(once)
    if not mem.fits:
        return lay, [f"gradients reduce-scattered on each of the {lay.grad_accum} micro-batches: keeping them "
                     f"unsharded until the step's last one would need {gb(mem.total)} > {gb(mem.gpu)}"]
    return once, [f"gradients reduce-scattered once per step, not on each of the {lay.grad_accum} micro-batches: "
                  f"every rank keeps them unsharded in fp32 meanwhile, and that fits ({gb(mem.total)})"]


def choose(ctx: Context, base: Layout, req: Request) -> tuple[Layout, list[str]]:
    """The first layout that fits, with the reasons; or the smallest one tried and 'nothing fits'."""
    pairs, reasons = model_parallel_degrees(ctx, base, req)
    smallest: tuple[Layout, Memory] | None = None
    for i, (tp, pp) in enumerate(pairs):
        tried: list[str] = []
        group_best: tuple[Layout, Memory] | None = None
        for lay in candidates(ctx, base, req, tp, pp):
            mem = ctx.memory(lay)
            if mem.fits:
                lay, why = prefer_hybrid(ctx, lay, req)
                mem = ctx.memory(lay)
                return lay, reasons + tried + why + [f"{describe(lay)} fits: {gb(mem.total)} of {gb(mem.gpu)} per GPU"]
            tried.append(f"{describe(lay)} needs {gb(mem.total)} > {gb(mem.gpu)} at its peak, the {mem.peak_at} "
                         f"(states {gb(mem.params + mem.grads + mem.optimizer)}, activations {gb(mem.activations)})")
            if group_best is None or mem.total < group_best[1].total:
                group_best = (lay, mem)
        assert group_best is not None
        if smallest is None or group_best[1].total < smallest[1].total:
            smallest = group_best
        if i + 1 < len(pairs):  # summarise this degree and move on; the last one's attempts are listed in full
            reasons.append(f"nothing fits at tp={tp} pp={pp} (smallest: {describe(group_best[0])} needs "
                           f"{gb(group_best[1].total)}); trying tp={pairs[i + 1][0]} pp={pairs[i + 1][1]}")
        else:
            reasons += tried
    assert smallest is not None
    reasons.append(f"nothing fits: the smallest layout tried, {describe(smallest[0])}, needs {gb(smallest[1].total)} "
                   f"per GPU; add GPUs or nodes, raise tensor/pipeline, or lower micro_batch or seq_len")
    return smallest[0], reasons


def grad_accum_for(global_batch: int | None, micro_batch: int, dp: int, grad_accum) -> tuple[int, int]:
    """(grad_accum, global_batch): global = micro_batch * dp * grad_accum; derive whichever is 'auto'."""
    if isinstance(grad_accum, int):
        return grad_accum, global_batch if global_batch is not None else micro_batch * dp * grad_accum
    if global_batch is None:
        return 1, micro_batch * dp
    return max(1, math.ceil(global_batch / (micro_batch * dp))), global_batch
