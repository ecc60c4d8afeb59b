"""Model definitions the runtime can build from a recipe: dtlaunch's own Llama (plain torch, from the shape),
or a Hugging Face decoder built by transformers from the config in the recipe (model.hf)."""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from .llama import Llama, build_model

# Hugging Face decoders initialise with transformers' own code, on the global generator: built on meta and
# materialised shard by shard, their weights depend on the layout (on CPU every shard would even draw the same
# numbers), so they are built eagerly unless the model is too large for one host.
HF_META_INIT_PARAMS = 1_000_000_000


def init_on_meta(model_spec, layout, params: int) -> bool:
    """Build on the meta device (each rank then materialises only its shards)? dtlaunch's Llama: whenever the
    layout shards its parameters (its initial weights do not depend on the layout, `models.init`); a Hugging
    Face decoder: above HF_META_INIT_PARAMS."""
    if layout.family != "dcp" or not (layout.spec.sharded or layout.model_parallel):
        return False
    return model_spec.hf_config is None or params > HF_META_INIT_PARAMS


def build_for_recipe(
    model_spec, activation_checkpointing: str = "none", device: str | torch.device = "cpu", seed: int = 0
) -> nn.Module:
    """The recipe's model on `device` ("meta": nothing allocated until the strategy materialises its shards)."""
    shape = model_spec.shape()
    if model_spec.hf_config is not None:
        from .hf import build_hf

        return build_hf(model_spec.hf_config, shape, activation_checkpointing, device=str(device))
    return build_model(shape, activation_checkpointing, device=device, seed=seed)


class _Initialisable(Protocol):
    """What both models here (Llama, HFCausalLM) have besides nn.Module's."""

    def init_weights(self, buffer_device: str | torch.device | None = None) -> None: ...


def materialise(module: nn.Module, device: torch.device, offload: bool) -> None:
    """Allocate and initialise a model built on the meta device, after sharding: parameters where FSDP2 keeps
    them (the host when offloading, else `device`), buffers (the rotary tables) on `device`, where forward
    runs: FSDP2 moves buffers to the device only inside fully_shard, and skips meta ones."""
    module.to_empty(device="cpu" if offload else device)
    cast(_Initialisable, module).init_weights(buffer_device=device)


__all__ = ["Llama", "build_model", "build_for_recipe", "init_on_meta", "materialise"]
