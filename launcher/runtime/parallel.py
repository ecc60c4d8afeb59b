"""Wrapping a model for a strategy: DDP, FSDP2 (full, grad-op, hybrid) or DeepSpeed ZeRO 1/2/3.

Every strategy is driven through the same small `Engine` surface (micro-step, optimizer step,
state for checkpoints), so the training loop has no per-strategy branches.

Gradient accumulation: DDP all-reduces once per optimizer step (`no_sync` on the non-final micro-steps; its
full gradients exist anyway). FSDP2 does what the plan chose (`parallelism.grad_reduce`): reduce-scatter on
every micro-step, as torchtitan does, so gradients stay sharded; or, when the plan found room for them, skip it
until the last micro-step (`set_requires_gradient_sync(False)`), keeping every unsharded gradient in fp32 on
every rank meanwhile (DDP-sized gradient memory) for grad_accum times fewer reduce-scatters. HSDP reducing on
every micro-step skips only the all-reduce across replicas until the last one (`set_requires_all_reduce`),
which keeps gradients sharded. DeepSpeed accumulates by its own gradient_accumulation_steps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..strategies import Family
from .failures import ConfigError
from .gradclip import clip_grad_norm
from .layout import RuntimeLayout
from .loss import cross_entropy
from .models import materialise
from .optim import build_optimizer, build_scheduler

OptimizerFactory = Callable[[Iterable[nn.Parameter]], Any]  # params -> a torch optimizer
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Engine:
    """One optimizer step = `grad_accum` calls of `micro_step`, then `step()`."""

    layout: RuntimeLayout
    model: nn.Module  # what forward runs through (wrapped)
    module: nn.Module  # the bare model (parameter names match the checkpoint and export)
    optimizer: Any
    scheduler: Any
    step_lr: float | None = None  # the learning rate the last optimizer step used

    def accumulate(self, loss_fn: Callable[[nn.Module], torch.Tensor], last: bool) -> torch.Tensor:
        """One micro-batch: `loss_fn(model)` runs the forward and returns the loss; its gradients are added
        (divided by grad_accum), and reduced across ranks once the `last` micro-batch of the step is done.
        Returns the loss, detached."""
        raise NotImplementedError

    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, last: bool) -> torch.Tensor:
        """dtlaunch's own language-model loss on one micro-batch."""
        return self.accumulate(lambda model: cross_entropy(model(inputs), targets), last)

    def forward_backward(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step's micro-batches, forward and backward; returns their mean loss (fp32, detached).
        A pipeline runs them all in one schedule (`launcher.runtime.meshengine`)."""
        total = torch.zeros((), dtype=torch.float32, device=micro[0][0].device)
        for i, (x, y) in enumerate(micro):
            total += self.micro_step(x, y, last=i == len(micro) - 1).float()
        return total / len(micro)

    @property
    def grad_accum(self) -> int:
        return self.layout.grad_accum

    def step(self) -> dict:
        raise NotImplementedError

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


class TorchEngine(Engine):
    """DDP and FSDP2, with torch.optim and an optional GradScaler for fp16."""

    def __init__(
        self,
        module: nn.Module,
        layout: RuntimeLayout,
        training,
        steps: int,
        device: torch.device,
        is_gpu: bool,
        loss_scaling: str = "dynamic",
        *,
        blocks: list[nn.Module] | None = None,
        optimizer: OptimizerFactory | None = None,
    ):
        import torch.distributed as dist

        self.layout, self.module, self.device = layout, module, device
        self.grad_clip = training.grad_clip
        distributed = dist.is_available() and dist.is_initialized()
        self.autocast_dtype = None
        if not layout.spec.sharded:  # DDP
            module.to(device)
            if distributed:
                from torch.nn.parallel import DistributedDataParallel as DDP

                # broadcast_buffers=False: the only buffers are the derived RoPE tables; syncing them would
                # add a broadcast to every forward.
                self.model = DDP(
                    module,
                    device_ids=[device] if is_gpu else None,
                    gradient_as_bucket_view=True,
                    broadcast_buffers=False,
                )
            else:
                self.model = module
            if layout.precision != "fp32":
                self.autocast_dtype = DTYPES[layout.precision]
        else:
            self.model = shard_fsdp2(module, layout, device, is_gpu, blocks=blocks)
        self.optimizer = (
            optimizer(module.parameters()) if optimizer else build_optimizer(module, training, fused=is_gpu)
        )
        self.scheduler = build_scheduler(self.optimizer, training, steps)
        self.scaler = None
        if layout.precision == "fp16" and loss_scaling == "dynamic":
            self.scaler = _make_scaler(device, fsdp=layout.spec.sharded)

    def _sync_context(self, last: bool):
        if not self.layout.spec.sharded:  # DDP
            return contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
        if self.layout.reduces_once_per_step:  # accumulate unsharded; reduce-scatter (and all-reduce) at the end
            self.model.set_requires_gradient_sync(last)
        elif self.layout.spec.replicate_across_nodes:  # HSDP: reduce-scatter now, all-reduce replicas at the end
            self.model.set_requires_all_reduce(last)
        return contextlib.nullcontext()

    def accumulate(self, loss_fn, last):
        with self._sync_context(last):
            if self.autocast_dtype is not None:
                with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                    loss = loss_fn(self.model)
            else:
                loss = loss_fn(self.model)
            backward(loss, self.layout.grad_accum, self.scaler)
        return loss.detach()

    def step(self) -> dict:
        self.step_lr = self.lr
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = None
        if self.grad_clip > 0:
            norm = clip_grad_norm(self.module.parameters(), self.grad_clip)
        skipped = optimizer_step(self.optimizer, self.scaler)
        self.scheduler.step()
        # DDP's gradients are views into its all-reduce buckets (gradient_as_bucket_view), which live as long as
        # the model: zeroing them in place keeps them views. Set to None, the next backward would allocate fresh
        # gradients beside the buckets, twice the gradient memory until the next all-reduce. FSDP2's sharded
        # gradients are set to None, freed until the next reduce-scatter.
        self.optimizer.zero_grad(set_to_none=self.layout.spec.sharded)
        return step_info(norm, skipped, self.scaler)


def backward(loss: torch.Tensor, grad_accum: int, scaler) -> None:
    """One micro-step's backward: the loss is a mean over its micro-batch, so each micro-step adds 1/grad_accum
    of the step's gradient; fp16 scales it first (GradScaler) so small gradients do not underflow."""
    scaled = loss / grad_accum
    if scaler is not None:
        scaled = scaler.scale(scaled)
    scaled.backward()


def optimizer_step(optimizer, scaler) -> torch.Tensor | None:
    """Step the optimizer, through the loss scaler if there is one (fp16). Returns, as a device tensor (read on
    log steps only: no sync here), 1 when the scaler skipped the step because a gradient overflowed (it then
    lowered its scale), else 0; None without a scaler."""
    if scaler is None:
        optimizer.step()
        return None
    before = scaler._scale.clone()  # get_scale() would wait for the GPU
    scaler.step(optimizer)
    scaler.update()
    return (scaler._scale < before).to(torch.int64)


def step_info(norm: torch.Tensor | None, skipped: torch.Tensor | None, scaler) -> dict:
    """What an optimizer step reports, as device tensors (the loop reads them on log steps)."""
    return {"grad_norm": norm, "skipped": skipped, "loss_scale": scaler._scale if scaler is not None else None}


def _make_scaler(device: torch.device, fsdp: bool):
    """GradScaler; for FSDP2 the sharded variant, which all-reduces found-inf so every rank skips together."""
    if fsdp:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks FSDP2 shards one by one: the model's `layers`, else its largest ModuleList (a user's model)."""
    layers = getattr(module, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return list(layers)
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ConfigError(
            f"{type(module).__name__} has no list of repeated blocks for FSDP2 to shard one by one",
            fix="pass blocks=[...] to job.wrap (e.g. blocks=list(model.blocks))",
        )
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def fsdp_units(
    module: nn.Module, blocks: list[nn.Module] | None = None, *, model_parallel: bool = False
) -> list[nn.Module]:
    """The FSDP2 units in forward order: each block, then the root; the token embedding and the output head
    as units of their own (first and before the root) where `plan.params.embedding_units_apart` says so
    (tables larger than a block, or a tensor/pipeline layout), else in the root with the final norm. A model
    that does not name its embedding and head (a user's own, given to launcher.init().wrap) gets its blocks,
    then the root.
    """
    from ..plan.params import embedding_units_apart

    shape = getattr(module, "shape", None)
    named = all(hasattr(module, a) for a in ("tok_embeddings", "layers", "output")) and shape is not None
    if blocks is not None or not named:
        return [*(blocks if blocks is not None else repeated_blocks(module)), module]
    layers = module.blocks() if hasattr(module, "blocks") else list(module.layers)
    if not embedding_units_apart(shape, model_parallel):
        return [*layers, module]
    # a pipeline stage (Llama.stage) has the embedding only first and the head only last
    return [u for u in (module.tok_embeddings, *layers, module.output) if u is not None] + [module]


def shard_fsdp2(
    module: nn.Module, layout: RuntimeLayout, device: torch.device, is_gpu: bool, blocks: list[nn.Module] | None = None
) -> nn.Module:
    """fully_shard each unit of `fsdp_units` on a 1-D or 2-D (HSDP) mesh, the root last."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if layout.offload in ("params", "optimizer") and not is_gpu:
        raise ConfigError(
            "FSDP2 CPU offload (CPUOffloadPolicy) needs a GPU: it pins host memory, which fails on a CPU-only machine",
            fix="set parallelism.offload: none for CPU runs",
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"{layout.strategy} needs a process group", fix="start the job with torchrun (even for 1 rank)"
        )
    world = dist.get_world_size()
    if layout.spec.replicate_across_nodes:
        mesh = init_device_mesh(
            device.type, (world // layout.shard, layout.shard), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    mp = MixedPrecisionPolicy()
    if layout.precision != "fp32":
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[layout.precision], reduce_dtype=torch.float32)
    offload: OffloadPolicy = CPUOffloadPolicy() if layout.offload in ("params", "optimizer") else OffloadPolicy()
    reshard = bool(layout.spec.reshard_after_forward)
    # materialised after sharding, so that no rank holds the full model
    meta = any(p.is_meta for p in module.parameters())
    if not meta and not isinstance(offload, CPUOffloadPolicy):
        module.to(device)
    for unit in fsdp_units(module, blocks):
        fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    if meta:
        materialise(module, device, offload=isinstance(offload, CPUOffloadPolicy))
    return module


class DeepSpeedEngine(Engine):
    """ZeRO 1/2/3 through deepspeed.initialize, with the config from launcher.render.deepspeed."""

    def __init__(
        self,
        module: nn.Module,
        layout: RuntimeLayout,
        recipe,
        plan,
        steps: int,
        is_gpu: bool,
        optimizer: OptimizerFactory | None = None,
    ):
        try:
            import deepspeed
        except ImportError:
            raise ConfigError(
                f"strategy {layout.strategy} needs DeepSpeed, which is not installed",
                fix="pip install --no-build-isolation deepspeed (it builds against the installed torch)",
            ) from None
        from deepspeed.accelerator import get_accelerator

        from ..plan.deepspeed import uses_cpu_adam

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


def ds_config(layout: RuntimeLayout, recipe, plan, is_gpu: bool, client_optimizer: bool = False) -> dict:
    """The DeepSpeed config of this layout at the world size the job really has (the rendered one's, rescaled)."""
    from ..plan.deepspeed import deepspeed_config

    return deepspeed_config(
        recipe,
        plan,
        dp=layout.world_size,
        grad_accum=layout.grad_accum,
        offload=layout.offload,
        is_gpu=is_gpu,
        client_optimizer=client_optimizer,
    )


def builds_partitioned(layout: RuntimeLayout, model_spec) -> bool:
    """ZeRO-3 of dtlaunch's Llama: built under deepspeed.zero.Init (`build_partitioned`)."""
    return layout.spec.zero_stage == 3 and model_spec.hf_config is None


def build_partitioned(recipe, plan, layout: RuntimeLayout, rank: int, device: torch.device, is_gpu: bool) -> nn.Module:
    """ZeRO-3: the model built under `deepspeed.zero.Init` with the job's own config, so that each module's
    parameters are partitioned across the ranks as soon as it is built. Built whole, every rank of a node would
    hold the full fp32 model on the host (~2.2 TB per node of 8 for 70B) and deepspeed.initialize would then
    move it whole to each GPU: any model above ~35B runs out of memory. Each rank then fills only its own
    partitions, with the weights every other layout starts from (`Llama.init_partitions`)."""
    try:
        import deepspeed
    except ImportError:
        raise ConfigError(
            f"strategy {layout.strategy} needs DeepSpeed, which is not installed",
            fix="pip install --no-build-isolation deepspeed (it builds against the installed torch)",
        ) from None
    from .models.llama import Llama

    with deepspeed.zero.Init(config_dict_or_path=ds_config(layout, recipe, plan, is_gpu)):
        model = Llama(recipe.model.shape(), layout.activation_checkpointing)
    model.init_seed = recipe.training.seed
    model.init_partitions(rank, device)
    return model


def wrap_model(
    module: nn.Module,
    layout: RuntimeLayout,
    recipe,
    plan,
    steps: int,
    device: torch.device,
    is_gpu: bool,
    *,
    blocks: list[nn.Module] | None = None,
    optimizer: OptimizerFactory | None = None,
) -> Engine:
    """The engine for `layout.strategy`: the one place that knows which library runs which strategy.
    `blocks` (FSDP2's units) and `optimizer` (a factory of params) serve user models (launcher.runtime.job)."""
    if layout.spec.family is Family.DEEPSPEED:
        return DeepSpeedEngine(module, layout, recipe, plan, steps, is_gpu, optimizer=optimizer)
    if layout.model_parallel:
        if blocks is not None or optimizer is not None:
            raise ConfigError(
                "tensor and pipeline parallelism split dtlaunch's Llama and Hugging Face decoders by "
                "their module names; launcher.init().wrap cannot split your own model",
                fix="set parallelism.tensor: 1 and pipeline: 1 for your own training script",
            )
        from .meshengine import MeshEngine

        return MeshEngine(module, layout, recipe.training, steps, device, is_gpu, recipe.parallelism.loss_scaling)
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
