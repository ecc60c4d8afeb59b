"""How one model replica is split and trained: the planner's decision, and what the job runs.

One type for both. The planner decides a Layout for the world it plans; the job runs `for_world` of it, the
same layout on the world torchrun really started. Torch-free, so the job's plan check resolves it before any
rank imports torch.
"""

from __future__ import annotations

import msgspec
from msgspec.structs import replace

from ..errors import DtlaunchError
from ..jobenv import ExitCode
from ..strategies import STRATEGY_NAMES, Family, StrategySpec, reduces_once_per_step, spec
from .pipeline import schedule_problem


class LayoutError(DtlaunchError):
    """The layout cannot run on the world torchrun started: the job exits CONFIG (restarting will not help)."""

    exit_code = ExitCode.CONFIG


class Layout(msgspec.Struct, frozen=True):
    """Ranks are laid out as torchtitan's DeviceMesh (pipeline, data-parallel, tensor), tensor innermost: a
    node's GPUs form tensor-parallel groups, pipeline stages go across nodes. `dp` is the data-parallel degree,
    the ranks that read different data; `world_size` every rank."""

    strategy: str
    dp: int
    tp: int = 1
    pp: int = 1
    shard: int | None = None  # hybrid: size of the sharding group (GPUs per node); None = all of dp
    precision: str = "bf16"
    activation_checkpointing: str = "none"
    offload: str = "none"
    micro_batch: int = 1
    grad_accum: int = 1  # micro-batches per optimizer step (also bounds a pipeline's in-flight micro-batches)
    sequence_parallel: bool = False
    optimizer: str = "adamw"
    pp_schedule: str = "1f1b"  # the pipeline's schedule (launcher.plan.pipeline), when pp > 1
    grad_reduce: str = "every_micro_batch"  # FSDP2: or "once_per_step" (strategies.reduces_once_per_step)

    @property
    def spec(self) -> StrategySpec:
        return spec(self.strategy)

    @property
    def reduces_once_per_step(self) -> bool:
        return reduces_once_per_step(self)

    @property
    def shard_group(self) -> int:
        """Ranks that split the sharded states: all of dp, or the hybrid group inside a node."""
        if self.spec.replicate_across_nodes and self.shard:
            return min(self.shard, self.dp)
        return self.dp

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def model_parallel(self) -> bool:
        """Tensor or pipeline parallel: the model itself is split, not only its states."""
        return self.tp > 1 or self.pp > 1

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def family(self) -> str:
        """The checkpoint format family: DCP for the torch strategies, DeepSpeed's own for ZeRO."""
        return self.spec.checkpoint_format

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipeline rank, data-parallel rank, tensor rank) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def describe(self) -> dict:
        """The layout as checkpoint metadata records it."""
        return {
            "strategy": self.strategy,
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "shard": self.shard_group,
            "sequence_parallel": self.sequence_parallel,
            "pp_schedule": self.pp_schedule if self.pp > 1 else None,
        }

    def for_world(self, world_size: int, global_batch: int | None = None) -> tuple[Layout, list[str]]:
        """This layout on the `world_size` ranks torchrun really started, and notes on what changed: tensor and
        pipeline degrees are kept, the data-parallel degree follows the world, grad_accum keeps the global
        batch. `global_batch` (the plan's) is only compared, for a note. LayoutError if the world cannot run it."""
        notes = []
        strategy, tp, pp = self.strategy, self.tp, self.pp
        if strategy not in STRATEGY_NAMES:
            raise LayoutError(f"strategy {strategy!r} is not supported by the runtime")
        if self.model_parallel and self.spec.family is Family.DEEPSPEED:
            raise LayoutError(
                f"the plan combines DeepSpeed {strategy} with tensor={tp} pipeline={pp}; the dtlaunch "
                "runtime runs tensor and pipeline parallelism with PyTorch (DTensor, "
                "torch.distributed.pipelining, FSDP2)",
                fix="set parallelism.backend: torch (or a torch strategy: fsdp, hybrid, ddp)",
            )
        if world_size % (tp * pp):
            raise LayoutError(
                f"{world_size} ranks cannot hold tensor {tp} x pipeline {pp} groups",
                fix=f"run on a multiple of {tp * pp} ranks, or change parallelism.tensor/pipeline",
            )
        micro, ga, planned_dp = self.micro_batch, self.grad_accum, self.dp
        dp = world_size // (tp * pp)
        batch = self.global_batch
        if global_batch and global_batch != batch:
            notes.append(
                f"global batch is {batch} (micro_batch {micro} x grad_accum {ga} x dp {planned_dp}), "
                f"not the requested {global_batch}"
            )
        if dp != planned_dp:
            if batch % (micro * dp):
                raise LayoutError(
                    f"global batch {batch} cannot be split into micro-batches of {micro} over {dp} data-parallel ranks",
                    fix="run on a world size that divides the global batch, or change training.micro_batch",
                )
            new_ga = batch // (micro * dp)
            ranks = f"{world_size} ranks (data-parallel {dp})" if tp * pp > 1 else f"{world_size} ranks"
            notes.append(
                f"running on {ranks} instead of the planned {planned_dp * tp * pp}: grad_accum {ga} -> "
                f"{new_ga} keeps the global batch at {batch}"
            )
            ga = new_ga
        shard = None
        if self.spec.replicate_across_nodes:
            shard = min(self.shard_group, dp)
            if dp % shard:
                raise LayoutError(f"hybrid sharding groups of {shard} do not divide {dp} data-parallel ranks")
        if pp > 1:
            problem = schedule_problem(self.pp_schedule, pp, ga, layers=None)  # the stages are checked when cut
            if problem:
                raise LayoutError(
                    f"the pipeline cannot run: {problem}",
                    fix="raise training.global_batch (more micro-batches per step), lower "
                    "parallelism.pipeline, or use parallelism.pipeline_schedule: 1f1b",
                )
        lay = replace(self, dp=dp, grad_accum=ga, shard=shard, sequence_parallel=self.sequence_parallel and tp > 1)
        return lay, notes
