"""One job, several acceptable accelerators (SkyPilot's `ordered` / `any_of`): which of them can run it, in
which order to ask for them, and the one plan the job ships.

A job ships ONE plan.json, and the cloud decides which accelerator it gets only at launch. So the layout
(strategy, activation checkpointing, offload, micro-batch) must be valid on every accelerator the task may
land on. Each accelerator is first planned on its own (the recipe with that accelerator); those whose own
plan does not fit, or that lack the precision the recipe trains in, are dropped with the reason. The
shipped plan is the one made for the remaining accelerator with the least memory per device: what fits
there fits on every larger one (the memory a layout needs depends on the model and the layout, not on the
device), and this is checked, not assumed. The price of that choice is speed: a larger device then runs a
layout sized for a smaller one (e.g. with activation checkpointing it would not need); the per-choice table
of `dtlaunch plan` shows it.

`ordered` asks for the cheapest first, by the total cost of the shipped layout on each device (its step time
at that device's peak, times its price), not by the hourly price: a faster device that costs more per hour
can be cheaper per run. Without a training length there is no total, and the given order stands.

Only the count per node must be the same everywhere: the world size is part of the plan. The primary
accelerator's overrides (resources.gpu_memory_gb, peak_tflops, usd_per_gpu_hour) describe that device
only; the others use the catalogue.
"""

from __future__ import annotations

import msgspec

from .. import catalog
from ..recipe import Recipe
from . import Plan, cost, make_plan


class Choice(msgspec.Struct, frozen=True):
    accelerator: str  # TYPE:COUNT as SkyPilot spells it
    device: catalog.Accelerator
    own: Plan  # the recipe planned for this accelerator alone
    dropped: str | None = None  # why it cannot run the job (None: kept)
    step_seconds: float | None = None  # the shipped layout on this device
    usd: float | None = None  # the shipped layout's total cost on this device (None: no training length)


class Choices(msgspec.Struct):
    choices: list[Choice]  # every accelerator, primary first, in the recipe's order
    kept: list[Choice]  # the ones the task asks for, in the order it asks (cheapest first for `ordered`)
    shipped: Plan  # the plan the job carries: valid on every kept accelerator
    basis: str  # the accelerator the shipped plan was made for
    notes: list[str] = msgspec.field(default_factory=list)

    @property
    def dropped(self) -> list[Choice]:
        return [c for c in self.choices if c.dropped]


def with_accelerator(recipe: Recipe, accelerator: str) -> Recipe:
    """The recipe on another accelerator; the primary's device overrides do not carry over."""
    if accelerator == recipe.resources.accelerator:
        return recipe
    res = recipe.resources.replace(accelerator=accelerator, gpu_memory_gb=None, peak_tflops=None, usd_per_gpu_hour=None)
    return recipe.replace(resources=res)


def accelerators(recipe: Recipe) -> list[str]:
    """The primary, then the fallbacks, each once."""
    out = [recipe.resources.accelerator]
    for a in recipe.targets.sky.accelerators:
        if a not in out:
            out.append(a)
    return out


def _why_not(recipe: Recipe, r: Recipe, p: Plan) -> str | None:
    dev = r.resources.device()
    if r is not recipe and not recipe.resources.device().is_gpu:
        return "the primary accelerator is cpu: a CPU job asks for vCPUs, not for one of several GPUs"
    if r.resources.per_node != recipe.resources.per_node:
        return (
            f"{r.resources.per_node} devices per node, not {recipe.resources.per_node}: one plan serves one world size"
        )
    if recipe.parallelism.precision == "bf16" and dev.is_gpu and not dev.bf16:
        return f"{dev.name} has no bf16"
    if not p.memory.fits:
        return f"its own plan ({p.strategy}) needs {p.memory.total / 1e9:.1f} GB per device of {dev.memory_gb:g} GB"
    return None


def plan_choices(recipe: Recipe, primary: Plan | None = None, order: str | None = None) -> Choices:
    """Plan every accelerator of the task (see the module docstring). `primary`: the recipe's own plan, if
    already made. With no fallbacks this is the recipe's plan and nothing else."""
    order = order or recipe.targets.sky.fallback
    primary = primary or make_plan(recipe)
    planned = []
    for a in accelerators(recipe):
        r = with_accelerator(recipe, a)
        p = primary if r is recipe else make_plan(r)
        planned.append((a, r, p, _why_not(recipe, r, p)))
    kept = [x for x in planned if x[3] is None]
    notes = []
    if not kept:  # nothing fits: the primary's own plan, whose rules say why
        shipped, basis = primary, recipe.resources.accelerator
    else:
        a, r, shipped, _ = min(kept, key=lambda x: x[1].resources.device().memory_gb)  # first of the smallest
        basis = a
    need = shipped.memory.total
    choices = []
    for a, r, p, why in planned:
        dev = r.resources.device()
        if why is None and need > dev.memory_gb * 1e9:
            why = (
                f"the shipped layout ({shipped.strategy}, from {basis}) needs {need / 1e9:.1f} GB of "
                f"{dev.memory_gb:g} GB"
            )
        step = usd = None
        if why is None:
            step = cost.step_seconds(
                shipped.flops_per_step,
                shipped.world_size,
                dev.peak_tflops,
                recipe.resources.mfu,
                shipped.layout,
            )
            if shipped.steps is not None:
                usd = shipped.steps * step / 3600 * shipped.world_size * dev.usd_per_hour
        choices.append(Choice(a, dev, p, why, step, usd))
    kept_choices = [c for c in choices if c.dropped is None]
    if order == "ordered" and kept_choices and all(c.usd is not None for c in kept_choices):
        # every one has a cost here (`or 0.0` only tells mypy); stable: equal costs keep the recipe's order
        kept_choices.sort(key=lambda c: c.usd or 0.0)
    elif order == "ordered" and len(kept_choices) > 1:
        notes.append("no training length: the accelerators are asked for in the recipe's order, not by cost")
    if len(choices) > 1 and basis != recipe.resources.accelerator:
        notes.append(
            f"the job ships the layout planned for {basis} (the least memory per device), valid on every "
            "accelerator the task may get"
        )
    for c in choices:
        if c.dropped:
            notes.append(f"{c.accelerator} dropped: {c.dropped}")
    return Choices(choices, kept_choices, shipped, basis, notes)


def for_target(recipe: Recipe, primary: Plan, target: str | None) -> Choices | None:
    """The accelerator choices a render for `target` ships (SkyPilot with fallbacks), else None. Made once per
    render: `prepare` passes them to validate and render alike."""
    if (target or recipe.targets.default) != "sky" or not recipe.targets.sky.accelerators:
        return None
    return plan_choices(recipe, primary)
