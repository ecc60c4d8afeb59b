"""How one model replica is split and trained: the planner's decision, and what the job is told to run."""

from __future__ import annotations

import msgspec
from msgspec.structs import asdict

from ..strategies import StrategySpec, reduces_once_per_step, spec


class Layout(msgspec.Struct, frozen=True):
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

    def to_dict(self) -> dict:
        return asdict(self)
