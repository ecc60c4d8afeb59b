"""The decision rules for `strategy: auto`, each choice with its reasons.

Candidates are tried in one flat order, and the first that fits wins (the usual practice, e.g. the ZeRO
paper sec. 5 and PyTorch's FSDP guidance):
1. the least sharding first: DDP (ZeRO-1 in the DeepSpeed family), then grad-op sharding / ZeRO-2, then full
   sharding / ZeRO-3;
2. for each of those, activation checkpointing off, then selective, then full;
3. then CPU offload (optimizer, then parameters);
4. tensor parallelism inside a node for models over ~80B parameters (or when nothing else fits), with sequence
   parallelism where the recipe leaves it to the planner, then pipeline parallelism across nodes.
A full-sharding choice on several nodes is then promoted to hybrid sharding when that also fits.

Each (tensor, pipeline) degree is sized as it would run: its own data-parallel degree and so its own grad_accum
(a pipeline keeps more micro-batches in flight, and its receive buffers grow with them). A degree that validate
would refuse (1F1B with fewer micro-batches than stages, fp16 under a pipeline, a batch split the recipe's own
degrees keep and this one breaks) is not tried.
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
from .batch import batch_problem, grad_accum_for
from .layout import Layout
from .memory import Memory, breakdown
from .pipeline import precision_problem, schedule_problem

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
    global_batch: int | None = None  # the recipe's; None: micro_batch x dp x grad_accum
    grad_accum: int | str = "auto"  # the recipe's: a number, or "auto" (derived for each degree)
    sequence_parallel: bool | None = False  # None: the search turns it on with tensor parallelism where it can
    hf: bool = False  # a Hugging Face model: the runtime splits it with tensor parallelism only


def describe(lay: Layout) -> str:
    extra = []
    if lay.activation_checkpointing != "none":
        extra.append(f"{lay.activation_checkpointing} activation checkpointing")
    if lay.offload != "none":
        extra.append(f"{lay.offload} offload")
    if lay.tp > 1 or lay.pp > 1:
        extra.append(
            f"tp={lay.tp} pp={lay.pp}" + (" sequence parallel" if lay.tp > 1 and lay.sequence_parallel else "")
        )
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
    """The largest TP degree within a node that splits the model evenly: the attention heads, kv heads, SwiGLU
    width and vocabulary (what the runtime's `tensor_parallel.check_divisible` asks)."""
    best = 1
    for t in range(1, min(ctx.per_node, MAX_TP) + 1):
        if ctx.per_node % t:
            continue
        s = ctx.shape
        if s is not None and (s.heads % t or s.kv_heads % t or s.ffn_hidden % t or s.vocab % t):
            continue
        best = t
    return best


def sequence_parallel(ctx: Context, req: Request, tp: int) -> bool:
    """Sequence parallelism at this tensor degree: the recipe's choice, or (req.sequence_parallel None) the
    search's: on wherever the runtime can split the sequence (it divides by tp; not a Hugging Face model), since
    it only lowers activation memory (the norms and the residual stream are split too) for the same
    communication volume (Korthikanti et al. 2022, sec. 4.2.2: an all-reduce is a reduce-scatter and an
    all-gather)."""
    if req.sequence_parallel is not None:
        return req.sequence_parallel
    return tp > 1 and ctx.seq % tp == 0 and not req.hf


def _split(base: Layout, req: Request, tp: int, pp: int) -> tuple[int, int]:
    """(dp, grad_accum) of the recipe's world at these degrees."""
    dp = max((base.dp * base.tp * base.pp) // (tp * pp), 1)
    return dp, grad_accum_for(req.global_batch, base.micro_batch, dp, req.grad_accum)[0]


def degree_problem(ctx: Context, base: Layout, req: Request, tp: int, pp: int) -> str | None:
    """Why the job could not run at these degrees (validate's rules, one home each), or None. A batch that the
    recipe's own degrees cannot split either is the recipe's problem, left to validate, not the degrees'."""
    dp, ga = _split(base, req, tp, pp)
    layers = ctx.shape.layers if ctx.shape is not None else None
    problem = schedule_problem(base.pp_schedule, pp, ga, layers) or precision_problem(pp, base.precision)
    if problem:
        return problem
    new = batch_problem(req.global_batch, base.micro_batch, dp, req.grad_accum)
    if new and not batch_problem(req.global_batch, base.micro_batch, base.dp, req.grad_accum):
        return new[0]
    return None


def model_parallel_degrees(ctx: Context, base: Layout, req: Request) -> tuple[list[tuple[int, int]], list[str]]:
    """(tp, pp) pairs to try, in order, and why."""
    reasons: list[str] = []
    tps = [base.tp]
    # tied embeddings: one weight that tensor parallelism would split as two tensors and a pipeline would put on
    # its first and last stages (the runtime refuses both); DeepSpeed runs neither (the runtime's are torch's)
    search = (
        req.strategy == "auto"
        and not (ctx.shape is not None and ctx.shape.tied_embeddings)
        and req.backend != "deepspeed"
    )
    if search and not req.tp_fixed and base.tp == 1:
        t = largest_tp(ctx)
        if t > 1 and ctx.n_params > TP_PARAM_THRESHOLD:
            reasons.append(
                f"{ctx.n_params / 1e9:.0f}B parameters > {TP_PARAM_THRESHOLD / 1e9:.0f}B: "
                f"tensor parallel {t} within each node"
            )
            tps = [t]
        elif t > 1:
            tps = [1, t]
    pairs = []
    for tp in tps:
        pps = [base.pp]
        if search and not req.pp_fixed and base.pp == 1 and ctx.nodes > 1 and tp > 1 and not req.hf:
            layers = ctx.shape.layers if ctx.shape is not None else ctx.nodes
            pps = [p for p in divisors(ctx.nodes) if p <= layers]
        pairs += [(tp, pp) for pp in pps]
    return pairs, reasons


def candidates(ctx: Context, base: Layout, req: Request, tp: int, pp: int) -> Iterator[Layout]:
    """Every layout at this (tp, pp), cheapest first: offload, then checkpointing, then sharding vary."""
    strategies = [req.strategy] if req.strategy != "auto" else [s.value for s in SEARCH_ORDER[Family(req.backend)]]
    acs = [req.activation_checkpointing] if req.activation_checkpointing != "auto" else ["none", "selective", "full"]
    offloads = [req.offload] if req.offload != "auto" else ["none", "optimizer", "params"]
    dp, ga = _split(base, req, tp, pp)
    sp = sequence_parallel(ctx, req, tp)
    seen = set()
    for off, ac, s in itertools.product(offloads, acs, strategies):
        shard = (base.shard or ctx.per_node) if spec(s).replicate_across_nodes else None
        lay = replace(
            base,
            tp=tp,
            pp=pp,
            dp=dp,
            grad_accum=ga,
            sequence_parallel=sp,
            strategy=s,
            activation_checkpointing=ac,
            offload=offload_for(s, off),
            shard=shard,
        )
        if lay not in seen:  # a strategy without the offload asked for is the same layout as without offload
            seen.add(lay)
            yield lay


def prefer_hybrid(ctx: Context, lay: Layout, req: Request) -> tuple[Layout, list[str]]:
    """Full sharding across nodes -> hybrid (shard inside a node, replicate across nodes) when that fits too:
    the parameter all-gathers then stay on the node's fast links."""
    if req.strategy != "auto" or lay.strategy != StrategyName.FSDP or ctx.nodes == 1 or lay.dp <= ctx.per_node:
        return lay, []
    hyb = replace(lay, strategy=StrategyName.HYBRID.value, shard=max(ctx.per_node // (lay.tp * lay.pp), 1))
    mem = ctx.memory(hyb)
    if hyb.shard_group <= 1 or not mem.fits:
        return lay, []
    return hyb, [
        f"hybrid sharding also fits ({gb(mem.total)}): shard inside each node, replicate across nodes, "
        f"so parameter all-gathers stay on the node's fast links"
    ]


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
        return lay, [
            f"gradients reduce-scattered on each of the {lay.grad_accum} micro-batches: keeping them "
            f"unsharded until the step's last one would need {gb(mem.total)} > {gb(mem.gpu)}"
        ]
    return once, [
        f"gradients reduce-scattered once per step, not on each of the {lay.grad_accum} micro-batches: "
        f"every rank keeps them unsharded in fp32 meanwhile, and that fits ({gb(mem.total)})"
    ]


def choose(ctx: Context, base: Layout, req: Request) -> tuple[Layout, list[str]]:
    """The first layout that fits, with the reasons; or the smallest one tried and 'nothing fits'. Every layout is
    sized with the grad_accum of its own degrees, and the reasons' figures are the returned layout's."""
    pairs, reasons = model_parallel_degrees(ctx, base, req)
    runnable = []
    for tp, pp in pairs:
        problem = degree_problem(ctx, base, req, tp, pp) if len(pairs) > 1 else None
        if problem:
            reasons.append(f"tp={tp} pp={pp} not tried: {problem}")
        else:
            runnable.append((tp, pp))
    if not runnable:  # every degree has a problem: size them anyway, and let validate say what to change
        reasons.append("no tensor/pipeline degree runs this batch as it is: sizing them all (see `dtlaunch validate`)")
        runnable = pairs
    smallest: tuple[Layout, Memory] | None = None
    for i, (tp, pp) in enumerate(runnable):
        tried: list[str] = []
        group_best: tuple[Layout, Memory] | None = None
        for lay in candidates(ctx, base, req, tp, pp):
            mem = ctx.memory(lay)
            if mem.fits:
                lay, why = prefer_hybrid(ctx, lay, req)
                mem = ctx.memory(lay)
                return lay, reasons + tried + why + _sp_reason(lay, req) + [
                    f"{describe(lay)} fits: {gb(mem.total)} of {gb(mem.gpu)} per GPU"
                ]
            tried.append(
                f"{describe(lay)} needs {gb(mem.total)} > {gb(mem.gpu)} at its peak, the {mem.peak_at} "
                f"(states {gb(mem.params + mem.grads + mem.optimizer)}, activations {gb(mem.activations)}, "
                f"buffers {gb(mem.buffers)})"
            )
            if group_best is None or mem.total < group_best[1].total:
                group_best = (lay, mem)
        assert group_best is not None
        if smallest is None or group_best[1].total < smallest[1].total:
            smallest = group_best
        if i + 1 < len(runnable):  # summarise this degree and move on; the last one's attempts are listed in full
            reasons.append(
                f"nothing fits at tp={tp} pp={pp} (smallest: {describe(group_best[0])} needs "
                f"{gb(group_best[1].total)}); trying tp={runnable[i + 1][0]} pp={runnable[i + 1][1]}"
            )
        else:
            reasons += tried
    assert smallest is not None
    lay, mem = smallest
    return lay, reasons + _sp_reason(lay, req) + [
        f"nothing fits: the smallest layout tried, {describe(lay)}, needs {gb(mem.total)} per GPU; add GPUs or "
        "nodes, raise tensor/pipeline, or lower micro_batch or seq_len"
    ]


def _sp_reason(lay: Layout, req: Request) -> list[str]:
    if req.sequence_parallel is None and lay.sequence_parallel:
        return [
            f"sequence parallelism with tensor {lay.tp}: the norms and the residual stream are split over the "
            "sequence as well, less activation memory for the same communication volume"
        ]
    return []
