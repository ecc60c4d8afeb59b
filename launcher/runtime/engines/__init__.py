"""Wrapping a model for its layout: the engine the training loop drives (`base.Engine`).

Two engines, one per library: `mesh.TorchEngine` runs every torch layout (DDP, FSDP2, HSDP, tensor, sequence
and pipeline parallelism) on one DeviceMesh; `deepspeed.DeepSpeedEngine` runs ZeRO 1/2/3. `build_engine` is
the one place that knows which runs which strategy.
"""

from __future__ import annotations

import torch
from torch import nn

from ...plan.layout import Layout
from ...strategies import Family
from .base import Engine, OptimizerFactory
from .deepspeed import DeepSpeedEngine, build_partitioned, builds_partitioned
from .mesh import TorchEngine, fsdp_units


def build_engine(
    module: nn.Module,
    layout: Layout,
    recipe,
    plan,
    steps: int,
    device: torch.device,
    is_gpu: bool,
    *,
    blocks: list[nn.Module] | None = None,
    optimizer: OptimizerFactory | None = None,
) -> Engine:
    """The engine for `layout` (the plan's layout for this world: `Layout.for_world`). `blocks` (FSDP2's units)
    and `optimizer` (a factory of params) serve user models (launcher.runtime.job)."""
    if layout.spec.family is Family.DEEPSPEED:
        return DeepSpeedEngine(module, layout, recipe, plan, steps, is_gpu, optimizer=optimizer)
    return TorchEngine(
        module,
        layout,
        recipe.training,
        steps,
        device,
        is_gpu,
        recipe.parallelism.loss_scaling,
        blocks=blocks,
        optimizer=optimizer,
    )


__all__ = [
    "DeepSpeedEngine",
    "Engine",
    "TorchEngine",
    "build_engine",
    "build_partitioned",
    "builds_partitioned",
    "fsdp_units",
]
