"""Model definitions the runtime can build from a recipe: dtlaunch's own Llama (plain torch, from the shape),
or a Hugging Face decoder built by transformers from the config in the recipe (model.hf)."""
from __future__ import annotations

import torch
from torch import nn

from .llama import Llama, build_model


def build_for_recipe(model_spec, activation_checkpointing: str = "none",
                     device: str | torch.device | None = "cpu") -> nn.Module:
    """The recipe's model on `device` ("meta": nothing allocated until the strategy materialises its shards)."""
    shape = model_spec.shape()
    if model_spec.hf_config is not None:
        from .hf import build_hf

        return build_hf(model_spec.hf_config, shape, activation_checkpointing, device=str(device))
    return build_model(shape, activation_checkpointing, device=device)


__all__ = ["Llama", "build_model", "build_for_recipe"]
