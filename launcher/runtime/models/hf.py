"""Hugging Face decoders (Llama, Mistral, Qwen2) built by `transformers` from the recipe's config, wearing the
few names the rest of the runtime relies on, so every strategy wraps them as it wraps dtlaunch's own Llama:
`layers` (the decoder blocks: FSDP2 units and activation-checkpointing boundaries), `tok_embeddings` and
`output` (their own FSDP2 units), `shape`, `init_weights()` (materialising a model built on the meta device),
and `forward(tokens) -> logits`.

No hub access: the config travels in the plan, the weights (optional) are read from `model.hf_weights`
on the node. `transformers` is imported here only, when such a model is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...catalog import ModelShape
from ..failures import ConfigError


def _recompute(module: nn.Module) -> None:
    """Selective activation checkpointing: keep the module's input, recompute its inside in backward."""
    inner = module.forward

    def forward(*args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    module.forward = forward


class HFCausalLM(nn.Module):
    def __init__(self, config: dict, shape: ModelShape, activation_checkpointing: str = "none"):
        super().__init__()
        try:
            import transformers
        except ImportError as e:
            raise ConfigError(
                f"model.hf needs transformers, which this environment cannot import ({e})",
                fix="pip install 'dtlaunch[hf]' (transformers) in the job's environment",
            ) from None
        cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "transformers_version"})
        cfg.use_cache = False
        self.shape = shape
        self.hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
        body = self.hf.model
        self.layers = body.layers
        self.tok_embeddings = body.embed_tokens
        self.output = self.hf.lm_head
        if activation_checkpointing == "full":
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif activation_checkpointing == "selective":
            for layer in self.layers:
                _recompute(layer.mlp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits

    @torch.no_grad()
    def init_weights(self, buffer_device: str | torch.device | None = None) -> None:
        """After `to_empty`: transformers' own initialisation, and the rotary tables (buffers, not state), made on
        `buffer_device` (where forward runs; the parameters may be on the host, offloaded)."""
        self.hf.apply(self.hf._init_weights)
        rot = getattr(self.hf.model, "rotary_emb", None)
        if rot is not None and hasattr(rot, "rope_init_fn"):
            device = torch.device(buffer_device) if buffer_device is not None else rot.inv_freq.device
            inv_freq, scaling = rot.rope_init_fn(rot.config, device)
            rot.register_buffer("inv_freq", inv_freq, persistent=False)
            if hasattr(rot, "original_inv_freq"):
                rot.original_inv_freq = inv_freq
            rot.attention_scaling = scaling
        self.hf.tie_weights()


def build_hf(
    config: dict, shape: ModelShape, activation_checkpointing: str = "none", device: str = "cpu"
) -> HFCausalLM:
    with torch.device(device):
        return HFCausalLM(config, shape, activation_checkpointing)


# ----------------------------------------------------------------------------- weights


def _weight_files(weights_dir: Path) -> list[Path]:
    index = weights_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [weights_dir / n for n in names]
    files = sorted(weights_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"no *.safetensors weights in {weights_dir} on this node",
            fix="put the weights where model.hf_weights says on every node, or unset it to train from scratch",
        )
    return files


def read_weights(weights_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(weights_dir)):
        out.update(load_file(str(f)))
    return out


def _check_keys(model: HFCausalLM, keys: set[str]) -> None:
    want = set(model.hf.state_dict().keys())
    if model.shape.tied_embeddings:
        want.discard("lm_head.weight")  # stored once, as the embedding
        keys = keys - {"lm_head.weight"}
    missing, unexpected = sorted(want - keys), sorted(keys - want)
    if missing or unexpected:
        raise ConfigError(
            f"the weights do not match the model's config: {len(missing)} missing (e.g. "
            f"{missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})",
            fix="model.hf_weights must hold the weights saved with that config.json",
        )


def load_weights(model: nn.Module, weights_dir: str | Path, *, sharded: bool, rank: int = 0) -> int:
    """Load the safetensors weights into a model not yet wrapped (`sharded=False`, every rank reads them), or
    into one already sharded by FSDP2 (rank 0 reads, the shards are broadcast). Returns the tensors loaded.
    `model` is the trainer's module, which is a Hugging Face one (HFCausalLM) whenever the recipe has weights."""
    if not isinstance(model, HFCausalLM):  # the recipe takes model.hf_weights only with model.hf
        raise ConfigError(
            f"model.hf_weights is for a Hugging Face model, not a {type(model).__name__}",
            fix="set model.hf, or unset model.hf_weights",
        )
    if not sharded:
        sd = read_weights(weights_dir)
        _check_keys(model, set(sd))
        model.hf.load_state_dict(sd, strict=False)
        if model.shape.tied_embeddings:
            model.hf.tie_weights()
        return len(sd)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, ValueType, set_model_state_dict

    full: dict[str, ValueType] = {}
    if rank == 0:
        full = {f"hf.{k}": v for k, v in read_weights(weights_dir).items()}
        _check_keys(model, {k[3:] for k in full})
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    )
    return len(full)
