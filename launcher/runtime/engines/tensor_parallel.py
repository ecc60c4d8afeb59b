"""Tensor (and sequence) parallelism of the Llama blocks with DTensor, as torchtitan applies it.

Inside a block, q/k/v and the SwiGLU's w1/w3 are split column-wise (each rank computes heads/tp heads and
ffn_hidden/tp of the SwiGLU), o and w2 row-wise (partial sums, reduced once per sub-layer). The embedding is
split row-wise (over the vocabulary) and the output head column-wise, its logits left sharded over the
vocabulary for the vocabulary-parallel loss (`launcher.runtime.loss`): no rank ever holds all the logits.

Without sequence parallelism the residual stream and the norms are replicated on every rank of the group
(the norms' weights become replicated DTensors, so that every parameter lives on the same mesh and one
gradient norm covers them all). With it, the residual stream between sub-layers is split over the sequence:
the norms run on a rank's slice of the tokens, the slice is all-gathered before q/k/v (or w1/w3), and the
row-wise outputs are reduce-scattered back to slices instead of all-reduced.

Every parameter keeps its name, so a checkpoint written under one layout loads under any other.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..failures import ConfigError


def _replicated_norm():
    """A norm on the whole (replicated) residual stream: its weight becomes a replicated DTensor; plain tensors
    in, plain tensors out."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class ReplicatedNorm(ParallelStyle):
        def _apply(self, module, mesh):
            def params(name, mod, mesh):
                for p_name, p in list(mod.named_parameters(recurse=False)):
                    mod.register_parameter(
                        p_name, nn.Parameter(DTensor.from_local(p, mesh, [Replicate()], run_check=False))
                    )

            def inputs(mod, args, mesh):
                return tuple(
                    DTensor.from_local(a, mesh, [Replicate()], run_check=False) if not isinstance(a, DTensor) else a
                    for a in args
                )

            def outputs(mod, out, mesh):
                return out.to_local() if isinstance(out, DTensor) else out

            return distribute_module(module, mesh, params, inputs, outputs)

    return ReplicatedNorm()


def llama_plan(model, sequence_parallel: bool) -> tuple[dict, dict]:
    """(root plan, block plan) for dtlaunch's Llama (or a pipeline stage of it: absent modules are skipped)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()  # the residual stream between sub-layers
    norm = SequenceParallel if sp else _replicated_norm
    root: dict = {}
    if model.tok_embeddings is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.norm is not None:
        root["norm"] = norm()
    if model.output is not None:
        # use_local_output=False: the loss sees a DTensor sharded over the vocabulary and computes in parallel
        root["output"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
    block = {
        "attention_norm": norm(),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=stream),
        "ffn_norm": norm(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        "feed_forward.w3": ColwiseParallel(),
    }
    if sp:  # the slice of the sequence is all-gathered once per sub-layer, before its column-wise projections
        block["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )
        block["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return root, block


def hf_plan(model, sequence_parallel: bool) -> tuple[dict, dict]:
    """(root plan, block plan) for a Hugging Face Llama/Mistral/Qwen2 decoder (launcher.runtime.models.hf)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if sequence_parallel:
        raise ConfigError(
            "sequence parallelism is not available for Hugging Face models: transformers derives "
            "the rotary positions and the causal mask from the length of the tensor a block gets, "
            "which sequence parallelism splits",
            fix="set parallelism.sequence_parallel: false (tensor parallelism alone works)",
        )
    if model.shape.tied_embeddings:
        raise ConfigError(
            "tensor parallelism of a Hugging Face model with tied input and output embeddings is not "
            "supported: the embedding and the head would be split as two tensors",
            fix="use parallelism.tensor: 1 for this model (FSDP shards it instead)",
        )
    block = getattr(model.layers[0], "self_attn", None), getattr(model.layers[0], "mlp", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    if any(m is None or not all(hasattr(m, n) for n in ns) for m, ns in zip(block, names, strict=True)):
        raise ConfigError(
            f"{type(model.hf).__name__} does not have the Llama module names tensor parallelism "
            "splits (self_attn.q/k/v/o_proj, mlp.gate/up/down_proj)",
            fix="use parallelism.tensor: 1 for this model",
        )
    root = {
        "hf.model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "hf.model.norm": _replicated_norm(),
        "hf.lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    plan = {
        "input_layernorm": _replicated_norm(),
        "post_attention_layernorm": _replicated_norm(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    plan.update({f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
    plan.update({f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
    return root, plan


def check_divisible(shape, tp: int, sequence_parallel: bool, seq_len: int) -> None:
    """What tensor parallelism needs of the shape, said before any tensor is split."""
    bad = [
        f"{name} {v}"
        for name, v in (
            ("heads", shape.heads),
            ("kv_heads", shape.kv_heads),
            ("ffn_hidden", shape.ffn_hidden),
            ("vocab", shape.vocab),
        )
        if v % tp
    ]
    if sequence_parallel and seq_len % tp:
        bad.append(f"seq_len {seq_len} (sequence parallelism splits it)")
    if bad:
        raise ConfigError(
            f"tensor parallelism {tp} does not divide {', '.join(bad)}",
            fix="use a tensor degree that divides them all (often 8, 4 or 2)",
        )


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Split `model` (dtlaunch's Llama, a pipeline stage of it, or an HF decoder) over `tp_mesh`, in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    from ..models.hf import HFCausalLM

    if isinstance(model, HFCausalLM):
        root, block = hf_plan(model, sequence_parallel)
        blocks = list(model.layers)
    elif all(hasattr(model, a) for a in ("tok_embeddings", "layers", "norm", "output", "blocks")):
        root, block = llama_plan(model, sequence_parallel)
        llama: Any = model  # dtlaunch's Llama: the attributes checked above
        blocks = llama.blocks()
    else:
        raise ConfigError(
            f"tensor parallelism needs to know the module names of {type(model).__name__}; it splits "
            "dtlaunch's Llama and Hugging Face Llama-family decoders only",
            fix="set parallelism.tensor: 1 (and pipeline: 1) for your own model",
        )
    if root:
        parallelize_module(model, tp_mesh, root)
    for b in blocks:
        parallelize_module(b, tp_mesh, block)
