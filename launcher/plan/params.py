"""Exact parameter counts from a model's shape."""

from __future__ import annotations

from ..catalog import ModelShape


def layer_params(s: ModelShape, architecture: str = "llama") -> int:
    """Parameters of one transformer block."""
    head_dim = s.hidden // s.heads
    if architecture == "gpt":
        # GPT-2 style: fused QKV with bias, output proj with bias, 2-matrix GeLU MLP with biases, 2 LayerNorms (w+b).
        attn = 3 * s.hidden * s.hidden + 3 * s.hidden + s.hidden * s.hidden + s.hidden
        mlp = 2 * s.hidden * s.ffn_hidden + s.ffn_hidden + s.hidden
        return attn + mlp + 4 * s.hidden
    # Llama: q, o are h x h; k, v are h x (kv_heads * head_dim); SwiGLU has three h x f matrices; two RMSNorm weights.
    kv = s.kv_heads * head_dim
    attn = 2 * s.hidden * s.hidden + 2 * s.hidden * kv
    attn += (s.hidden + 2 * kv if s.qkv_bias else 0) + (s.hidden if s.out_bias else 0)
    mlp = 3 * s.hidden * s.ffn_hidden + (2 * s.ffn_hidden + s.hidden if s.mlp_bias else 0)
    return attn + mlp + 2 * s.hidden


def layer_params_per_rank(s: ModelShape, t: int = 1) -> float:
    """Parameters of one Llama block on one rank of a tensor-parallel group of t (the runtime's
    `tensor_parallel`): the projections (and column-wise biases) are split t ways; the two norms and the
    row-wise projections' biases are whole on every rank. t = 1 gives `layer_params`."""
    head_dim = s.hidden // s.heads
    kv = s.kv_heads * head_dim
    split = 2 * s.hidden * s.hidden + 2 * s.hidden * kv + 3 * s.hidden * s.ffn_hidden
    split += (s.hidden + 2 * kv if s.qkv_bias else 0) + (2 * s.ffn_hidden if s.mlp_bias else 0)
    whole = 2 * s.hidden + (s.hidden if s.out_bias else 0) + (s.hidden if s.mlp_bias else 0)
    return split / t + whole


def embedding_params(s: ModelShape, architecture: str = "llama") -> int:
    """Token embedding plus output head (once when tied) plus final norm (and GPT's learned positions)."""
    emb = s.vocab * s.hidden
    head = 0 if s.tied_embeddings else s.vocab * s.hidden
    if architecture == "gpt":
        return emb + head + s.seq_len * s.hidden + 2 * s.hidden
    return emb + head + s.hidden


def embedding_units_apart(s: ModelShape, model_parallel: bool = False) -> bool:
    """Whether FSDP2 shards the token embedding and the output head as units of their own (gathered only
    around their own forward and backward) rather than in the root unit (gathered from the start of forward
    to the end of backward). Apart when each table is larger than a block: then a root holding both would be
    the largest gathered unit of the step, which is torchtitan's reason for separate units at a 128k
    vocabulary. When a table is no larger than a block, the root keeps both gathered for less than two
    blocks' weights, and separate units would only add two all-gathers and two reduce-scatters to every
    micro-step (their whole latency where collectives do not overlap compute). Tied tables share one
    parameter and stay in the root. Tensor and pipeline layouts keep them apart (a stage holds only one of
    the two). The runtime (`runtime.engines.mesh.fsdp_units`) and the planner (`plan.moments.units`) both ask."""
    if s.tied_embeddings:
        return False
    return model_parallel or s.vocab * s.hidden > layer_params(s)


def count_params(s: ModelShape, architecture: str = "llama") -> int:
    """Llama 2 7B -> 6,738,415,616; Llama 3 8B -> 8,030,261,248 (matches the released checkpoints)."""
    return s.layers * layer_params(s, architecture) + embedding_params(s, architecture)
