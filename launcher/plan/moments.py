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
when the runtime reduce-scatters on every micro-step, unsharded ones when it reduces once per step
(`strategies.reduces_once_per_step`). Units are `runtime.engines.mesh.fsdp_units`: the token
embedding, each block, the output head, and the root with the final norm; or, for tables no larger than a
block (`params.embedding_units_apart`), each block and a root holding the embedding, the head and the norm.
"""

from __future__ import annotations

import msgspec
from msgspec.structs import replace

from ..catalog import ModelShape
from ..strategies import Family
from . import activations as act
from .buckets import DS_REDUCE_BUCKET, overlaps_comm
from .layout import Layout
from .params import embedding_params, embedding_units_apart, layer_params, layer_params_per_rank
from .parts import WHOLE_MODEL, Part, pipeline_parts
from .states import fsdp_group, states

MOMENTS = (
    "forward",
    "loss forward",
    "loss backward",
    "head backward",
    "layer backward",
    "end of backward",
    "optimizer step",
)
# Tensor terms of a moment; `activations` is what the layers keep (L x per layer), `backward` what the layer
# in backward adds, `loss` the head, logits and loss temporaries, `buffers` the strategy's communication and
# gathered-weight buffers.
TERMS = ("params", "grads", "optimizer", "activations", "backward", "loss", "buffers")


class Units(msgspec.Struct, frozen=True):
    """Parameter counts of the FSDP units (per model-parallel shard): embedding, one block, head, root; and
    the block's down projection w2, whose gradient is the one alive at the block's backward peak."""

    emb: float
    layer: float
    head: float
    root: float
    w2: float
    root_head: float = 0.0  # the head's parameters when the root holds it (its gradient: head to root's backward)
    tied: bool = False  # the head is the embedding's weight


def units(shape: ModelShape | None, arch: str, n: float, lay: Layout, part: Part = WHOLE_MODEL) -> Units:
    t = lay.tp
    if shape is None:  # a params-only model: a typical block is ~1/40 of it, w2 ~1/3 of a block
        return Units(0.0, n / 40, 0.0, 0.0, n / 120)
    vh = shape.vocab * shape.hidden / t
    layer = layer_params(shape, arch) / t if arch == "gpt" else layer_params_per_rank(shape, t)
    w2 = shape.hidden * (shape.ffn_hidden if arch != "gpt" else 4 * shape.hidden) / t
    # GPT's extra tables, or tied tables, or tables no larger than a block: embedding and head in the root
    if arch == "gpt" or not embedding_units_apart(shape, model_parallel(lay)):
        return Units(0.0, layer, 0.0, embedding_params(shape, arch) / t, w2, vh, shape.tied_embeddings)
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


def _fsdp_buffers(u: Units, n: float, lay: Layout, w: float, once: bool = False) -> dict[str, float]:
    """FSDP2's gathered weights, unsharded gradients and reduce-scatter inputs alive at each moment.

    w = param_dtype bytes; a reduce-scatter input is fp32 (reduce_dtype), 4 bytes per parameter, and its output
    4/d. In forward a unit's all-gather buffer lives until the next unit's copy-out, so a unit computes with 2w
    per parameter; in backward the next unit is prefetched (w) and the last reduce-scatter input is held until
    the next unit's post-backward. reshard_after_forward=False (fsdp_grad_op) keeps every unit gathered from
    its forward to its backward. SwiGLU's backward peak comes right after w2's backward: of the block's
    gradients only w2's exists then. Reducing once per step in fp32 (`once`), a unit's new gradient is added in
    place to the one kept from the earlier micro-steps (counted with the gradients), so no copy of it is a
    buffer; in 16-bit the new 16-bit gradient is one until its unit's post-backward adds it to the fp32 one.
    """
    keep = lay.spec.reshard_after_forward is False
    d = fsdp_group(lay)
    ag = 0.0 if d == 1 else 1.0  # a group of one copies its shard in place: no all-gather buffer
    # the root: gathered through its forward (the whole model's) and from the start of backward to its end;
    # with every unit kept gathered, it is one of them (in `kept`)
    root = 0.0 if keep else w * u.root
    kept = w * n if keep else 0.0
    kept_but_head = kept - w * u.head if keep else 0.0
    first, other = (u.emb, 0.0) if u.emb else (u.root, -root)  # the last unit in backward
    if keep:  # every unit but the head, the layer in backward among them (the one before it resharded)
        layer_bw, second_bw = kept_but_head, kept_but_head - w * u.layer
    else:  # the layer in backward and the next one, prefetched (its all-gather buffer)
        layer_bw = second_bw = (1 + ag) * w * u.layer
    # A head in the root: its forward runs with the last block's all-gather buffer still held (no unit's
    # copy-out since), and its unsharded gradient stays until the root's post-backward, at the very end.
    head_fw = (1 + ag) * w * u.head if u.head else ag * w * u.layer
    fresh = 0.0 if once and w >= 4 else 1.0
    # In the head's backward, the head's new gradient exists in any case; after it, it is a buffer unless added
    # in place to a kept one. A tied weight's is not here: see `_pending_tied_grad`.
    hg_new = 0.0 if u.tied else w * u.root_head
    hg = fresh * hg_new
    return {
        "forward": root + kept_but_head + head_fw,
        "forward (last block)": root + kept_but_head - (w * u.layer if keep else 0.0) + (1 + ag) * w * u.layer,
        # the root reshards after its forward (the loss runs outside it) unless every unit stays gathered
        "loss forward": kept,
        "loss backward": kept,
        "head backward": root + kept_but_head + 2 * w * u.head + hg_new + (0.0 if keep else ag * w * u.layer),
        "head backward (reduce)": root
        + (kept_but_head if keep else ag * w * u.layer)
        + w * u.head
        + hg
        + 4 * u.head * (1 + 1 / d),
        "head backward (norm)": root + (kept_but_head if keep else ag * w * u.layer) + 4 * u.head + hg,
        "layer backward": root + layer_bw + fresh * w * u.w2 + 4 * u.head + hg,
        "layer backward (second)": root + second_bw + fresh * w * u.w2 + 4 * u.layer + hg,
        # at the end of a layer's backward every gradient of it exists, the next layer is still prefetched
        "layer backward (end)": root + layer_bw + fresh * w * u.layer + 4 * u.head + hg,
        "layer backward (end, second)": root + second_bw + fresh * w * u.layer + 4 * u.layer + hg,
        # its gradient computed with its weights gathered and the first layer's reduce-scatter input held; or
        # its own reduce-scatter, its weights resharded
        "end of backward": root + other + (1 + fresh) * w * first + 4 * u.layer,
        "end of backward (reduce)": root + other + fresh * w * first + 4 * first * (1 + 1 / d),
        "optimizer step": 0.0,
    }


def _pending_tied_grad(moment: str, u: Units, w: float) -> float:
    """A tied weight's gradient from the head's backward waits in autograd's input buffer (like an activation's
    gradient, not in `.grad`) until the embedding's backward adds its own; only the sum reaches `.grad`."""
    if not u.tied or moment.startswith(("forward", "loss", "optimizer")) or moment == "end of backward (reduce)":
        return 0.0
    return w * u.root_head


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
    out.update(
        {
            "head backward": gathered + (w * u.head if fresh else 0.0),
            "layer backward": gathered + (w * u.w2 if fresh else 0.0),
            "layer backward (second)": gathered + (w * u.w2 if fresh else 0.0),
            "layer backward (end)": gathered + (w * u.layer if fresh else 0.0),
            "layer backward (end, second)": gathered + (w * u.layer if fresh else 0.0),
            "end of backward (reduce)": gathered + 4 * unit * (1 + 1 / fsdp_group(lay)),
            "optimizer step": 0.0,
        }
    )
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
    done = {
        "head backward (norm)": u.head,
        "layer backward": u.head,
        "layer backward (second)": u.head + u.layer,
        "layer backward (end)": u.head,
        "layer backward (end, second)": u.head + u.layer,
        # the embedding's backward, then its reduce-scatter; the root's comes last
        "end of backward": n - u.emb - u.root,
        "end of backward (reduce)": n - u.emb - u.root,
        "optimizer step": n,
    }
    return g * done.get(moment, 0.0) / n


def _once_per_step_grads(moment: str, g: float, n: float, u: Units, lay: Layout) -> float:
    """Reducing once per step (`strategies.reduces_once_per_step`): every unit's unsharded fp32 gradient is
    alive from the step's first micro-batch until that unit's reduce-scatter in the last one, when its sharded
    gradient replaces it. The last micro-batch is the peak: it holds all of them from its forward on."""
    one = replace(lay, grad_accum=1)
    return 4 * n - _grads_at(moment, 4 * n, n, u, one) + _grads_at(moment, g, n, u, one)


def model_parallel(lay: Layout) -> bool:
    """Tensor or pipeline parallel: the runtime's DeviceMesh engine, FSDP2 for every torch strategy."""
    return lay.tp > 1 or lay.pp > 1


def timeline(
    shape: ModelShape | None, arch: str, n: float, seq: int, lay: Layout, part: Part | None = None, is_gpu: bool = True
) -> dict[str, dict[str, float]]:
    """moment -> term -> bytes per GPU, for `n` parameters on this rank (`rank_params`); `part` is what the
    rank holds (default: the first pipeline rank, or the whole model)."""
    part = part if part is not None else pipeline_parts(shape, lay)[0]
    st = states(n, lay)
    sp = lay.spec
    fsdp = sp.family is Family.TORCH and (sp.sharded or model_parallel(lay))
    piped = fsdp and lay.pp > 1
    once = fsdp and lay.reduces_once_per_step
    w = 2 if lay.precision in ("bf16", "fp16") else 4  # param_dtype, 16-bit weights, autocast copies
    u = units(shape, arch, n, lay, part)
    acts = _activations(shape, arch, seq, lay, w, part)
    if piped:
        buffers = _pipeline_buffers(u, n, lay, w)
    elif fsdp:
        buffers = _fsdp_buffers(u, n, lay, w, once)
    elif not sp.sharded:
        buffers = _ddp_buffers(shape, u, n, lay, w)
    else:
        buffers = dict.fromkeys((*MOMENTS, *VARIANTS), deepspeed_buffers(u, lay, w, is_gpu))
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
            "grads": (
                _pipeline_grads(m, st.grads, n, u, lay, part)
                if piped
                else _once_per_step_grads(m, st.grads, n, u, lay)
                if once
                else _grads_at(m, st.grads, n, u, lay)
                if fsdp
                else st.grads
            )
            + (st.step_grads if m == "optimizer step" else 0.0),
            "optimizer": st.optimizer + (st.step_temp if m == "optimizer step" else 0.0),
            "activations": acts.layers if acts.during_step(m) else 0.0,
            "backward": acts.backward.get(m, 0.0) + (_pending_tied_grad(m, u, w) if fsdp and not piped else 0.0),
            "loss": acts.loss.get(m, 0.0) + acts.tokens,
            "buffers": buffers[m],
        }
    variants = VARIANTS
    if once:
        # The end of the first micro-batch's backward: every unit's gradient kept unsharded but the last unit's
        # (the embedding's, or the root's), whose new gradient is a buffer until its post-backward; and no
        # reduce-scatter input (nothing is reduced until the last micro-batch).
        one = replace(lay, grad_accum=1)
        new = w * (u.emb or u.root) if w >= 4 else 0.0  # in 16-bit, counted as new in any micro-batch
        rows["end of backward (first micro-batch)"] = {
            **rows["end of backward"],
            "grads": _grads_at("end of backward", 4 * n, n, u, one),
            "buffers": buffers["end of backward"] - 4 * u.layer + new,
        }
        variants = {**VARIANTS, "end of backward (first micro-batch)": "end of backward"}
    if piped and acts.one:
        # A micro-batch's backward ends with the first stage's embedding (or a stage's first block) while the
        # other micro-batches in flight keep their activations: the step's "end of backward" is not the only one.
        rows["end of backward (micro-batch)"] = {
            **rows["end of backward"],
            "grads": _pipeline_grads("layer backward", st.grads, n, u, lay, part),
            "activations": acts.layers - acts.one,
            "buffers": buffers["layer backward"] + (w * u.emb if w < 4 else 0.0) - (w * u.w2 if w < 4 else 0.0),
        }
        variants = {**VARIANTS, "end of backward (micro-batch)": "end of backward"}
    for variant, moment in variants.items():
        if sum(rows[variant].values()) > sum(rows[moment].values()):
            rows[moment] = rows[variant]
        del rows[variant]
    return rows


class _Acts(msgspec.Struct, frozen=True):
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
    per = act.activation_bytes_per_layer(shape, arch, seq, b, t, spar, lay.activation_checkpointing, e, cast, autocast)
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
    loss = (
        {
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
        }
        if part.head
        else {}
    )
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


def deepspeed_buffers(u: Units, lay: Layout, w: float, is_gpu: bool = True) -> float:
    """DeepSpeed's buffers as rendered (DeepSpeed cannot be traced: its own estimate, not derived from a trace).
    Its reduce bucket is allocated whole, reduce_bucket_size elements of the gradients' dtype: ZeRO-1/2 twice
    with overlap_comm (`setup_buckets` in `stage_1_and_2.py`), ZeRO-3 once (`stage3.py`); the all-gather bucket
    only chunks a collective. ZeRO-3 adds the largest unit gathered twice plus its fp32 gradient. With ZeRO-1/2
    optimizer offload, DeepSpeed also keeps a 16-bit staging buffer of the largest parameter's size on the GPU
    for the gradients it copies to the host (`temp_grad_buffer_for_gpu_offload`)."""
    if "params" not in lay.spec.shards:  # ZeRO-1/2
        staging = w * max(u.emb, u.head, u.root, u.w2) if lay.offload in ("optimizer", "params") else 0.0
        return DS_REDUCE_BUCKET * w * (2 if overlaps_comm(is_gpu) else 1) + staging
    return DS_REDUCE_BUCKET * w + zero3_gathered(u, w)


def zero3_gathered(u: Units, w: float) -> float:
    """ZeRO-3's largest unit, in use and prefetched (2 x w bytes a parameter), with its fp32 gradient."""
    unit = max(u.layer, u.emb, u.head, u.root)
    return 2 * unit * w + unit * 4
