"""The per-GPU memory of one training step, moment by moment, for the runtime as it is.

A step's memory does not peak everywhere at once: activations are largest at the end of forward, the loss's
temporaries exist only around the loss, FSDP's gathered weights and reduce-scatter buffers only around one
unit, the optimizer's temporaries only in its step. So each moment below lists what is alive then, and the
plan's figure is the largest moment, not a sum of maxima that never coincide.

Moments, in step order (`launcher.trace` finds the same ones in the tracker's timeline), each the largest of
its candidate points (`VARIANTS`):
- forward: the head's forward, the last FSDP unit of forward: every layer's activations, the logits, and the
  head's weights all-gathered (FSDP2 keeps a unit's all-gather buffer until the next unit's copy-out, so 2x);
  or the last block's forward, with a block's weights twice;
- loss forward: the logits plus one fp32 chunk of the loss;
- loss backward: the logits, their gradient and one fp32 chunk, on top of every layer's activations;
- head backward: the output projection's backward (the logits' gradient, the head's weights and its unsharded
  weight gradient, the last layer prefetched), then the head's reduce-scatter, then the final norm's backward;
- layer backward: the first layer in backward at SwiGLU's backward peak (`activations.layer_in_backward`), its
  weights, the next layer prefetched, and the head's fp32 reduce-scatter input (FSDP2 keeps one until the next
  unit's post-backward); or the second layer, holding a layer's reduce-scatter input (larger than the head's
  for a small vocabulary); or the end of either's backward, its first norm's recompute beside all of its
  gradients (for large layers and few activations, e.g. full checkpointing at 70B+);
- end of backward: the embedding's gradient computed, or its reduce-scatter;
- optimizer step: the states plus AdamW's foreach temporary (sqrt of the second moment, 4 bytes per param).
Later layers hold fewer activations and the same buffers, so they never peak higher.

Not counted, because no tensor holds them: kernel workspaces (flash attention's fp32 gradient accumulator, about
4 bytes x sbh for one layer, cuBLAS workspaces), NCCL's buffers and the CUDA context, which `memory`'s 1 GB
context and 5% fragmentation cover.

FSDP2 facts used (torch.distributed.fsdp, `fully_shard` with MixedPrecisionPolicy(param_dtype, fp32 reduce)):
weights are all-gathered per unit in param_dtype; gradients are produced unsharded in param_dtype and copied
into an fp32 reduce-scatter input of the unit's size; sharded fp32 gradients accumulate across micro-steps
because the runtime reduce-scatters on every micro-step. Units are `runtime.parallel.fsdp_units`: the token
embedding, each block, the output head, and the root with the final norm.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..catalog import ModelShape
from ..deepspeed_config import DS_ALLGATHER_BUCKET, DS_REDUCE_BUCKET
from ..strategies import Family
from . import activations as act
from .layout import Layout
from .params import embedding_params, layer_params, layer_params_per_rank
from .pipeline import in_flight, num_stages, stage_layers, stages_of_rank, steady

MOMENTS = ("forward", "loss forward", "loss backward", "head backward", "layer backward", "end of backward",
           "optimizer step")
# Tensor terms of a moment; `activations` is what the layers keep (L x per layer), `backward` what the layer
# in backward adds, `loss` the head, logits and loss temporaries, `buffers` the strategy's communication and
# gathered-weight buffers.
TERMS = ("params", "grads", "optimizer", "activations", "backward", "loss", "buffers")

@dataclass(frozen=True)
class States:
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
    holds the buckets: `_deepspeed_buffers`), and the fp32 master weights and Adam's moments live and are
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
    (the runtime's FSDP2 with shard groups of one; `launcher.runtime.meshengine`)."""
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


@dataclass(frozen=True)
class Part:
    """What one rank holds of the model, and the most block activations it keeps at once: the whole model
    (pp = 1: every block of one micro-batch), or a pipeline rank's stages under its schedule."""

    emb: bool = True
    head: bool = True
    blocks: float = 0.0  # blocks held
    stage_blocks: float = 0.0  # blocks of its largest stage (what one micro-batch's backward frees)
    in_flight: float = 0.0  # blocks' worth of activations alive at the most (`pipeline.in_flight`)
    outputs: float = 0.0  # stage outputs kept for backward then (one per micro-batch and stage in flight)
    recv: float = 0.0  # the stages' receive buffers, residual-stream sized (`timeline`)
    steady: bool = True  # a backward runs before the rank's last forward (`pipeline.steady`)
    rank: int = 0  # the pipeline rank


def pipeline_parts(shape: ModelShape | None, lay: Layout) -> list[Part]:
    """The ranks to size: everything when pp = 1; else the first pipeline rank (the embedding, the most micro-
    batches in flight) and the last (the head, the logits, the loss). Middle ranks hold no more than the first."""
    if shape is None:
        return [Part()]
    return [part_of(shape, lay, r) for r in sorted({0, lay.pp - 1})]


def part_of(shape: ModelShape, lay: Layout, rank: int) -> Part:
    """What pipeline rank `rank` holds: the runtime's split (`pipeline.stage_layers`) and schedule."""
    if lay.pp == 1:
        return Part(blocks=shape.layers, in_flight=shape.layers)
    stages = num_stages(lay.pp, lay.pp_schedule)
    try:
        counts = stage_layers(shape.layers, stages)
    except ValueError:  # more stages than blocks: refused by validate; size an even split meanwhile
        counts = [math.ceil(shape.layers / stages)] * stages
    ids = stages_of_rank(rank, lay.pp, lay.pp_schedule)
    blocks = {i: float(counts[i]) for i in ids}
    return Part(emb=0 in ids, head=stages - 1 in ids, blocks=sum(blocks.values()), stage_blocks=max(blocks.values()),
                in_flight=in_flight(lay.pp_schedule, lay.pp, lay.grad_accum, rank, blocks),
                outputs=in_flight(lay.pp_schedule, lay.pp, lay.grad_accum, rank,
                                  {i: 1.0 for i in ids if i != stages - 1}),
                recv=lay.grad_accum * sum((i != 0) + (i != stages - 1) for i in ids),
                steady=steady(lay.pp_schedule, lay.pp, lay.grad_accum, rank), rank=rank)


def rank_states(shape: ModelShape, arch: str, n_params: float, lay: Layout, pp_rank: int) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes the optimizer step sees on a rank of pipeline rank `pp_rank`: what
    tests/runtime/test_rt_layouts.py reads off the runtime's wrapped model."""
    return model_states(rank_params(shape, arch, n_params, lay, part_of(shape, lay, pp_rank)), lay)


def rank_params(shape: ModelShape | None, arch: str, n_params: float, lay: Layout, part: Part) -> float:
    """Parameters on one rank before data-parallel sharding: its stages' blocks, the embedding and the head
    where it holds them, with tensor parallelism's split (`params.layer_params_per_rank`). A params-only or
    GPT model: an even share, n / (tp x pp)."""
    if shape is None or arch == "gpt" or not part.blocks:
        return n_params / (lay.tp * lay.pp)
    vh = shape.vocab * shape.hidden / lay.tp
    head = (0.0 if shape.tied_embeddings else vh) + shape.hidden
    return (vh if part.emb else 0.0) + part.blocks * layer_params_per_rank(shape, lay.tp) + (head if part.head else 0.0)


@dataclass(frozen=True)
class Units:
    """Parameter counts of the FSDP units (per model-parallel shard): embedding, one block, head, root; and
    the block's down projection w2, whose gradient is the one alive at the block's backward peak."""

    emb: float
    layer: float
    head: float
    root: float
    w2: float


def units(shape: ModelShape | None, arch: str, n: float, lay: Layout, part: Part = Part()) -> Units:
    t = lay.tp
    if shape is None:  # a params-only model: a typical block is ~1/40 of it, w2 ~1/3 of a block
        return Units(0.0, n / 40, 0.0, 0.0, n / 120)
    vh = shape.vocab * shape.hidden / t
    layer = layer_params(shape, arch) / t if arch == "gpt" else layer_params_per_rank(shape, t)
    w2 = shape.hidden * (shape.ffn_hidden if arch != "gpt" else 4 * shape.hidden) / t
    if shape.tied_embeddings or arch == "gpt":  # tied (or GPT's extra tables): embedding and head in the root
        return Units(0.0, layer, 0.0, embedding_params(shape, arch) / t, w2)
    return Units(vh if part.emb else 0.0, layer, vh if part.head else 0.0, shape.hidden if part.head else 0.0, w2)


# Candidate peaks of a moment: "moment (variant)" rows are folded into "moment" by keeping the larger total.
VARIANTS = {
    "forward (last block)": "forward",  # the last block's forward, before the head's
    "head backward (reduce)": "head backward",  # the head's reduce-scatter, after the output projection's backward
    "head backward (norm)": "head backward",  # then the final norm's backward
    "layer backward (second)": "layer backward",  # the second layer in backward, holding a layer's RS input
    "layer backward (end)": "layer backward",  # the end of a layer's backward: all its gradients, its first norm
    "layer backward (end, second)": "layer backward",
    "end of backward (reduce)": "end of backward",  # the embedding's reduce-scatter, after its gradient
}


def _fsdp_buffers(u: Units, n: float, lay: Layout, w: float) -> dict[str, float]:
    """FSDP2's gathered weights, unsharded gradients and reduce-scatter inputs alive at each moment.

    w = param_dtype bytes; a reduce-scatter input is fp32 (reduce_dtype), 4 bytes per parameter, and its output
    4/d. In forward a unit's all-gather buffer lives until the next unit's copy-out, so a unit computes with 2w
    per parameter; in backward the next unit is prefetched (w) and the last reduce-scatter input is held until
    the next unit's post-backward. reshard_after_forward=False (fsdp_grad_op) keeps every unit gathered from
    its forward to its backward. SwiGLU's backward peak comes right after w2's backward: of the block's
    gradients only w2's exists then.
    """
    keep = lay.spec.reshard_after_forward is False
    d = fsdp_group(lay)
    ag = 0.0 if d == 1 else 1.0  # a group of one copies its shard in place: no all-gather buffer
    root = w * u.root  # gathered from the start of forward to the end of backward (the final norm: tiny)
    kept = w * n if keep else 0.0
    kept_but_head = kept - w * u.head if keep else 0.0
    first, other = (u.emb, 0.0) if u.emb else (u.root, -root)  # the last unit in backward
    if keep:  # every unit but the head, the layer in backward among them (the one before it resharded)
        layer_bw, second_bw = kept_but_head, kept_but_head - w * u.layer
    else:  # the layer in backward and the next one, prefetched (its all-gather buffer)
        layer_bw = second_bw = (1 + ag) * w * u.layer
    return {
        "forward": root + kept_but_head + (1 + ag) * w * u.head,
        "forward (last block)": root + kept_but_head - (w * u.layer if keep else 0.0) + (1 + ag) * w * u.layer,
        "loss forward": root + kept,
        "loss backward": root + kept,
        "head backward": root + kept_but_head + 2 * w * u.head + (0.0 if keep else ag * w * u.layer),
        "head backward (reduce)": root + (kept_but_head if keep else ag * w * u.layer) + w * u.head
        + 4 * u.head * (1 + 1 / d),
        "head backward (norm)": root + (kept_but_head if keep else ag * w * u.layer) + 4 * u.head,
        "layer backward": root + layer_bw + w * u.w2 + 4 * u.head,
        "layer backward (second)": root + second_bw + w * u.w2 + 4 * u.layer,
        # at the end of a layer's backward every gradient of it exists, the next layer is still prefetched
        "layer backward (end)": root + layer_bw + w * u.layer + 4 * u.head,
        "layer backward (end, second)": root + second_bw + w * u.layer + 4 * u.layer,
        # its gradient computed with its weights gathered (plus the all-gather buffer at the copy-out) and the
        # first layer's reduce-scatter input held; or its own reduce-scatter, its weights resharded
        "end of backward": root + other + (1 + ag) * w * first + 4 * u.layer,
        "end of backward (reduce)": root + other + w * first + 4 * first * (1 + 1 / d),
        "optimizer step": 0.0,
    }


def _pipeline_buffers(u: Units, n: float, lay: Layout, w: float) -> dict[str, float]:
    """FSDP2 under a pipeline schedule: torch's stages turn off resharding after backward and the gradient
    reduction until the last micro-batch's backward, and the runtime does not reshard after forward, so every
    unit of the rank's stages stays gathered (w per parameter) from its first forward to the end of the step.
    In 16-bit, a unit's backward produces its 16-bit gradient before FSDP2 adds it to the fp32 accumulation;
    at the end each unit is reduce-scattered in turn (an fp32 input and its 1/d output)."""
    gathered = w * n
    fresh = w < 4  # fp32 gradients are accumulated in place
    unit = max(u.layer, u.emb, u.head, u.root)
    out = dict.fromkeys((*MOMENTS, *VARIANTS), gathered)
    out.update({
        "head backward": gathered + (w * u.head if fresh else 0.0),
        "layer backward": gathered + (w * u.w2 if fresh else 0.0),
        "layer backward (second)": gathered + (w * u.w2 if fresh else 0.0),
        "layer backward (end)": gathered + (w * u.layer if fresh else 0.0),
        "layer backward (end, second)": gathered + (w * u.layer if fresh else 0.0),
        "end of backward (reduce)": gathered + 4 * unit * (1 + 1 / fsdp_group(lay)),
        "optimizer step": 0.0,
    })
    return out


def _pipeline_grads(moment: str, g: float, n: float, u: Units, lay: Layout, part: Part) -> float:
    """Under a pipeline the gradients accumulate unsharded in fp32 (4 per parameter) through the step's
    micro-batches: all of them at every moment once the rank alternates backwards and forwards (1F1B's steady
    state); a rank that runs all its forwards first peaks in the first micro-batch's backward, holding only
    the gradients of the units done. The reduction at the end fills the sharded ones as it frees those; the
    optimizer step sees only the sharded ones."""
    if moment == "optimizer step":
        return g
    unsharded = 4 * n if part.steady else _grads_at(moment, 4 * n, n, u, replace(lay, grad_accum=1))
    return unsharded + (g if moment.startswith("end of backward") else 0.0)


def _grads_at(moment: str, g: float, n: float, u: Units, lay: Layout) -> float:
    """Sharded gradients alive: all of them from the second micro-step on (they accumulate across micro-steps);
    with one micro-step, only those of the units already reduce-scattered in this backward."""
    if lay.grad_accum > 1 or g == 0 or not n:
        return g
    done = {"head backward (norm)": u.head, "layer backward": u.head, "layer backward (second)": u.head + u.layer,
            "layer backward (end)": u.head, "layer backward (end, second)": u.head + u.layer,
            "end of backward": n - u.emb, "end of backward (reduce)": n - u.emb, "optimizer step": n}
    return g * done.get(moment, 0.0) / n


def model_parallel(lay: Layout) -> bool:
    """Tensor or pipeline parallel: the runtime's DeviceMesh engine, FSDP2 for every torch strategy."""
    return lay.tp > 1 or lay.pp > 1


def timeline(shape: ModelShape | None, arch: str, n: float, seq: int, lay: Layout,
             part: Part | None = None) -> dict[str, dict[str, float]]:
    """moment -> term -> bytes per GPU, for `n` parameters on this rank (`rank_params`); `part` is what the
    rank holds (default: the first pipeline rank, or the whole model)."""
    part = part if part is not None else pipeline_parts(shape, lay)[0]
    st = states(n, lay)
    sp = lay.spec
    fsdp = sp.family is Family.TORCH and (sp.sharded or model_parallel(lay))
    piped = fsdp and lay.pp > 1
    w = 2 if lay.precision in ("bf16", "fp16") else 4  # param_dtype, 16-bit weights, autocast copies
    u = units(shape, arch, n, lay, part)
    acts = _activations(shape, arch, seq, lay, w, part)
    if piped:
        buffers = _pipeline_buffers(u, n, lay, w)
    elif fsdp:
        buffers = _fsdp_buffers(u, n, lay, w)
    elif not sp.sharded:
        buffers = _ddp_buffers(shape, u, n, lay, w)
    else:
        buffers = dict.fromkeys((*MOMENTS, *VARIANTS), _deepspeed_buffers(u, lay, w))
    buffers["optimizer step"] = 0.0
    if part.recv and shape is not None:
        # torch's pipeline stages allocate, once and for good, a receive buffer per micro-batch for the stage's
        # input (all but the first stage) and one for the gradient of its output (all but the last), each a
        # residual-stream tensor of one micro-batch (a rank's slice of it with sequence parallelism)
        spar = lay.sequence_parallel and lay.tp > 1
        io = w * seq * lay.micro_batch * shape.hidden / (lay.tp if spar else 1)
        buffers = {m: v + part.recv * io for m, v in buffers.items()}
    # The model's buffers: the fp32 RoPE tables, cos and sin of (seq_len, head_dim/2), on every rank.
    rope = 4 * shape.seq_len * shape.hidden / shape.heads if shape is not None and arch != "gpt" else 0.0
    rows = {}
    for m in (*MOMENTS, *VARIANTS):
        rows[m] = {
            "params": st.params + rope,
            "grads": (_pipeline_grads(m, st.grads, n, u, lay, part) if piped
                      else _grads_at(m, st.grads, n, u, lay) if fsdp else st.grads)
            + (st.step_grads if m == "optimizer step" else 0.0),
            "optimizer": st.optimizer + (st.step_temp if m == "optimizer step" else 0.0),
            "activations": acts.layers if acts.during_step(m) else 0.0,
            "backward": acts.backward.get(m, 0.0),
            "loss": acts.loss.get(m, 0.0) + acts.tokens,
            "buffers": buffers[m],
        }
    if piped and acts.one:
        # A micro-batch's backward ends with the first stage's embedding (or a stage's first block) while the
        # other micro-batches in flight keep their activations: the step's "end of backward" is not the only one.
        rows["end of backward (micro-batch)"] = {
            **rows["end of backward"], "grads": _pipeline_grads("layer backward", st.grads, n, u, lay, part),
            "activations": acts.layers - acts.one,
            "buffers": buffers["layer backward"] + (w * u.emb if w < 4 else 0.0) - (w * u.w2 if w < 4 else 0.0)}
        variants = {**VARIANTS, "end of backward (micro-batch)": "end of backward"}
    else:
        variants = VARIANTS
    for variant, moment in variants.items():
        if sum(rows[variant].values()) > sum(rows[moment].values()):
            rows[moment] = rows[variant]
        del rows[variant]
    return rows


@dataclass(frozen=True)
class _Acts:
    layers: float  # every layer's saved activations (the pipeline's first stage: its in-flight micro-batches)
    backward: dict[str, float]  # by moment: what the layer in backward (or the last in forward) adds
    loss: dict[str, float]  # by moment: the head's activations, the logits and the loss's temporaries
    tokens: float  # the step's token ids, alive through the whole step
    one: float = 0.0  # a pipeline: one micro-batch's share of `layers` (its largest stage's blocks and output)

    @staticmethod
    def during_step(moment: str) -> bool:
        return not moment.startswith(("end of backward", "optimizer step"))


def _activations(shape: ModelShape | None, arch: str, seq: int, lay: Layout, e: int, part: Part) -> _Acts:
    """The activation terms of each moment on a rank holding `part` (e = bytes of an activation)."""
    if shape is None:
        return _Acts(0.0, {}, {}, 0.0)
    b, t, spar = lay.micro_batch, lay.tp, lay.sequence_parallel and lay.tp > 1
    torch_family = lay.spec.family is Family.TORCH
    fsdp = torch_family and (lay.spec.sharded or model_parallel(lay))
    cast = fsdp  # FSDP2 casts each block's inputs
    autocast = torch_family and not fsdp and e < 4  # DDP in 16-bit runs under torch.autocast
    per = act.activation_bytes_per_layer(shape, arch, seq, b, t, spar, lay.activation_checkpointing, e, cast,
                                         autocast)
    whole = act.activation_bytes_per_layer(shape, arch, seq, b, t, spar, "none", e, cast, autocast)
    in_bw = act.layer_in_backward(shape, arch, seq, b, t, spar, e, cast, autocast) - per
    head = act.head_bytes(shape, seq, b, t, e, autocast, spar)
    logits = act.logits_bytes(shape, seq, b, t, e)
    # a tensor of the residual stream: whole on every tensor-parallel rank, but for sequence parallelism's slices
    sbh = (4 if autocast else e) * seq * b * shape.hidden / (t if spar else 1)
    norm_extra = act.norm_backward_extra(shape, seq, b, t, e, autocast, spar)
    # The end of a layer's backward is its first norm's: of its activations only that norm's input is left,
    # with the gradient of the norm's output and the norm's recompute (`activations.norm_backward_extra`).
    norm_end = 2 * sbh + norm_extra - per
    backward = {
        "layer backward": in_bw,
        "layer backward (second)": in_bw - per,  # the first layer in backward has freed its own
        "layer backward (end)": norm_end,
        "layer backward (end, second)": norm_end - per,
        # the last block's forward at its end: all its activations (transiently, under checkpointing too) and
        # its output; the layers term counts it once already
        "forward (last block)": whole - per + sbh,
        "end of backward": sbh,  # the embedding's (or the stage input's) gradient
    }
    loss = {
        "forward": head + logits,
        "loss forward": head + act.loss_forward(shape, seq, b, t, e),
        "loss backward": head + act.loss_backward(shape, seq, b, t, e),
        # the output projection's backward: the logits' gradient and the gradient of the norm's output
        "head backward": head + logits + sbh,
        # the head's reduce-scatter (its post-backward comes before the final norm's backward): the norm's
        # input and the gradient of its output
        "head backward (reduce)": 2 * sbh,
        # then the final norm's backward: its input and its recompute (the incoming gradient is freed by the
        # first op of its backward)
        "head backward (norm)": sbh + norm_extra,
    } if part.head else {}
    # The step's token ids: grad_accum micro-batches of (b, s+1) int64, loaded at the start of the step.
    tokens = lay.grad_accum * 8 * b * (seq + 1)
    # A pipeline stage keeps each micro-batch's output until its backward (the next stage has its own copy).
    outputs = part.outputs * sbh
    one = per * part.stage_blocks + sbh if lay.pp > 1 else 0.0
    return _Acts(per * part.in_flight + outputs, backward, loss, tokens, one)


def _ddp_buffers(shape: ModelShape | None, u: Units, n: float, lay: Layout, w: float) -> dict[str, float]:
    """DDP: its buckets are its gradients (gradient_as_bucket_view; the runtime zeroes them in place), so the
    only extra is, in 16-bit, torch.autocast's copy of each linear layer's fp32 weight, kept by autograd from
    forward to that layer's backward. Not copied: the embedding and the norms (their ops run in fp32), the
    tensors made inside a checkpointed region (w2 under selective; every block under full, where only the
    layer being recomputed holds its copies)."""
    if lay.precision == "fp32":
        return dict.fromkeys((*MOMENTS, *VARIANTS), 0.0)
    layers = shape.layers if shape is not None else 40
    linear = u.layer - (2 * shape.hidden / lay.tp if shape is not None else 0.0)  # a block's linear weights
    saved_per_layer = {"none": linear, "selective": linear - u.w2, "full": 0.0}[lay.activation_checkpointing]
    copies = w * (u.head + layers * saved_per_layer)
    if shape is None:
        copies = w * n
    out = dict.fromkeys((*MOMENTS, *VARIANTS), copies)
    for m in ("layer backward", "layer backward (second)", "layer backward (end)", "layer backward (end, second)"):
        out[m] = copies + (w * linear if lay.activation_checkpointing == "full" else 0.0)  # the recomputed layer
    out["end of backward"] = out["end of backward (reduce)"] = out["optimizer step"] = 0.0
    return out


def _deepspeed_buffers(u: Units, lay: Layout, w: float) -> float:
    """DeepSpeed's reduce/all-gather buckets as rendered; for ZeRO-3 the largest unit gathered twice plus its
    fp32 gradient (DeepSpeed cannot be traced: its own estimate, not derived from a trace). With ZeRO-1/2
    optimizer offload, DeepSpeed also keeps a 16-bit staging buffer of the largest parameter's size on the GPU
    for the gradients it copies to the host (`temp_grad_buffer_for_gpu_offload` in `stage_1_and_2.py`)."""
    if "params" not in lay.spec.shards:  # ZeRO-1/2
        staging = w * max(u.emb, u.head, u.root, u.w2) if lay.offload in ("optimizer", "params") else 0.0
        return (DS_REDUCE_BUCKET + DS_ALLGATHER_BUCKET) * w + staging
    unit = max(u.layer, u.emb, u.head, u.root)
    return 2 * unit * w + unit * 4
