"""DeepSpeed ZeRO 1/2/3: the engine, its config at the job's world size, and ZeRO-3's partitioned build.

DeepSpeed accumulates gradients by its own gradient_accumulation_steps, and clips, scales and steps itself."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn

from ...plan.layout import Layout
from ..failures import ConfigError
from ..optim import build_optimizer, build_scheduler
from .base import Engine, OptimizerFactory


def name_the_accelerator(is_gpu: bool) -> None:
    """Tell DeepSpeed the job's device before it is imported. Left to guess, it warns on every rank of a CPU
    job "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it"; the
    job knows its device. A DS_ACCELERATOR the user set wins."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if is_gpu else "cpu")


def without_shm_comm(deepspeed) -> None:
    """Keep DeepSpeed's comm from compiling its CPU shared-memory all-reduce. On a CPU accelerator its comm
    backend JIT-builds that extension (a C++ toolchain on every node, about a minute per build, rebuilt whenever
    the torch it builds against moves) before the first collective, though only its inference all-reduce uses
    it: training's collectives go through torch.distributed. An op DeepSpeed marks incompatible it skips; its
    table is cached in the module, so the mark holds for the process. Other accelerators build no such op, and
    reading the table would probe every op's toolchain there: they are left alone."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def import_deepspeed(is_gpu: bool):
    """DeepSpeed, told the job's device and kept from building what training never calls (`without_shm_comm`).
    Raises ImportError as `import deepspeed` does."""
    name_the_accelerator(is_gpu)
    import deepspeed

    without_shm_comm(deepspeed)
    return deepspeed


def _import_deepspeed(layout: Layout, is_gpu: bool):
    try:
        return import_deepspeed(is_gpu)
    except ImportError:
        raise ConfigError(
            f"strategy {layout.strategy} needs DeepSpeed, which is not installed",
            fix="pip install --no-build-isolation deepspeed (it builds against the installed torch)",
        ) from None


class DeepSpeedEngine(Engine):
    """ZeRO 1/2/3 through deepspeed.initialize, with the config from launcher.plan.deepspeed."""

    model: Any  # deepspeed's DeepSpeedEngine: a Module whose own methods (backward, step) deepspeed leaves untyped

    def __init__(
        self,
        module: nn.Module,
        layout: Layout,
        recipe,
        plan,
        steps: int,
        is_gpu: bool,
        optimizer: OptimizerFactory | None = None,
    ):
        deepspeed = _import_deepspeed(layout, is_gpu)
        from deepspeed.accelerator import get_accelerator

        from ...plan.deepspeed import uses_cpu_adam

        acc = get_accelerator()
        if layout.precision == "fp16" and not acc.is_fp16_supported():
            raise ConfigError(
                f"DeepSpeed does not support fp16 on its {acc.device_name()} accelerator",
                fix="use parallelism.precision: bf16 or fp32 here (fp16 needs a GPU), "
                "or a torch strategy (ddp/fsdp) whose GradScaler works on CPU",
            )
        if layout.precision == "bf16" and not acc.is_bf16_supported():
            raise ConfigError(
                f"DeepSpeed does not support bf16 on its {acc.device_name()} accelerator",
                fix="use parallelism.precision: fp16 (with loss scaling) or fp32",
            )
        self.layout, self.module = layout, module
        cfg = ds_config(layout, recipe, plan, is_gpu, client_optimizer=optimizer is not None)
        self.config = cfg
        cpu_adam = optimizer is None and uses_cpu_adam(recipe, layout.offload, is_gpu)
        opt = (
            optimizer(module.parameters()) if optimizer else build_optimizer(module, recipe.training, cpu_adam=cpu_adam)
        )
        scheduler = build_scheduler(opt, recipe.training, steps)
        self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module, optimizer=opt, lr_scheduler=scheduler, config=cfg
        )

    def accumulate(self, loss_fn, last):
        self.model.set_gradient_accumulation_boundary(last)
        with self.clock:
            loss = loss_fn(self.model)
        if last:
            self.step_lr = self.lr  # before DeepSpeed's step moves the schedule on: the rate this step uses
        self.model.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
        self.model.step()  # only updates at the accumulation boundary
        return loss.detach()

    def step(self) -> dict:
        norm = self.model.get_global_grad_norm()
        skipped = False
        opt = self.model.optimizer
        if hasattr(opt, "overflow"):
            skipped = bool(opt.overflow)
        scale = getattr(opt, "cur_scale", None) if self.layout.precision == "fp16" else None
        return {
            "grad_norm": float(norm) if norm is not None and math.isfinite(float(norm)) else None,
            "skipped": skipped,
            "loss_scale": scale,
        }

    @property
    def lr(self) -> float:
        return float(self.model.get_lr()[0])


def ds_config(layout: Layout, recipe, plan, is_gpu: bool, client_optimizer: bool = False) -> dict:
    """The DeepSpeed config of this layout at the world size the job really has (the rendered one's, rescaled)."""
    from ...plan.deepspeed import deepspeed_config

    return deepspeed_config(
        recipe,
        plan,
        dp=layout.world_size,
        grad_accum=layout.grad_accum,
        offload=layout.offload,
        is_gpu=is_gpu,
        client_optimizer=client_optimizer,
    )


def builds_partitioned(layout: Layout, model_spec) -> bool:
    """ZeRO-3 of dtlaunch's Llama: built under deepspeed.zero.Init (`build_partitioned`)."""
    return layout.spec.zero_stage == 3 and model_spec.hf_config is None


def build_partitioned(recipe, plan, layout: Layout, rank: int, device: torch.device, is_gpu: bool) -> nn.Module:
    """ZeRO-3: the model built under `deepspeed.zero.Init` with the job's own config, so that each module's
    parameters are partitioned across the ranks as soon as it is built. Built whole, every rank of a node would
    hold the full fp32 model on the host (~2.2 TB per node of 8 for 70B) and deepspeed.initialize would then
    move it whole to each GPU: any model above ~35B runs out of memory. Each rank then fills only its own
    partitions, with the weights every other layout starts from (`Llama.init_partitions`)."""
    deepspeed = _import_deepspeed(layout, is_gpu)
    from ..models.llama import Llama

    # zero.Init checks the config's batch sizes against DeepSpeed's own view of the world, which is one rank until
    # its comm wraps the process group the runtime started (deepspeed.initialize does that, but after the build)
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False, verbose=False)
    with deepspeed.zero.Init(config_dict_or_path=ds_config(layout, recipe, plan, is_gpu)):
        model = Llama(recipe.model.shape(), layout.activation_checkpointing)
    model.init_seed = recipe.training.seed
    model.init_partitions(rank, device)
    return model
