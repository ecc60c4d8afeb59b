"""The sharp edges we know, as data: each rule has an id, a severity, a check, a message and a fix.

Rules run over a Recipe and its Plan before anything is queued, so a user does not wait hours in a
queue for a job that was never going to work. Some rules belong to one target (a SkyPilot job needs
shared checkpoint storage; a SLURM job's extra options must not contradict the plan): they live in the target's
package (launcher/targets/NAME/rules.py, loaded below for every row of launcher.targets.TARGETS) and run when
that target is rendered or submitted, or for the recipe's default target under `dtlaunch validate`.
Each finding names the file and line of its field (or the `--set` item that gave it). Pure: no I/O except
the optional path checks.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..plan import Plan
from ..recipe import Recipe
from ..targets import TARGETS
from . import rules_plan, rules_runtime, rules_targets  # noqa: F401 - registering the rules
from .core import RULES, Finding, Rule, rule

for _target in TARGETS.values():
    _target.module("rules")  # registering each target's own rules

SEVERITY_ORDER = {"error": 0, "warning": 1}


def validate(
    recipe: Recipe, plan: Plan, target: str | None = None, rules: Iterable[Rule] = RULES, choices=None
) -> list[Finding]:
    """Findings for `recipe` (rendered for `target`, default: the recipe's targets.default), errors first.
    The rules check the plan the job ships: for SkyPilot accelerator fallbacks that is the plan valid on every
    choice (`choices.shipped`, from plan.choices.for_target; made here when not given)."""
    from ..plan.choices import for_target

    target = target or recipe.targets.default
    choices = choices or for_target(recipe, plan, target)
    if choices is not None:
        plan = choices.shipped
    out = []
    for rl in rules:
        if rl.targets and target not in rl.targets or rl.trainer_only and recipe.entrypoint is not None:
            continue
        hit = rl.check(recipe, plan, choices) if rl.choices else rl.check(recipe, plan)
        if hit:
            msg, fix, *at = hit  # a third item names the field inside the rule's own, e.g. env.NAME
            field = at[0] if at else rl.field
            file, line = recipe.locate(field)
            out.append(Finding(rl.id, rl.severity, field, msg, fix, file, line))
    return sorted(out, key=lambda f: SEVERITY_ORDER[f.severity])


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)


__all__ = ["Finding", "Rule", "RULES", "rule", "validate", "has_errors"]
