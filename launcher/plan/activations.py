"""Activation memory of one micro-batch: what each layer saves for backward, what its backward adds, and
what the output head and the loss hold. Bytes, per GPU. Pure arithmetic.

Notation: s sequence, b micro-batch, h hidden, f SwiGLU width, a heads, g kv heads, V vocabulary, t tensor
parallel degree, e bytes of an activation (2 in bf16/fp16, 4 in fp32).

The Llama terms are derived from `launcher.runtime.models.llama` and `launcher.runtime.loss` as they are, op
by op (which tensors autograd keeps, and when each is freed), and checked against PyTorch's memory tracker on
fake tensors by `dtlaunch plan --trace` and tests/test_trace.py. GPT terms are [MLM3] Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", sec. 4, Table 2.
"""

from __future__ import annotations

from ..catalog import ModelShape

# launcher.runtime.loss.CHUNK_BYTES: the loss works on this many bytes of fp32 logits at a time.
LOSS_CHUNK_BYTES = 2**28


def _gpt_layer(shape: ModelShape, s: int, b: int, t: int, sp: bool, ac: str, scale: float) -> float:
    """[MLM3] Table 2 (16-bit activations, 1-byte dropout masks): no parallelism sbh(34 + 5as/h);
    TP sbh(10 + 24/t + 5as/(ht)); TP+SP sbh/t (34 + 5as/h); selective drops the 5as^2b score terms."""
    sbh = s * b * shape.hidden
    scores = 0.0 if ac == "selective" else 5 * shape.heads * s / shape.hidden
    if sp:
        return sbh / t * (34 + scores) * scale
    return sbh * (10 + 24 / t + scores / t) * scale


def kv_width_heads(shape: ModelShape, act_bytes: int) -> int:
    """The heads k and v are kept at for backward: kv_heads (GQA inside the attention kernel), but the query heads
    in fp32, where the runtime expands them so that the memory-efficient kernel runs (it has no GQA; flash has no
    fp32; the math kernel would keep every score)."""
    return shape.heads if act_bytes == 4 else shape.kv_heads


def activation_bytes_per_layer(
    shape: ModelShape,
    arch: str,
    s: int,
    b: int,
    t: int,
    sp: bool,
    ac: str,
    act_bytes: int = 2,
    cast_inputs: bool = True,
    autocast: bool = False,
) -> float:
    """Activations one transformer layer keeps for backward, per GPU, between its forward and its backward.

    Llama block of the runtime (pre-norm RMSNorm, GQA attention through SDPA with `enable_gqa`, SwiGLU):
      each RMSNorm keeps only its input (it recomputes its fp32 work in backward), and its output is kept by
      the projections that read it: 2 norms x (input + output) = 4e sbh;
      attention: SDPA keeps q (e sbh), k and v at kv width (2e sbh g/a; query width in fp32: `kv_width_heads`),
      its output O (e sbh, also what wo keeps) and an fp32 log-sum-exp per head and token (4asb); no s x s
      scores (flash or memory-efficient attention);
      SwiGLU w2(silu(w1 x) * w3 x): w1 x, w3 x, silu(w1 x) and their product, 4e sbf;
      the block's own 16-bit copy of the RoPE tables (FSDP2 casts a block's inputs; `cast_inputs`), e s h/a;
      => e sbh (6 + 2g/a) + 4e sbf + 4asb + e s h/a, divided by t for the tensor-parallel parts (the runtime's
      `tensor_parallel`: heads and the SwiGLU split; norms replicated, and with sequence parallelism only their
      inputs split, since the gathered outputs are what the projections keep).
    selective: the SwiGLU tail is recomputed from (w1 x, w3 x): the two others are dropped, -2e sbf.
    full: the block keeps its input only, e sbh (/t with SP).
    `autocast` (DDP in 16-bit: fp32 weights, torch.autocast): the residual stream stays fp32 (the embedding is
    not autocast), so each norm's input is 4 sbh, and autocast casts the norm's fp32 output once per projection
    that reads it, each copy kept: 3 for q, k, v and 2 for w1, w3: 8 + 5e sbh instead of 4e sbh.
    """
    scale = act_bytes / 2
    e = act_bytes
    res = _residual_bytes(act_bytes, autocast)
    if ac == "full":
        return res * s * b * shape.hidden / (t if sp else 1)
    if arch == "gpt":
        return _gpt_layer(shape, s, b, t, sp, ac, scale)
    h, a, f = shape.hidden, shape.heads, shape.ffn_hidden
    g = kv_width_heads(shape, act_bytes)
    sbh = s * b * h
    # Each norm's input (the residual stream) and its output, read by the projections. With sequence
    # parallelism the input is a rank's slice of the sequence, but DTensor all-gathers the output before the
    # column-wise projections and autograd keeps that gathered copy whole (Megatron re-gathers it in backward
    # instead, hence [MLM3]'s sbh/t): only the inputs shrink.
    replicated = 2 * res * sbh / (t if sp else 1) + (5 if autocast else 2) * e * sbh
    split = e * sbh * (2 + 2 * g / a) + 4 * e * s * b * f + 4 * a * s * b
    if ac == "selective":
        split -= 2 * e * s * b * f
    # FSDP2 casts a block's floating-point inputs to param_dtype (MixedPrecisionPolicy.cast_forward_inputs), so
    # each block gets its own copies of the fp32 RoPE tables, cos and sin (s x head_dim/2 each), kept by the
    # rotation's multiplications (`cast_inputs`). Under full checkpointing they are made inside the recomputed
    # region, and in fp32 there is nothing to cast.
    rope = e * s * h / a if cast_inputs and act_bytes < 4 else 0.0
    return replicated + split / t + rope


def _residual_bytes(act_bytes: int, autocast: bool) -> int:
    """Bytes per element of the residual stream: the compute dtype, or fp32 under autocast."""
    return 4 if autocast else act_bytes


def layer_backward_extra(
    shape: ModelShape, arch: str, s: int, b: int, t: int, sp: bool, act_bytes: int, autocast: bool = False
) -> float:
    """What one layer's backward holds on top of the activations it saved in forward (no checkpointing).

    In the runtime's block the backward peaks in SwiGLU, right after w2's backward: alive are the gradient of
    the block's output (the residual stream's, e sbh, fp32 under autocast), the gradient of the product and the
    two gradients of its factors (3e sbf), while the product itself, w2's saved input, is already freed
    (-e sbf): e sbh + 2e sbf. (Attention's backward holds less: its widest tensors are sbh, not sbf.)
    GPT: the same reasoning on its 4h-wide MLP, e sbh + 2 x 4e sbh, as an estimate.
    """
    e = act_bytes
    f = shape.ffn_hidden if arch != "gpt" else 4 * shape.hidden
    # the residual stream's gradient is split over the tensor-parallel group only with sequence parallelism
    return _residual_bytes(e, autocast) * s * b * shape.hidden / (t if sp else 1) + 2 * e * s * b * f / t


def layer_in_backward(
    shape: ModelShape,
    arch: str,
    s: int,
    b: int,
    t: int,
    sp: bool,
    act_bytes: int,
    cast_inputs: bool = True,
    autocast: bool = False,
) -> float:
    """One layer at its backward's peak, whatever the checkpointing: with `selective` or `full`, backward first
    recomputes what forward did not keep, so the layer holds its no-checkpointing activations, then adds
    `layer_backward_extra`."""
    return activation_bytes_per_layer(
        shape, arch, s, b, t, sp, "none", act_bytes, cast_inputs, autocast
    ) + layer_backward_extra(shape, arch, s, b, t, sp, act_bytes, autocast)


def norm_backward_extra(
    shape: ModelShape, s: int, b: int, t: int, act_bytes: int, autocast: bool = False, sp: bool = False
) -> float:
    """What an RMSNorm's backward holds beyond its input, per element of sbh.

    The runtime recomputes the norm in backward (`_rms_norm` under a checkpoint) and autograd differentiates
    it: the fp32 upcast x.float() (4, kept for backward; none when the input is fp32 already, where it is x
    itself) and five fp32 temporaries of the pow/mean/mul gradient chain alive at once (20): 24 bytes per
    element in 16-bit, 20 in fp32 (and under autocast, whose residual stream is fp32). It matters for the
    final norm, in the head's backward, when the vocabulary is small (V < ~10h), and at the end of a large
    layer's backward.
    """
    per_element = 20 + (4 if _residual_bytes(act_bytes, autocast) < 4 else 0)
    return per_element * s * b * shape.hidden / (t if sp else 1)  # a norm runs on the whole stream unless SP


def head_bytes(
    shape: ModelShape, s: int, b: int, t: int, act_bytes: int, autocast: bool = False, sp: bool = False
) -> float:
    """The final RMSNorm's saved input and its output, kept by the output projection: 2e sbh (under autocast
    an fp32 input and the projection's 16-bit cast of the output). Under tensor parallelism both are whole
    (replicated); with sequence parallelism the input is a slice and the output the gathered copy."""
    return (_residual_bytes(act_bytes, autocast) / (t if sp else 1) + act_bytes) * s * b * shape.hidden


def loss_chunk_bytes(shape: ModelShape, s: int, b: int, t: int) -> float:
    """One fp32 chunk of the loss (launcher.runtime.loss): min(tokens, CHUNK_BYTES / 4V) tokens x V x 4."""
    v = shape.vocab / t
    # max(1, ...): a vocabulary narrower than a quarter column per rank (vocab < tp/4, planned for a user's own
    # entrypoint; validate refuses it for dtlaunch's runtime) fits every token in one chunk.
    rows = min(s * b, max(1, LOSS_CHUNK_BYTES // max(1, int(4 * v))))
    return 4 * rows * v


def logits_bytes(shape: ModelShape, s: int, b: int, t: int, act_bytes: int) -> float:
    """The logits, e sbV (split by t with a vocabulary-parallel head)."""
    return act_bytes * s * b * shape.vocab / t


def loss_forward(shape: ModelShape, s: int, b: int, t: int, act_bytes: int) -> float:
    """The loss's forward: the logits it keeps, an fp32 log-sum-exp per token, and one fp32 chunk."""
    return logits_bytes(shape, s, b, t, act_bytes) + 4 * s * b + loss_chunk_bytes(shape, s, b, t)


def loss_backward(shape: ModelShape, s: int, b: int, t: int, act_bytes: int) -> float:
    """The loss's backward: the saved logits, their gradient (same dtype) and one fp32 chunk (14 bytes per
    token x vocab in bf16 before the loss was chunked; 4 + one chunk now)."""
    return 2 * logits_bytes(shape, s, b, t, act_bytes) + 4 * s * b + loss_chunk_bytes(shape, s, b, t)
