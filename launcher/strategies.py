"""The vocabulary of parallel strategies: one table, which everything else derives from.

The recipe schema takes its allowed names from here, the planner its memory rules and search order, the
runtime its engine and checkpoint format, the renderer the ZeRO stage, validate its families. A new strategy
is one row here plus the code that runs it; nothing else should spell a strategy's name. (The targets have a
table of their own, in launcher/targets/__init__.py.)
Imports nothing of ours, so the CLI can read it without cost.
"""

from __future__ import annotations

from enum import Enum

import msgspec


class StrategyName(str, Enum):
    """(str, Enum) rather than StrEnum: Python 3.10 is supported."""

    DDP = "ddp"
    FSDP_GRAD_OP = "fsdp_grad_op"
    FSDP = "fsdp"
    HYBRID = "hybrid"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"

    def __str__(self) -> str:
        return self.value


class Family(str, Enum):
    """Which library runs the strategy; it also fixes the checkpoint format (DCP or DeepSpeed's own)."""

    TORCH = "torch"
    DEEPSPEED = "deepspeed"

    def __str__(self) -> str:
        return self.value


SHARDED_NOTHING: frozenset[str] = frozenset()


class StrategySpec(msgspec.Struct, frozen=True):
    name: StrategyName
    family: Family
    shards: frozenset[str]  # which model states are split over the data-parallel ranks: optimizer, grads, params
    offloads: tuple[str, ...]  # offload modes the library really supports for this strategy, besides "none"
    zero_stage: int | None = None  # DeepSpeed's stage number
    reshard_after_forward: bool | None = None  # FSDP2: free gathered weights after forward (False keeps them)
    replicate_across_nodes: bool = False  # hybrid: shard within a node, replicate across nodes

    @property
    def checkpoint_format(self) -> str:
        return "deepspeed" if self.family is Family.DEEPSPEED else "dcp"

    @property
    def sharded(self) -> bool:
        return bool(self.shards)


_ALL = frozenset({"optimizer", "grads", "params"})
STRATEGIES: dict[StrategyName, StrategySpec] = {
    s.name: s
    for s in (
        StrategySpec(StrategyName.DDP, Family.TORCH, SHARDED_NOTHING, ()),
        # FSDP2 with reshard_after_forward=False: grads and optimizer sharded, weights gathered once per step.
        StrategySpec(StrategyName.FSDP_GRAD_OP, Family.TORCH, _ALL, (), reshard_after_forward=False),
        # FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer state together: "params".
        StrategySpec(StrategyName.FSDP, Family.TORCH, _ALL, ("params",), reshard_after_forward=True),
        StrategySpec(
            StrategyName.HYBRID,
            Family.TORCH,
            _ALL,
            ("params",),
            reshard_after_forward=True,
            replicate_across_nodes=True,
        ),
        StrategySpec(StrategyName.ZERO1, Family.DEEPSPEED, frozenset({"optimizer"}), ("optimizer",), zero_stage=1),
        StrategySpec(
            StrategyName.ZERO2, Family.DEEPSPEED, frozenset({"optimizer", "grads"}), ("optimizer",), zero_stage=2
        ),
        StrategySpec(StrategyName.ZERO3, Family.DEEPSPEED, _ALL, ("optimizer", "params"), zero_stage=3),
    )
}
STRATEGY_NAMES: tuple[str, ...] = tuple(s.value for s in STRATEGIES)

# `strategy: auto` searches each family from the least communication to the most sharding.
SEARCH_ORDER: dict[Family, tuple[StrategyName, ...]] = {
    Family.TORCH: (StrategyName.DDP, StrategyName.FSDP_GRAD_OP, StrategyName.FSDP),
    Family.DEEPSPEED: (StrategyName.ZERO1, StrategyName.ZERO2, StrategyName.ZERO3),
}


_BY_NAME: dict[str, StrategySpec] = {s.value: sp for s, sp in STRATEGIES.items()}


def spec(name: str | StrategyName) -> StrategySpec:
    # a plain dict lookup first: the planner's search asks for every candidate, and Enum's constructor is slower
    sp = _BY_NAME.get(name)
    if sp is not None:
        return sp
    try:
        return STRATEGIES[StrategyName(name)]
    except ValueError:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGY_NAMES)}") from None


def names_in(family: Family | str) -> tuple[str, ...]:
    return tuple(s.value for s, sp in STRATEGIES.items() if sp.family is Family(family))


def offload_for(strategy: str | StrategyName, offload: str) -> str:
    """The offload a strategy really does for a requested mode: the nearest supported one, or none.

    FSDP2 cannot offload the optimizer alone (its CPUOffloadPolicy moves parameters too), so "optimizer"
    becomes "params" there; ZeRO-1/2 cannot offload parameters, so "params" becomes "optimizer".
    """
    if offload == "none":
        return "none"
    modes = spec(strategy).offloads
    if offload in modes:
        return offload
    return modes[0] if modes else "none"


def reduces_once_per_step(lay) -> bool:
    """FSDP2 gradient accumulation without communication: `set_requires_gradient_sync(False)` on all but the
    last micro-batch, so each unit's unsharded gradient (fp32: the reduce dtype) stays on every rank and is
    reduce-scattered once per optimizer step, not once per micro-batch.

    For `lay` (a plan's or the runtime's layout) with grad_reduce "once_per_step": only FSDP2 without tensor or
    pipeline parallelism (a pipeline's stages already reduce once, at the end) and without CPU offload (the
    unsharded gradients would sit on the GPU the offload is meant to relieve), and only with more than one
    micro-batch per step. DDP always reduces once per step; DeepSpeed accumulates by its own schedule."""
    sp = spec(lay.strategy)
    return (
        getattr(lay, "grad_reduce", "every_micro_batch") == "once_per_step"
        and sp.family is Family.TORCH
        and sp.sharded
        and lay.tp == 1
        and lay.pp == 1
        and lay.offload == "none"
        and lay.grad_accum > 1
    )
