"""From a recipe to the artifacts `render` writes and `up` submits: the one way `dtlaunch render`, `dtlaunch up`
and `launcher.submit()` take, so that all three plan, validate and render alike.

The recipe is a file, or a Recipe already loaded (launcher.submit from a notebook): that one is read back from its
data with the record of which fields the user wrote (the planner chooses a tensor degree the user left out, and
keeps one the user wrote), never through a YAML round trip that would mark every field as written.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import DtlaunchError


@dataclass
class Prepared:
    recipe: Any  # the Recipe, overrides applied
    plan: Any
    artifacts: Any
    tasks: list[tuple[str, Any, Any]] = field(default_factory=list)  # (sweep label, recipe, plan): one per task
    source: str = ""
    choices: Any = (
        None  # SkyPilot accelerator fallbacks as planned (plan.choices.Choices); `plan` is their shipped plan
    )

    @property
    def target(self) -> str:
        return self.artifacts.target


def load_recipe(source, overrides: Sequence[str] = ()):
    """A recipe file, or a Recipe (its written fields kept), with `--set` items applied."""
    from .recipe import Recipe, load
    from .recipe.loading import load_data

    if isinstance(source, Recipe):
        return load_data(source.to_dict(), f"<recipe {source.name}>", list(overrides), source.base_dir())
    return load(source, list(overrides))


def source_name(source) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else f"<recipe {getattr(source, 'name', '?')}>"


def prepare(source, overrides: Sequence[str] = (), target: str | None = None, sweeps: Sequence[str] = ()) -> Prepared:
    """Load, plan and render; with `sweeps`, one task per combination (a SLURM array), each planned on its own."""
    from .plan import make_plan
    from .plan.choices import for_target
    from .render import render

    recipe = load_recipe(source, overrides)
    plan = make_plan(recipe)
    target = target or recipe.targets.default
    name = source_name(source)
    if not sweeps:
        # Planned once for the target: the plan the job ships is the one validate checks.
        choices = for_target(recipe, plan, target)
        art = render(recipe, plan, target, choices)
        shipped = choices.shipped if choices else plan
        return Prepared(recipe, shipped, art, [("", recipe, shipped)], name, choices)
    if target != "slurm":
        raise DtlaunchError("--sweep renders a SLURM array job", fix="use --target slurm (or run one `up` per setting)")
    from .cli.sweep import expand
    from .targets.slurm.sbatch import render_slurm_array

    combos = expand(sweeps)
    items = []
    for combo in combos:
        r = load_recipe(source, list(overrides) + combo)
        items.append((r, make_plan(r)))
    shared = sorted({r.checkpoint.dir for r, _ in items if r.checkpoint.dir and "{run_id}" not in r.checkpoint.dir})
    if shared:
        # Each task has a run id of its own, but a fixed directory is one directory: concurrent tasks refuse each
        # other's lock, and a later task resumes an earlier one's final checkpoint (trained nothing) or is refused.
        raise DtlaunchError(
            f"checkpoint.dir {shared[0]!r} has no {{run_id}}: every task of the sweep would write "
            "its checkpoints into that one directory",
            fix=f"put {{run_id}} in it, e.g. --set checkpoint.dir={shared[0].rstrip('/')}/{{run_id}}",
        )
    tasks = [(" ".join(c), r, q) for c, (r, q) in zip(combos, items, strict=True)]
    return Prepared(recipe, plan, render_slurm_array(items), tasks, name)


def check(prep: Prepared, force: bool, action: str) -> None:
    """Print every finding for the target, of every task a sweep renders; refuse on errors unless `force` (a
    rendered job must be runnable)."""
    from .validate import has_errors, validate

    errors = False
    for i, (label, recipe, plan) in enumerate(prep.tasks):
        findings = validate(recipe, plan, prep.target, choices=prep.choices)
        if findings and label:
            print(f"sweep task {i} ({label}):", file=sys.stderr)
        for f in findings:
            where = (f.file or prep.source) + (f":{f.line}" if f.line else "")
            print(
                f"{where}: {f.severity} [{f.rule}] {f.field}: {f.message}" + (f"\n    fix: {f.fix}" if f.fix else ""),
                file=sys.stderr,
            )
        errors = errors or has_errors(findings)
    if errors:
        if not force:
            raise DtlaunchError(
                f"{prep.source}: validation found errors for the {prep.target} target; nothing was {action}",
                fix="fix the errors above, or pass --force to go ahead anyway",
            )
        print(f"warning: {action} despite validation errors (--force)", file=sys.stderr)


__all__ = ["Prepared", "check", "load_recipe", "prepare"]
