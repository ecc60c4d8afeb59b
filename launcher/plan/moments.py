"""The per-GPU memory of one training step, moment by moment, for the runtime as it is.

A step's memory does not peak everywhere at once: activations are largest at the end of forward, the loss's
temporaries exist only around the loss, FSDP's gathered weights and reduce-scatter buffers only around one
unit, the optimizer's temporaries only in its step. So each moment below lists what is alive then, and the
plan's figure is the largest moment, not a sum of maxima that never coincide.

Moments, in step order (`launcher.trace` finds the same ones in the tracker's timeline):
- forward: the head's forward, the last FSDP unit of forward: every layer's activations, the logits, and the
  head's weights all-gathered (FSDP2 keeps a unit's all-gather buffer until the next unit's copy-out, so 2x);
- loss forward: the logits plus one fp32 chunk of the loss;
- loss backward: the logits, their gradient and one fp32 chunk, on top of every layer's activations;
- head backward: the logits' gradient, the head's gathered weights and its unsharded weight gradient, the
  last layer's weights prefetched;
- layer backward: the first layer in backward at its peak (`activations.layer_in_backward`), its gathered
  weights, the next layer prefetched, and the head's fp32 reduce-scatter input (FSDP2 keeps one until the next
  unit's post-backward); later layers hold fewer activations and a smaller reduce-scatter buffer;
- end of backward: the embedding's unsharded gradient and its fp32 reduce-scatter input;
- optimizer step: the states plus AdamW's foreach temporary (sqrt of the second moment, 4 bytes per param).

FSDP2 facts used (torch.distributed.fsdp, `fully_shard` with MixedPrecisionPolicy(param_dtype, fp32 reduce)):
weights are all-gathered per unit in param_dtype; gradients are produced unsharded in param_dtype and copied
into an fp32 reduce-scatter input of the unit's size; sharded fp32 gradients accumulate across micro-steps
because the runtime reduce-scatters on every micro-step. Units are `runtime.parallel.fsdp_units`: the token
embedding, each block, the output head, and the root with the final norm.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..catalog import ModelShape
from ..deepspeed_config import DS_ALLGATHER_BUCKET, DS_REDUCE_BUCKET
from ..strategies import Family
from . import activations as act
from .layout import Layout
from .params import embedding_params, layer_params

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
    step_temp: float  # extra during the optimizer step


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
        o = 0.0  # ZeRO-Offload / FSDP2 CPUOffloadPolicy keep optimizer state in host memory
    if lay.offload == "params":
        if sp.family is Family.DEEPSPEED:
            p = 0.0  # ZeRO-Infinity offload_param: only gathered layers live on the GPU (in buffers)
        else:
            p, g = 0.0, 0.0  # FSDP2 CPUOffloadPolicy moves sharded params and grads to the host
    return p, g, o


def states(n: float, lay: Layout) -> States:
    p, g, o = model_states(n, lay)
    # torch AdamW with foreach (its CUDA default) allocates sqrt(exp_avg_sq) for every parameter at once.
    temp = 4 * n / (lay.shard_group if "optimizer" in lay.spec.shards else 1) if lay.optimizer == "adamw" else 0.0
    if lay.spec.family is Family.DEEPSPEED or o == 0:
        temp = 0.0  # DeepSpeed steps its own flat fp32 partitions (fused); offloaded states step on the host
    return States(p, g, o, temp)


@dataclass(frozen=True)
class Units:
    """Parameter counts of the FSDP units (per model-parallel shard): embedding, one block, head, root; and
    the block's down projection w2, whose gradient is the one alive at the block's backward peak."""

    emb: float
    layer: float
    head: float
    root: float
    w2: float


def units(shape: ModelShape | None, arch: str, n: float, lay: Layout) -> Units:
    t = lay.tp
    if shape is None:  # a params-only model: a typical block is ~1/40 of it, w2 ~1/3 of a block
        return Units(0.0, n / 40, 0.0, 0.0, n / 120)
    vh = shape.vocab * shape.hidden / t
    layer = layer_params(shape, arch) / t
    w2 = shape.hidden * (shape.ffn_hidden if arch != "gpt" else 4 * shape.hidden) / t
    if shape.tied_embeddings or arch == "gpt":  # tied (or GPT's extra tables): embedding and head in the root
        return Units(0.0, layer, 0.0, embedding_params(shape, arch) / t, w2)
    return Units(vh, layer, vh, shape.hidden, w2)


def _fsdp_buffers(u: Units, n: float, lay: Layout, w: float) -> dict[str, float]:
    """FSDP2's gathered weights, unsharded gradients and reduce-scatter inputs alive at each moment.

    w = param_dtype bytes; a reduce-scatter input is fp32 (reduce_dtype), 4 bytes per parameter, and its
    output 4/d. reshard_after_forward=False (fsdp_grad_op) keeps every unit gathered from its forward to its
    backward. SwiGLU's backward peak comes right after w2's backward: of the block's gradients only w2's exists
    then. "layer backward" is the first layer in backward (it holds the head's reduce-scatter input), "second
    layer backward" the next one (it holds a layer's, larger than the head's for a small vocabulary).
    """
    keep = lay.spec.reshard_after_forward is False
    root = w * u.root  # gathered from the start of forward to the end of backward (the final norm: tiny)
    kept = w * n if keep else 0.0
    gathered_layers = (kept - w * u.head) if keep else 2 * w * u.layer  # current + prefetched, or all kept
    return {
        "forward": root + (kept if keep else w * u.head) + w * u.head,
        "loss forward": root + kept,
        "loss backward": root + kept,
        "head backward": root + (kept if keep else w * u.head + w * u.layer) + w * u.head,
        "layer backward": root + gathered_layers + w * u.w2 + 4 * u.head,
        "second layer backward": root + gathered_layers + w * u.w2 + 4 * u.layer,
        "end of backward": _first_unit_backward(u, lay, w)[0],
        "end of backward (reduce)": _first_unit_backward(u, lay, w)[1],
        "optimizer step": 0.0,
    }


def _first_unit_backward(u: Units, lay: Layout, w: float) -> tuple[float, float]:
    """The last unit in backward (the embedding; the root when tied), at its two candidate peaks: (while its
    gradient is computed, with its weights gathered, plus at the copy-out the all-gather buffer of the same
    size, and the first layer's reduce-scatter input still held; at its own reduce-scatter, its weights
    resharded and its gradient copied into an fp32 input, 4/d more for the output)."""
    first, other = (u.emb, w * u.root) if u.emb else (u.root, 0.0)
    computing = 2 * w * first + 4 * u.layer
    reducing = w * first + 4 * first * (1 + 1 / lay.shard_group)
    return other + computing, other + reducing


def _grads_at(moment: str, g: float, n: float, u: Units, lay: Layout) -> float:
    """Sharded gradients alive: all of them from the second micro-step on (they accumulate across micro-steps);
    with one micro-step, only those of the units already reduce-scattered in this backward."""
    if lay.grad_accum > 1 or g == 0 or not n:
        return g
    done = {"layer backward": u.head, "second layer backward": u.head + u.layer, "end of backward": n - u.emb,
            "optimizer step": n}.get(moment, 0.0)
    return g * done / n


def timeline(shape: ModelShape | None, arch: str, n: float, seq: int, lay: Layout) -> dict[str, dict[str, float]]:
    """moment -> term -> bytes per GPU, for `n` parameters per model-parallel shard."""
    st = states(n, lay)
    sp = lay.spec
    fsdp = sp.family is Family.TORCH and sp.sharded
    w = 2 if lay.precision in ("bf16", "fp16") else 4  # param_dtype, 16-bit weights, autocast copies
    e = w  # activations: the compute dtype
    u = units(shape, arch, n, lay)
    layers, in_bw, per, loss = _activations(shape, arch, seq, lay, e)
    grad_h0 = e * seq * lay.micro_batch * shape.hidden / lay.tp if shape is not None else 0.0
    buffers = _fsdp_buffers(u, n, lay, w) if fsdp else {m: _other_buffers(u, n, lay, w) for m in MOMENTS}
    buffers["optimizer step"] = 0.0
    out = {}
    for m in (*MOMENTS, "second layer backward", "end of backward (reduce)"):
        out[m] = {
            "params": st.params,
            "grads": _grads_at(m, st.grads, n, u, lay) if fsdp else st.grads,
            "optimizer": st.optimizer + (st.step_temp if m == "optimizer step" else 0.0),
            "activations": 0.0 if m.startswith(("end of backward", "optimizer step")) else layers,
            "backward": in_bw if m.endswith("layer backward") else 0.0,
            "loss": loss.get(m, 0.0),
            "buffers": buffers.get(m, buffers["layer backward"]),
        }
    # Two moments have two candidate peaks; keep the larger of each.
    second = out.pop("second layer backward")
    second["backward"] -= per  # the first layer in backward has freed its activations
    if sum(second.values()) > sum(out["layer backward"].values()):
        out["layer backward"] = second
    reduce = out.pop("end of backward (reduce)")
    out["end of backward"]["backward"] = grad_h0  # the embedding's output gradient, while its own is computed
    if fsdp and sum(reduce.values()) > sum(out["end of backward"].values()):
        out["end of backward"] = reduce
    return out


def _activations(shape: ModelShape | None, arch: str, seq: int, lay: Layout, e: int):
    """(all layers' saved activations, what the layer in backward adds, one layer's, loss terms by moment)."""
    if shape is None:
        return 0.0, 0.0, 0.0, {}
    b, t, spar = lay.micro_batch, lay.tp, lay.sequence_parallel
    layers_here = math.ceil(shape.layers / lay.pp)
    in_flight = min(lay.pp, max(lay.grad_accum, 1)) if lay.pp > 1 else 1  # 1F1B: [MLM3] sec. 4.2.3
    cast = lay.spec.family is Family.TORCH and lay.spec.sharded  # FSDP2 casts each block's inputs
    per = act.activation_bytes_per_layer(shape, arch, seq, b, t, spar, lay.activation_checkpointing, e, cast)
    in_bw = act.layer_in_backward(shape, arch, seq, b, t, spar, e, cast) - per
    head = act.head_bytes(shape, seq, b, t, e)
    logits = act.logits_bytes(shape, seq, b, t, e)
    grad_h = e * seq * b * shape.hidden / t  # the gradient of the final norm's output, in the head's backward
    loss = {"forward": head + logits, "loss forward": head + act.loss_forward(shape, seq, b, t, e),
            "loss backward": head + act.loss_backward(shape, seq, b, t, e), "head backward": head + logits + grad_h}
    return per * layers_here * in_flight, in_bw, per * in_flight, loss


def _other_buffers(u: Units, n: float, lay: Layout, w: float) -> float:
    """DDP and DeepSpeed: DDP's buckets are its gradients (gradient_as_bucket_view), so nothing extra but the
    autocast 16-bit weight copies (kept by autograd from forward to backward); DeepSpeed's reduce/all-gather
    buckets as rendered, and for ZeRO-3 the largest unit gathered twice plus its fp32 gradient."""
    sp = lay.spec
    if not sp.sharded:
        return w * n if lay.precision in ("bf16", "fp16") else 0.0
    if "params" not in sp.shards:  # ZeRO-1/2
        return (DS_REDUCE_BUCKET + DS_ALLGATHER_BUCKET) * w
    unit = max(u.layer, u.emb, u.head, u.root)
    return 2 * unit * w + unit * 4
