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


def seconds(s: float) -> str:
    return f"{s:.1f} s" if s >= 1 else f"{s * 1000:.0f} ms"


def table(headers: list[str], rows: list[list[str]], left: tuple[str, ...] = (), styles=None) -> list[str]:
    """Rows as aligned plain-text lines (header, rule, rows). Plain text rather than rich: this table needs
    neither wrapping nor boxes, and `plan` never imports rich (bench/cli_latency.py measures its start-up).
    `styles`: click.style keywords per row (dropped when stdout is not a tty)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(
            c.ljust(w) if h in left else c.rjust(w) for c, w, h in zip(cells, widths, headers, strict=True)
        ).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    for i, r in enumerate(rows):
        st = (styles or [None] * len(rows))[i]
        out.append(click.style(line(r), **st) if st else line(r))
    return out


def duration(hours: float) -> str:
    """A span in the unit that shows it: 12.5 h, 37 min, 45 s."""
    s = hours * 3600
    if s >= 3600:
        return f"{hours:,.1f} h"
    return f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"
