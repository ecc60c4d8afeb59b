"""What several commands share: the --set/--sweep options, loading a recipe with its plan, printing findings."""

from __future__ import annotations

import click

from ..targets import TARGET_NAMES

OVERRIDE = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a recipe field, e.g. --set training.steps=100 (repeatable).",
)
SWEEP = click.option(
    "--sweep",
    "sweeps",
    multiple=True,
    metavar="KEY=V1,V2",
    help="SLURM: one array task per combination, e.g. --sweep training.seed=1,2,3 (repeatable).",
)
TARGET = click.option(
    "--target", "-t", type=click.Choice(TARGET_NAMES), default=None, help="Default: the recipe's targets.default."
)


def load(path: str, overrides=()):
    from ..plan import make_plan
    from ..recipe import load as load_recipe

    recipe = load_recipe(path, list(overrides))
    return recipe, make_plan(recipe)


def print_finding(f, default_file: str, err: bool = False) -> None:
    where = (f.file or default_file) + (f":{f.line}" if f.line else "")
    click.echo(f"{where}: {f.severity} [{f.rule}] {f.field}: {f.message}", err=err)
    if f.fix:
        click.echo(f"    fix: {f.fix}", err=err)
