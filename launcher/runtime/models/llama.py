"""A Llama-family decoder in plain torch, built from `recipe.model.shape()`.

Plain modules (one `TransformerBlock` per layer) so that FSDP2 can shard per block and activation
checkpointing can wrap a block or just the SwiGLU tail. The parameter set is exactly what
`launcher.plan.params.count_params` counts, so the planner's memory figures describe this model.
"""

from __future__ import annotations

import math
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...catalog import ModelShape
from . import init

AC_MODES = ("none", "selective", "full")
INIT_STD = 0.02


class _ZeroParam(Protocol):
    """What DeepSpeed's zero.Init (ZeRO-3) adds to each parameter: this rank's flat partition, and the whole
    parameter's element count and shape."""

    ds_tensor: torch.Tensor
    ds_numel: int
    ds_shape: torch.Size


def init_std(name: str, layers: int) -> float | None:
    """The initial standard deviation of parameter `name` (None: a norm's weight, all ones). GPT-2/Llama practice:
    residual projections scaled down by depth so that the residual stream stays O(1)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        return INIT_STD / math.sqrt(2 * layers)
    return INIT_STD


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32: bf16 squares lose too much precision for the mean.
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return y.type_as(x) * weight


class RMSNorm(nn.Module):
    """RMSNorm that keeps only its input for backward, not the fp32 intermediates.

    Autograd on `_rms_norm` would save the fp32 upcast of the input (4 bytes per element) and the normalised
    value beside the input it already keeps alive: 8 bytes per element per norm in 16-bit training. Recomputing
    the few elementwise ops in backward (a checkpoint around the norm alone) keeps only the 16-bit input and
    gives the same gradients, since backward replays the same ops on the same values.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return checkpoint(_rms_norm, x, self.weight, self.eps, use_reentrant=False, preserve_rng_state=False)
        return _rms_norm(x, self.weight, self.eps)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotary angles, (seq, head_dim/2), always fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) as Meta's reference does; x is (batch, seq, heads, head_dim)."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf.unbind(-1)
    c = cos.narrow(0, 0, x.shape[1]).view(1, x.shape[1], 1, -1)
    s = sin.narrow(0, 0, x.shape[1]).view(1, x.shape[1], 1, -1)
    out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        if s.hidden % s.heads or s.heads % s.kv_heads:
            raise ValueError(f"hidden {s.hidden} must divide by heads {s.heads}, and heads by kv_heads {s.kv_heads}")
        self.heads, self.kv_heads = s.heads, s.kv_heads
        self.head_dim = s.hidden // s.heads
        self.wq = nn.Linear(s.hidden, s.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(s.hidden, s.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(s.hidden, s.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(s.heads * self.head_dim, s.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads/tp query and kv_heads/tp kv heads
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        gqa = self.kv_heads != self.heads
        if gqa and q.dtype == torch.float32:
            # fp32 has no flash kernel, and the memory-efficient kernel is built without GQA: SDPA would fall back
            # to the math kernel, which keeps every b x heads x t x t score (8.6 GB per layer at 8K). Expanded to
            # the query heads, k and v run through the memory-efficient kernel (the planner counts them at that
            # width in fp32: launcher.plan.activations).
            k, v = (z.repeat_interleave(self.heads // self.kv_heads, dim=1) for z in (k, v))
            gqa = False
        # Otherwise GQA inside the kernel (each kv head serves heads/kv_heads query heads): autograd keeps k and v
        # at kv_heads, where expanding them first would save heads-sized copies.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


def _swiglu_down(w2: nn.Linear, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return w2(F.silu(a) * b)


class FeedForward(nn.Module):
    """SwiGLU. `selective` recomputes w2(silu(w1 x) * w3 x) from the saved (w1 x, w3 x) in backward."""

    def __init__(self, s: ModelShape):
        super().__init__()
        self.w1 = nn.Linear(s.hidden, s.ffn_hidden, bias=False)
        self.w2 = nn.Linear(s.ffn_hidden, s.hidden, bias=False)
        self.w3 = nn.Linear(s.hidden, s.ffn_hidden, bias=False)
        self.recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w1(x), self.w3(x)
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(_swiglu_down, self.w2, a, b, use_reentrant=False)
        return _swiglu_down(self.w2, a, b)


class TransformerBlock(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.attention_norm = RMSNorm(s.hidden, s.norm_eps)
        self.attention = Attention(s)
        self.ffn_norm = RMSNorm(s.hidden, s.norm_eps)
        self.feed_forward = FeedForward(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    # A pipeline stage (`stage`) holds the embedding only when first, the norm and the head only when last.
    tok_embeddings: nn.Embedding | None
    layers: nn.ModuleList | nn.ModuleDict
    norm: RMSNorm | None
    output: nn.Linear | None
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, shape: ModelShape, activation_checkpointing: str = "none"):
        super().__init__()
        if activation_checkpointing not in AC_MODES:
            raise ValueError(f"activation_checkpointing must be one of {AC_MODES}, got {activation_checkpointing!r}")
        self.shape = shape
        self.init_seed = 0  # init_weights draws from it (launcher.runtime.models.init); build_model sets it
        self.tok_embeddings = embeddings = nn.Embedding(shape.vocab, shape.hidden)
        blocks = [TransformerBlock(shape) for _ in range(shape.layers)]
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(shape.hidden, shape.norm_eps)
        self.output = output = nn.Linear(shape.hidden, shape.vocab, bias=False)
        if shape.tied_embeddings:
            output.weight = embeddings.weight
        self.full_checkpoint = activation_checkpointing == "full"
        for block in blocks:
            block.feed_forward.recompute = activation_checkpointing == "selective"
        # Rotary tables are derived data, not state: non-persistent so checkpoints hold parameters only.
        cos, sin = rope_tables(shape.hidden // shape.heads, shape.seq_len, shape.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def stage(cls, whole: Llama, first: bool, layer_ids: list[int], last: bool) -> Llama:
        """A part of `whole` for pipeline parallelism, sharing its modules (nothing is copied): the embedding
        when `first`, the blocks `layer_ids` (under their index in the whole model, so parameter names stay
        those of the whole model), the final norm and the head when `last`."""
        blocks = whole.blocks()
        part = cls.__new__(cls)
        nn.Module.__init__(part)
        part.shape, part.full_checkpoint, part.init_seed = whole.shape, whole.full_checkpoint, whole.init_seed
        part.tok_embeddings = whole.tok_embeddings if first else None
        part.layers = nn.ModuleDict({str(i): blocks[i] for i in layer_ids})
        part.norm = whole.norm if last else None
        part.output = whole.output if last else None
        part.register_buffer("rope_cos", whole.rope_cos, persistent=False)
        part.register_buffer("rope_sin", whole.rope_sin, persistent=False)
        return part

    @torch.no_grad()
    def init_weights(self, buffer_device: str | torch.device | None = None) -> None:
        """Initialise in place; also the second half of meta-device construction (after `to_empty`).

        Each parameter's values depend only on (init_seed, its name in the whole model, its shape), whether it
        is whole or this rank's shard (`models.init`), so every layout starts from the same weights.
        `buffer_device`: where the rotary tables go; with FSDP2's CPU offload the parameters are materialised
        on the host but forward runs on the GPU, so the tables must be made there (torchtitan's buffer_device).
        """
        self._make_rope(buffer_device if buffer_device is not None else self.rope_cos.device)
        for name, p in self.named_parameters():
            std = init_std(name, self.shape.layers)
            if std is None:
                nn.init.ones_(p)
            else:
                init.normal_(p, std, seed=self.init_seed, name=name)

    @torch.no_grad()
    def init_partitions(self, rank: int, buffer_device: str | torch.device) -> None:
        """`init_weights` for a model built under DeepSpeed's zero.Init (ZeRO-3): each rank fills only its own
        partition of each parameter (`ds_tensor`, a flat slice of ds_numel / world elements), with exactly the
        values `init_weights` gives the whole parameter; nothing is gathered."""
        self._make_rope(buffer_device)
        for name, param in self.named_parameters():
            p = cast(_ZeroParam, param)
            part = p.ds_tensor.view(-1)
            start = rank * part.numel()
            count = max(0, min(part.numel(), p.ds_numel - start))
            std = init_std(name, self.shape.layers)
            if std is None:
                part[:count].fill_(1.0)
            else:
                init.normal_flat_(part[:count], start, tuple(p.ds_shape), std, seed=self.init_seed, name=name)

    def _make_rope(self, device: str | torch.device) -> None:
        cos, sin = rope_tables(
            self.shape.hidden // self.shape.heads,
            self.shape.seq_len,
            self.shape.rope_theta,
            device=torch.device(device),
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks in order: a ModuleList, or a pipeline stage's ModuleDict keyed by each block's
        index in the whole model (so that parameter names, and checkpoints, are the same in every layout)."""
        return list(self.layers.values()) if isinstance(self.layers, nn.ModuleDict) else list(self.layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage (launcher.runtime.engines.pipeline) holds a part of the model: only the first has the
        # embedding and reads token ids, the others read the residual stream; only the last has the head.
        if self.tok_embeddings is not None:
            if tokens.shape[1] > self.shape.seq_len:
                raise ValueError(
                    f"sequence of {tokens.shape[1]} tokens exceeds the model's seq_len {self.shape.seq_len}"
                )
            h = self.tok_embeddings(tokens)
        else:
            h = tokens
        cos, sin = self.rope_cos, self.rope_sin
        for layer in self.blocks():
            if self.full_checkpoint and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        if self.output is None:
            return h
        assert self.norm is not None  # the last stage has both
        return self.output(self.norm(h))


def build_model(
    shape: ModelShape, activation_checkpointing: str = "none", device: str | torch.device = "cpu", seed: int = 0
) -> Llama:
    """Build on `device`; "meta" allocates nothing (materialised by the strategy after sharding, then
    `init_weights`). The initial weights depend on `seed` and the shape only: the same for an eager build and
    a meta one materialised shard by shard, in any layout."""
    with torch.device("meta"):
        model = Llama(shape, activation_checkpointing)
    model.init_seed = seed
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model
