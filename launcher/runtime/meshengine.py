"""The engine of tensor, sequence and pipeline parallel layouts: a DeviceMesh with named dimensions
(pipeline, data-parallel replicate, data-parallel shard, tensor), as torchtitan builds it, and on it
DTensor tensor parallelism (`tensor_parallel`), torch.distributed.pipelining stages and schedules
(`pipeline`), and FSDP2 over the data-parallel dimensions of each stage.

The strategy decides the data-parallel dimensions: `fsdp`/`fsdp_grad_op` shard over all of them, `hybrid`
shards inside groups of `shard` and replicates across them, and `ddp` replicates (FSDP2 with shard groups of
one: every rank keeps whole parameters, gradients are all-reduced). FSDP2 is applied even with one
data-parallel rank, as torchtitan does: it is what casts weights for mixed precision and reduces gradients,
so every layout goes through the same code.

Gradient accumulation: without a pipeline, FSDP2 reduce-scatters on every micro-step (as `TorchEngine` does)
and HSDP all-reduces across replicas on the last one. With a pipeline the schedule runs all micro-batches
of the step in one call and torch's stages keep each stage's gradients unsharded (and its weights
gathered) until the last backward, then reduce once.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from .failures import ConfigError
from .gradclip import clip_grad_norm
from .layout import RuntimeLayout
from .loss import cross_entropy
from .optim import build_optimizer, build_scheduler
from .parallel import DTYPES, Engine, _make_scaler, backward, fsdp_units, optimizer_step, step_info

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
# DTensor logs a performance advice on every rank whenever it reduces a gradient norm or gathers a weight over
# two mesh dimensions in two collectives (for the export, the clipping): once per job is noise, 8 per node a
# wall of text in the job's log. Errors still show.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def dp_dims(layout: RuntimeLayout) -> tuple[int, int]:
    """(replicate, shard) sizes of the data-parallel ranks for the layout's strategy."""
    if layout.spec.replicate_across_nodes:
        return layout.dp // layout.shard, layout.shard
    if layout.spec.sharded:
        return 1, layout.dp
    return layout.dp, 1


def build_mesh(layout: RuntimeLayout, device: torch.device):
    """The world as a (pp, dp_replicate, dp_shard, tp) DeviceMesh, tensor innermost (ranks of a node)."""
    from torch.distributed.device_mesh import init_device_mesh

    rep, shard = dp_dims(layout)
    return init_device_mesh(device.type, (layout.pp, rep, shard, layout.tp), mesh_dim_names=MESH_DIMS)


class MeshEngine(Engine):
    """Tensor/sequence/pipeline parallelism with FSDP2 over the data-parallel dimensions."""

    def __init__(
        self,
        module: nn.Module,
        layout: RuntimeLayout,
        training,
        steps: int,
        device: torch.device,
        is_gpu: bool,
        loss_scaling: str = "dynamic",
    ):
        from .pipeline import Split, build_schedule, materialise_split, split_model
        from .tensor_parallel import apply_tensor_parallel, check_divisible

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("tensor and pipeline parallelism need a process group", fix="start the job with torchrun")
        if dist.get_world_size() != layout.world_size:
            raise ConfigError(f"the layout is for {layout.world_size} ranks, the world has {dist.get_world_size()}")
        if layout.offload != "none" and not is_gpu:
            raise ConfigError(
                "FSDP2 CPU offload (CPUOffloadPolicy) needs a GPU: it pins host memory, which fails "
                "on a CPU-only machine",
                fix="set parallelism.offload: none for CPU runs",
            )
        if layout.precision == "fp16" and layout.pp > 1:
            raise ConfigError(
                "fp16 loss scaling is not supported with pipeline parallelism: the loss exists on the last stage only",
                fix="use parallelism.precision: bf16 (or fp32)",
            )
        self.layout, self.device = layout, device
        self.grad_clip = training.grad_clip
        self.mesh = build_mesh(layout, device)
        self.pp_rank, self.dp_rank, self.tp_rank = layout.coords(dist.get_rank())
        shape = getattr(module, "shape", None)
        if layout.tp > 1 and shape is not None:
            check_divisible(shape, layout.tp, layout.sequence_parallel, shape.seq_len)
            if shape.tied_embeddings:
                raise ConfigError(
                    "tensor parallelism of a model with tied input and output embeddings is not "
                    "supported: the embedding and the head would be split as two tensors",
                    fix="set parallelism.tensor: 1 for this model (FSDP shards it instead)",
                )
        meta = any(p.is_meta for p in module.parameters())
        if layout.pp > 1:
            split = split_model(module, layout.pp, self.pp_rank, layout.pp_schedule)
        else:
            split = Split(module, [module], [0], 1)
        local = split.local
        if not meta:
            local.to(device)
        if layout.tp > 1:
            apply_tensor_parallel(local, self.mesh["tp"], layout.sequence_parallel)
        self._shard(split)
        if meta:
            materialise_split(split, device, offload=layout.offload != "none")
        self.module = self.model = local  # every parameter of this rank under its whole-model name
        self.split = split
        self.optimizer = build_optimizer(local, training, fused=is_gpu)
        self.scheduler = build_scheduler(self.optimizer, training, steps)
        self.scaler = (
            _make_scaler(device, fsdp=True) if layout.precision == "fp16" and loss_scaling == "dynamic" else None
        )
        self.schedule = None
        if layout.pp > 1:
            self.schedule, self.stages = build_schedule(
                split, device, self.mesh["pp"].get_group(), layout.pp_schedule, layout.grad_accum, self._pipeline_loss
            )
            self.has_first = any(s.is_first for s in self.stages)
            self.has_last = any(s.is_last for s in self.stages)
            # the global rank of the last stage in this rank's pipeline (it has the loss)
            self._last_rank = dist.get_global_rank(self.mesh["pp"].get_group(), layout.pp - 1)

    # ------------------------------------------------------------------ wrapping

    def _dp_mesh(self):
        rep, _ = dp_dims(self.layout)
        return self.mesh["dp_replicate", "dp_shard"] if rep > 1 else self.mesh["dp_shard"]

    def _shard(self, split) -> None:
        """fully_shard each unit of each stage over the data-parallel mesh, each stage's root last."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        lay = self.layout
        mp = MixedPrecisionPolicy()
        if lay.precision != "fp32":
            mp = MixedPrecisionPolicy(param_dtype=DTYPES[lay.precision], reduce_dtype=torch.float32)
        offload: OffloadPolicy = CPUOffloadPolicy() if lay.offload in ("params", "optimizer") else OffloadPolicy()
        if lay.pp > 1:
            # torch's pipeline stages keep weights gathered from the first backward to the step's end anyway;
            # resharding after each micro-batch's forward would only add all-gathers (torchtitan's default)
            reshard = False
        elif lay.spec.sharded:
            reshard = bool(lay.spec.reshard_after_forward)
        else:  # ddp: shard groups of one, gathered copies freed unit by unit
            reshard = True
        mesh = self._dp_mesh()
        for chunk in split.chunks:
            for unit in fsdp_units(chunk, model_parallel=True):
                fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)

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
        dist.broadcast(loss, src=self._last_rank, group=self.mesh["pp"].get_group())

        return loss

    def accumulate(self, loss_fn, last):
        if self.schedule is not None:
            raise ConfigError("a pipeline runs a step's micro-batches together: use forward_backward, not accumulate")
        root = self.split.chunks[0]
        if dp_dims(self.layout)[0] > 1:  # HSDP: reduce-scatter now, all-reduce across replicas at the end
            root.set_requires_all_reduce(last)
        loss = loss_fn(self.model)
        backward(loss, self.layout.grad_accum, self.scaler)
        return loss.detach()

    def step(self) -> dict:
        self.step_lr = self.lr
        params = list(self.module.parameters())
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = None
        if self.grad_clip > 0:
            # the pipeline's stages hold different parameters: their squares are summed too (torchtitan's
            # clip_grad_norm_)
            stages = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
            norm = clip_grad_norm(params, self.grad_clip, sum_over=stages)
        skipped = optimizer_step(self.optimizer, self.scaler)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return step_info(norm, skipped, self.scaler)
