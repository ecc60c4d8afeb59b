"""The layout the runtime really runs: the plan's, for the world size torchrun actually started. Torch-free,
so the job's plan check (`check`) resolves it before any rank imports torch."""

from __future__ import annotations

from dataclasses import dataclass

from ..strategies import STRATEGIES, Family, StrategySpec, reduces_once_per_step, spec
from .failures import ConfigError


@dataclass
class RuntimeLayout:
    """What the runtime really runs: the plan's layout adjusted to the actual world size.

    Ranks are laid out as torchtitan's DeviceMesh (pipeline, data-parallel, tensor), tensor innermost: a
    node's GPUs form tensor-parallel groups, pipeline stages go across nodes. `world_size` is every rank;
    `dp` the data-parallel degree (world / (tp x pp)), the ranks that read different data."""

    strategy: str
    precision: str
    activation_checkpointing: str
    offload: str
    micro_batch: int
    grad_accum: int
    world_size: int
    shard: int = 0  # hybrid: ranks per sharding group
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    grad_reduce: str = "every_micro_batch"  # FSDP2: or "once_per_step" (strategies.reduces_once_per_step)

    @property
    def reduces_once_per_step(self) -> bool:
        return reduces_once_per_step(self)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def model_parallel(self) -> bool:
        """Tensor or pipeline parallel: the DeviceMesh engine (`launcher.runtime.meshengine`)."""
        return self.tp > 1 or self.pp > 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipeline rank, data-parallel rank, tensor rank) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def spec(self) -> StrategySpec:
        return spec(self.strategy)

    @property
    def family(self) -> str:
        """The checkpoint format family: DCP for the torch strategies, DeepSpeed's own for ZeRO."""
        return self.spec.checkpoint_format

    def describe(self) -> dict:
        """The layout as checkpoint metadata records it."""
        return {
            "strategy": self.strategy,
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "shard": self.shard,
            "sequence_parallel": self.sequence_parallel,
            "pp_schedule": self.pp_schedule if self.pp > 1 else None,
        }


def resolve_layout(plan, world_size: int) -> tuple[RuntimeLayout, list[str]]:
    """The plan's layout for `world_size` ranks, keeping the global batch; notes say what changed.

    Tensor and pipeline degrees are kept; the data-parallel degree follows the world size."""
    notes = []
    lay = plan.layout
    strategy = lay.strategy
    if strategy not in {s.value for s in STRATEGIES}:
        raise ConfigError(f"strategy {strategy!r} is not supported by the runtime")
    tp, pp = lay.tp, lay.pp
    if (tp > 1 or pp > 1) and lay.spec.family is Family.DEEPSPEED:
        raise ConfigError(
            f"the plan combines DeepSpeed {strategy} with tensor={tp} pipeline={pp}; the dtlaunch "
            "runtime runs tensor and pipeline parallelism with PyTorch (DTensor, "
            "torch.distributed.pipelining, FSDP2)",
            fix="set parallelism.backend: torch (or a torch strategy: fsdp, hybrid, ddp)",
        )
    if world_size % (tp * pp):
        raise ConfigError(
            f"{world_size} ranks cannot hold tensor {tp} x pipeline {pp} groups",
            fix=f"run on a multiple of {tp * pp} ranks, or change parallelism.tensor/pipeline",
        )
    micro, ga = lay.micro_batch, lay.grad_accum
    planned_dp = lay.dp
    dp = world_size // (tp * pp)
    global_batch = micro * ga * planned_dp
    if plan.global_batch and plan.global_batch != global_batch:
        notes.append(
            f"global batch is {global_batch} (micro_batch {micro} x grad_accum {ga} x dp {planned_dp}), "
            f"not the requested {plan.global_batch}"
        )
    if dp != planned_dp:
        if global_batch % (micro * dp) == 0:
            new_ga = global_batch // (micro * dp)
            ranks = f"{world_size} ranks (data-parallel {dp})" if tp * pp > 1 else f"{world_size} ranks"
            notes.append(
                f"running on {ranks} instead of the planned {planned_dp * tp * pp}: grad_accum {ga} -> "
                f"{new_ga} keeps the global batch at {global_batch}"
            )
            ga = new_ga
        else:
            raise ConfigError(
                f"global batch {global_batch} cannot be split into micro-batches of {micro} over "
                f"{dp} data-parallel ranks",
                fix="run on a world size that divides the global batch, or change training.micro_batch",
            )
    shard = dp
    if lay.spec.replicate_across_nodes:
        shard = min(lay.shard_group, dp)
        if dp % shard:
            raise ConfigError(f"hybrid sharding groups of {shard} do not divide {dp} data-parallel ranks")
    schedule = getattr(lay, "pp_schedule", "1f1b")
    if pp > 1:
        from ..plan.pipeline import schedule_problem

        problem = schedule_problem(schedule, pp, ga, layers=None)  # the split into stages is checked when made
        if problem:
            raise ConfigError(
                f"the pipeline cannot run: {problem}",
                fix="raise training.global_batch (more micro-batches per step), lower "
                "parallelism.pipeline, or use parallelism.pipeline_schedule: 1f1b",
            )
    return RuntimeLayout(
        strategy,
        lay.precision,
        lay.activation_checkpointing,
        lay.offload,
        micro,
        ga,
        world_size,
        shard,
        tp,
        pp,
        lay.sequence_parallel and tp > 1,
        schedule,
        getattr(lay, "grad_reduce", "every_micro_batch"),
    ), notes
