"""The torch engine, for every torch layout: DDP, FSDP2, HSDP, tensor, sequence and pipeline parallelism, on one
DeviceMesh with named dimensions (pipeline, data-parallel replicate, data-parallel shard, tensor), as torchtitan
builds it from its ParallelDims.

On that mesh: DTensor tensor parallelism (`tensor_parallel`), torch.distributed.pipelining stages and schedules
(`pipeline`), and FSDP2 over the data-parallel dimensions of each stage, applied by one function (`apply_fsdp`)
whatever the mesh. The strategy decides the data-parallel dimensions: `fsdp`/`fsdp_grad_op` shard over all of
them, `hybrid` shards inside groups of `shard` and replicates across them (HSDP), and `ddp` replicates. A plain
data-parallel `ddp` layout runs torch's DistributedDataParallel (whole gradients all-reduced in buckets); with
tensor or pipeline parallelism, `ddp` is FSDP2 with shard groups of one (every rank keeps whole parameters,
gradients are all-reduced). FSDP2 is applied even with one data-parallel rank, as torchtitan does: it is what
casts weights for mixed precision and reduces gradients, so every sharded layout goes through the same code.

Gradient accumulation: DDP all-reduces once per optimizer step (`no_sync` on the non-final micro-steps; its
full gradients exist anyway). FSDP2 does what the plan chose (`parallelism.grad_reduce`): reduce-scatter on
every micro-step, as torchtitan does, so gradients stay sharded; or, when the plan found room for them, skip it
until the last micro-step (`set_requires_gradient_sync(False)`), keeping every unsharded gradient in fp32 on
every rank meanwhile (DDP-sized gradient memory) for grad_accum times fewer reduce-scatters. Replicas (HSDP,
`ddp` over FSDP2) reducing on every micro-step skip only the all-reduce across replicas until the last one
(`set_requires_all_reduce`), which keeps gradients sharded. With a pipeline the schedule runs all micro-batches
of the step in one call and torch's stages keep each stage's gradients unsharded (and its weights gathered)
until the last backward, then reduce once.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...plan.layout import Layout
from ..failures import ConfigError
from ..gradclip import clip_grad_norm
from ..loss import cross_entropy
from ..optim import build_optimizer, build_scheduler
from .base import Engine, OptimizerFactory
from .pipeline import Split, build_schedule, materialise_split, split_model
from .tensor_parallel import apply_tensor_parallel, check_divisible

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# DTensor logs a performance advice on every rank whenever it reduces a gradient norm or gathers a weight over
# two mesh dimensions in two collectives (for the export, the clipping): once per job is noise, 8 per node a
# wall of text in the job's log. Errors still show.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def dp_dims(layout: Layout) -> tuple[int, int]:
    """(replicate, shard) sizes of the data-parallel ranks for the layout's strategy."""
    if layout.spec.replicate_across_nodes:
        return layout.dp // layout.shard_group, layout.shard_group
    if layout.spec.sharded:
        return 1, layout.dp
    return layout.dp, 1


def build_mesh(layout: Layout, device: torch.device):
    """The world as a (pp, dp_replicate, dp_shard, tp) DeviceMesh, tensor innermost (ranks of a node)."""
    from torch.distributed.device_mesh import init_device_mesh

    rep, shard = dp_dims(layout)
    return init_device_mesh(device.type, (layout.pp, rep, shard, layout.tp), mesh_dim_names=MESH_DIMS)


def dp_mesh(mesh, layout: Layout):
    """The data-parallel part of the mesh FSDP2 works on: 2-D (replicate, shard) when there are replicas."""
    return mesh["dp_replicate", "dp_shard"] if dp_dims(layout)[0] > 1 else mesh["dp_shard"]


def uses_ddp(layout: Layout) -> bool:
    """A plain replicated layout: torch's DistributedDataParallel rather than FSDP2."""
    return not layout.spec.sharded and not layout.model_parallel


def refuse(layout: Layout, module: nn.Module, is_gpu: bool, distributed: bool) -> None:
    """Every layout this engine cannot run, said before anything is built."""
    if layout.offload != "none" and not is_gpu:
        raise ConfigError(
            "FSDP2 CPU offload (CPUOffloadPolicy) needs a GPU: it pins host memory, which fails on a CPU-only machine",
            fix="set parallelism.offload: none for CPU runs",
        )
    if not distributed:
        if not uses_ddp(layout):
            raise ConfigError(
                f"{layout.strategy} with tensor={layout.tp} pipeline={layout.pp} needs a process group",
                fix="start the job with torchrun (even for 1 rank)",
            )
    elif dist.get_world_size() != layout.world_size:
        raise ConfigError(f"the layout is for {layout.world_size} ranks, the world has {dist.get_world_size()}")
    if layout.precision == "fp16" and layout.pp > 1:
        raise ConfigError(
            "fp16 loss scaling is not supported with pipeline parallelism: the loss exists on the last stage only",
            fix="use parallelism.precision: bf16 (or fp32)",
        )
    shape = getattr(module, "shape", None)
    if layout.tp > 1 and shape is not None:
        check_divisible(shape, layout.tp, layout.sequence_parallel, shape.seq_len)
        if shape.tied_embeddings:
            raise ConfigError(
                "tensor parallelism of a model with tied input and output embeddings is not "
                "supported: the embedding and the head would be split as two tensors",
                fix="set parallelism.tensor: 1 for this model (FSDP shards it instead)",
            )


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
    biggest: nn.ModuleList = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(biggest)


def fsdp_units(
    module: nn.Module, blocks: list[nn.Module] | None = None, *, model_parallel: bool = False
) -> list[nn.Module]:
    """The FSDP2 units in forward order: each block, then the root; the token embedding and the output head
    as units of their own (first and before the root) where `plan.params.embedding_units_apart` says so
    (tables larger than a block, or a tensor/pipeline layout), else in the root with the final norm. A model
    that does not name its embedding and head (a user's own, given to launcher.init().wrap) gets its blocks,
    then the root.
    """
    from ...plan.params import embedding_units_apart

    shape = getattr(module, "shape", None)
    named = all(hasattr(module, a) for a in ("tok_embeddings", "layers", "output")) and shape is not None
    if blocks is not None or not named:
        return [*(blocks if blocks is not None else repeated_blocks(module)), module]
    llama: Any = module  # dtlaunch's Llama (or a stage of it): the attributes checked above
    layers = llama.blocks() if hasattr(llama, "blocks") else list(llama.layers)
    if not embedding_units_apart(llama.shape, model_parallel):
        return [*layers, module]
    # a pipeline stage (Llama.stage) has the embedding only first and the head only last
    return [u for u in (llama.tok_embeddings, *layers, llama.output) if u is not None] + [module]


def apply_fsdp(chunks: list[nn.Module], mesh, layout: Layout, blocks: list[nn.Module] | None = None) -> None:
    """fully_shard each unit of each chunk (a pipeline rank's stages, else the model) over the data-parallel
    dimensions of `mesh`, each chunk's root last."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if layout.precision != "fp32":
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[layout.precision], reduce_dtype=torch.float32)
    offload: OffloadPolicy = CPUOffloadPolicy() if layout.offload != "none" else OffloadPolicy()
    if layout.pp > 1:
        # torch's pipeline stages keep weights gathered from the first backward to the step's end anyway;
        # resharding after each micro-batch's forward would only add all-gathers (torchtitan's default)
        reshard = False
    elif layout.spec.sharded:
        reshard = bool(layout.spec.reshard_after_forward)
    else:  # ddp: shard groups of one, gathered copies freed unit by unit
        reshard = True
    on = dp_mesh(mesh, layout)
    for chunk in chunks:
        for unit in fsdp_units(chunk, blocks, model_parallel=layout.model_parallel):
            fully_shard(unit, mesh=on, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)


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


def fused_adamw(is_gpu: bool, scaler) -> bool:
    """Whether AdamW runs fused (one kernel over all parameters): on GPUs, except under FSDP2's sharded scaler.
    Once that scaler has unscaled the gradients (clipping does), its found-inf flag is shaped [1] where the fused
    step's counters are scalars, and the fused step fails ("output with shape [] doesn't match the broadcast
    shape [1]"; torch 2.11 to 2.13). fp16 FSDP2 steps with the foreach AdamW instead."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return is_gpu and not isinstance(scaler, ShardedGradScaler)


def make_scaler(device: torch.device, fsdp: bool):
    """GradScaler; for FSDP2 the sharded variant, which all-reduces found-inf so every rank skips together."""
    if fsdp:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


class TorchEngine(Engine):
    """Every torch layout on one DeviceMesh, with torch.optim and an optional GradScaler for fp16."""

    def __init__(
        self,
        module: nn.Module,
        layout: Layout,
        training,
        steps: int,
        device: torch.device,
        is_gpu: bool,
        loss_scaling: str = "dynamic",
        *,
        blocks: list[nn.Module] | None = None,
        optimizer: OptimizerFactory | None = None,
    ):
        distributed = dist.is_available() and dist.is_initialized()
        refuse(layout, module, is_gpu, distributed)
        self.layout, self.device = layout, device
        self.grad_clip = training.grad_clip
        self.ddp = uses_ddp(layout)
        # a world of one without a process group (a plain python run) trains DDP's layout unwrapped
        self.mesh = build_mesh(layout, device) if distributed else None
        self.pp_rank, self.dp_rank, self.tp_rank = layout.coords(dist.get_rank() if distributed else 0)
        self.autocast_dtype = None
        if self.ddp:
            split = Split(module, [module], [0], 1)
            module.to(device)
            self.model = module
            if distributed:
                from torch.nn.parallel import DistributedDataParallel as DDP

                # broadcast_buffers=False: the only buffers are the derived RoPE tables; syncing them would
                # add a broadcast to every forward. Newer torch deprecates the name (FutureWarning, once per
                # rank) for forward_sync_buffers, which older torch lacks; the meaning is the same here.
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*deprecated", category=FutureWarning)
                    self.model = DDP(
                        module,
                        device_ids=[device] if is_gpu else None,
                        process_group=self._group("dp_replicate"),
                        gradient_as_bucket_view=True,
                        broadcast_buffers=False,
                    )
            if layout.precision != "fp32":
                self.autocast_dtype = DTYPES[layout.precision]
        else:
            meta = any(p.is_meta for p in module.parameters())
            split = (
                split_model(module, layout.pp, self.pp_rank, layout.pp_schedule)
                if layout.pp > 1
                else Split(module, [module], [0], 1)
            )
            offload = layout.offload != "none"
            # built on meta, materialised after sharding so that no rank holds the full model; an offloaded
            # data-parallel model goes to the host without visiting the GPU, DTensor's split needs the device
            if not meta and (layout.model_parallel or not offload):
                split.local.to(device)
            if layout.tp > 1:
                apply_tensor_parallel(split.local, self._mesh()["tp"], layout.sequence_parallel)
                # FSDP2 warns when a wrapped module returns a view: an in-place op on it would skip the
                # all-gather. Under tensor parallelism the embedding's output is one; the blocks that read it
                # add out of place (h = x + ...), so nothing writes into it.
                warnings.filterwarnings(
                    "ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view", category=UserWarning
                )
            apply_fsdp(split.chunks, self.mesh, layout, blocks)
            if meta:
                materialise_split(split, device, offload=offload)
            self.model = split.local  # every parameter of this rank under its whole-model name
        self.module, self.split = split.local, split
        self.scaler = None
        if layout.precision == "fp16" and loss_scaling == "dynamic":
            self.scaler = make_scaler(device, fsdp=not self.ddp)
        self.optimizer = (
            optimizer(self.module.parameters())
            if optimizer
            else build_optimizer(self.module, training, fused=fused_adamw(is_gpu, self.scaler))
        )
        self.scheduler = build_scheduler(self.optimizer, training, steps)
        self.schedule = None
        if layout.pp > 1:
            group = self._group("pp")
            self.schedule, self.stages = build_schedule(
                split, device, group, layout.pp_schedule, layout.grad_accum, self._pipeline_loss
            )
            self.has_first = any(s.is_first for s in self.stages)
            self.has_last = any(s.is_last for s in self.stages)
            # the global rank of the last stage in this rank's pipeline (it has the loss)
            self._last_rank = dist.get_global_rank(group, layout.pp - 1)

    # ------------------------------------------------------------------ the step

    def _pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(output, target) / self.layout.grad_accum

    def forward_backward(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if self.schedule is None:
            return super().forward_backward(micro)
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro]) if self.has_last else None
        args = (x,) if self.has_first else ()
        # The schedule cuts the batch back into the same micro-batches. The losses it returns are the micro-batches'
        # own (its first step also runs the loss on placeholder tensors to learn the shapes between stages).
        losses: list | None = [] if self.has_last else None
        self.schedule.step(*args, target=y, losses=losses, return_outputs=False)
        loss = (
            torch.stack([v.detach() for v in losses]).float().sum()
            if losses
            else torch.zeros((), dtype=torch.float32, device=self.device)
        )
        dist.broadcast(loss, src=self._last_rank, group=self._group("pp"))
        return loss

    def _mesh(self):
        """The device mesh; only a distributed layout has one, and only such a layout reaches its users."""
        if self.mesh is None:
            raise ConfigError("this layout runs without a process group: it has no device mesh")
        return self.mesh

    def _group(self, dim: str):
        return self._mesh()[dim].get_group()

    def _sync_context(self, last: bool):
        """When this micro-step's gradients are reduced: DDP and FSDP2 reducing once per step on the last one
        only, replicas all-reduced on the last one only."""
        if self.ddp:
            ddp: Any = self.model  # DistributedDataParallel, whose no_sync the Module type does not show
            return contextlib.nullcontext() if last or not hasattr(ddp, "no_sync") else ddp.no_sync()
        root: Any = self.split.chunks[0]  # an FSDPModule: fully_shard swapped its class in
        if self.layout.reduces_once_per_step:  # accumulate unsharded; reduce-scatter (and all-reduce) at the end
            root.set_requires_gradient_sync(last)
        elif dp_dims(self.layout)[0] > 1:  # reduce-scatter now, all-reduce across replicas at the end
            root.set_requires_all_reduce(last)
        return contextlib.nullcontext()

    def accumulate(self, loss_fn, last):
        if self.schedule is not None:
            raise ConfigError("a pipeline runs a step's micro-batches together: use forward_backward, not accumulate")
        with self._sync_context(last):
            with self.clock:
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
            with warnings.catch_warnings():
                # FSDP2's sharded scaler keeps its found-inf flag as a plain tensor of shape [1]; meeting the
                # DTensor gradients, DTensor warns that it treats it as replicated. It is: every rank holds the
                # same flag, all-reduced by the scaler.
                warnings.filterwarnings(
                    "ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning
                )
                self.scaler.unscale_(self.optimizer)
        norm = None
        if self.grad_clip > 0:
            # the pipeline's stages hold different parameters: their squares are summed too (torchtitan's
            # clip_grad_norm_)
            stages = self._group("pp") if self.layout.pp > 1 else None
            norm = clip_grad_norm(self.module.parameters(), self.grad_clip, sum_over=stages)
        skipped = optimizer_step(self.optimizer, self.scaler)
        self.scheduler.step()
        # DDP's gradients are views into its all-reduce buckets (gradient_as_bucket_view), which live as long as
        # the model: zeroing them in place keeps them views. Set to None, the next backward would allocate fresh
        # gradients beside the buckets, twice the gradient memory until the next all-reduce. FSDP2's sharded
        # gradients are set to None, freed until the next reduce-scatter.
        self.optimizer.zero_grad(set_to_none=not self.ddp)
        scale = self.scaler._scale if self.scaler is not None else None
        return {"grad_norm": norm, "skipped": skipped, "loss_scale": scale}
