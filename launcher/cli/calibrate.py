"""`dtlaunch calibrate`: a short run of the recipe on its own hardware and target, whose measured step time,
MFU, memory and checkpoint write time become a calibration file that `plan --calibration` (or the recipe's
`resources.calibration`) uses instead of the assumed MFU; and what `plan` prints of it, and `plan --accuracy`.

The run is the recipe itself, cut to one node (by default) and a few dozen steps, submitted the way `up` submits
it; its runtime leaves the plan-vs-measured ledger (launcher.plan.ledger) in its run directory, and the
calibration file is that ledger plus the figures a plan reuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from .common import OVERRIDE, TARGET, duration, load, seconds, table

CALIBRATION_FILE = "calibration.json"


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:+.1%}" if abs(x) < 0.1 else f"{x:+.0%}"


def calibration_overrides(recipe, steps: int, nodes: int) -> tuple[list[str], list[str]]:
    """The --set items that make the calibration run of `recipe`, and what they changed, said for the user."""
    every = max(1, steps // 2)
    sets = [
        f"name={recipe.name}-calibrate",
        f"resources.nodes={nodes}",
        f"training.steps={steps}",
        "training.tokens=null",
        "training.log_every=1",
        f"checkpoint.every={every}",
    ]
    said = [f"{steps} steps, each logged; a checkpoint at step {every} and at the end"]
    if nodes != recipe.resources.nodes:
        said.append(f"{nodes} node(s) instead of {recipe.resources.nodes}")
    return sets, said


def fit_depth(recipe_path: str, overrides: list[str]) -> tuple[list[str], str | None]:
    """Fewer layers until the calibration run's plan fits one node: the MFU is measured per FLOP of this model's
    own layers, so it carries over to the full depth."""
    from ..recipe.calibration import CalibrationError

    recipe, plan = load(recipe_path, overrides)
    if plan.memory.fits:
        return overrides, None
    shape = recipe.model.shape()
    layers = shape.layers if shape is not None else None
    floor = max(1, plan.layout.pp)
    n = layers
    while n is not None and n > floor:
        n = max(floor, n // 2)
        _, p = load(recipe_path, [*overrides, f"model.layers={n}"])
        if p.memory.fits:
            return [*overrides, f"model.layers={n}"], f"the model cut to {n} of its {layers} layers to fit"
    raise CalibrationError(
        "the recipe does not fit on the calibration's nodes even with its layers cut",
        "calibrate on more nodes (--nodes N), or fix the layout first (dtlaunch plan RECIPE)",
    )


def find_ledger(out: Path, log_lines=None) -> tuple[dict, Path]:
    """The ledger a run left and the directory its calibration goes to: the newest ledger.json under `out` (its run
    directory, or a SLURM job's runs/<run id>/); else the last one in its log (`out` a log file, or `log_lines`,
    the job's log as its target returns it: a SkyPilot run directory stays on the nodes)."""
    from ..plan.ledger import LEDGER_FILE, LOG_MARKER, from_log
    from ..recipe.calibration import CalibrationError

    if out.is_file():
        with open(out, errors="replace") as f:
            doc = from_log(f)
        if doc is None:
            raise CalibrationError(
                f"{out}: no ledger in this log (a line starting {LOG_MARKER.strip()!r}): the run did not reach its end",
                "calibrate from the log of a run that ended, or from its run directory",
            )
        return doc, out.parent
    found = [p for p in (out / LEDGER_FILE, *out.glob(f"runs/*/{LEDGER_FILE}")) if p.is_file()]
    if found:
        newest = max(found, key=lambda p: p.stat().st_mtime)
        return json.loads(newest.read_text()), newest.parent
    doc = from_log(log_lines) if log_lines is not None else None
    if doc is None:
        raise CalibrationError(
            f"{out}: no {LEDGER_FILE}, and none in the job's log: the run did not reach its end",
            "read the run's log (dtlaunch logs NAME), or calibrate from a saved log or run directory with --from",
        )
    return doc, out


def _job_log(name: str):
    """The job's log lines as its target returns them (what `dtlaunch logs NAME` prints); read only when needed."""
    from ..targets import backend
    from ..targets.registry import Registry
    from .jobs import resolve

    rec = resolve(Registry(), name)
    yield from backend(rec.target).logs(rec, follow=False)


def write_calibration(ledger: dict, where: Path) -> Path:
    """ledger.json (when it is not there already) and calibration.json in `where`."""
    from ..plan.ledger import LEDGER_FILE, calibration
    from ..runtime.checkpoint.disk import write_file_durably

    if not (where / LEDGER_FILE).is_file():
        write_file_durably(where / LEDGER_FILE, (json.dumps(ledger, indent=2) + "\n").encode())
    out = where / CALIBRATION_FILE
    write_file_durably(out, (json.dumps(calibration(ledger), indent=2, sort_keys=True) + "\n").encode())
    return out


def print_terms(doc: dict) -> None:
    """The calibration run's plan against what it measured, term by term."""
    pr, me, err = doc["predicted"], doc["measured"], doc["error"]
    gb = lambda b: "-" if b is None else f"{b / 1e9:.2f} GB"  # noqa: E731
    rows = [
        ["step time", seconds(pr["step_seconds"]), seconds(me["step_seconds"]), _pct(err["step_seconds"])],
        ["MFU", f"{pr['mfu']:.3g}", "-" if me["mfu"] is None else f"{me['mfu']:.3g}", ""],
        [
            "checkpoint write",
            seconds(pr["checkpoint_write_seconds"]),
            "-" if me["checkpoint_write_seconds"] is None else seconds(me["checkpoint_write_seconds"]),
            _pct(err["checkpoint_write_seconds"]),
        ],
        *(
            [
                name,
                gb(pr[key]),
                gb(me[key]),
                _pct(err[key]) if me[key] is not None else "not measured (no GPU allocator)",
            ]
            for name, key in (("active peak / rank", "peak_bytes"), ("reserved peak / rank", "reserved_bytes"))
        ),
    ]
    for ln in table(["term", "planned", "measured", "difference"], rows, left=("term", "difference")):
        click.echo("  " + ln)


def print_calibrated_plan(recipe, p) -> None:
    """After `plan`'s own lines: which calibration it used, and what it changed."""
    from ..recipe.calibration import read_calibration

    path = recipe.resources.calibration
    doc = read_calibration(path)
    lay = doc["layout"]
    click.echo(
        click.style("calibration:", bold=True)
        + f" {path}: {doc['recipe']}, {doc['strategy']} {lay['precision']} on {doc['world_size']} x "
        f"{doc['accelerator']}, {doc['measured']['logged_steps']} steps measured"
    )
    print_terms(doc)
    assumed = doc["predicted"]["mfu"]
    before = p.step_seconds * recipe.resources.mfu / assumed
    line = f"  this plan: step time {seconds(before)} at the assumed MFU {assumed:.3g} -> {seconds(p.step_seconds)}"
    if p.steps is not None:
        ratio = before / p.step_seconds
        line += f"; total {duration(p.total_hours * ratio)} -> {duration(p.total_hours)}"
        if p.usd:
            line += f"; cost ${p.usd * ratio:,.0f} -> ${p.usd:,.0f}"
    click.echo(line)
    if doc["strategy"] != p.strategy or lay["precision"] != p.layout.precision:
        click.secho(
            f"  note: calibrated with {doc['strategy']} {lay['precision']}, this plan uses {p.strategy} "
            f"{p.layout.precision}: the measured MFU may not carry over (calibrate this layout)",
            fg="yellow",
        )


def print_accuracy(paths: list[str]) -> None:
    from ..plan.ledger import accuracy, read_ledgers
    from ..recipe.calibration import CalibrationError

    ledgers = read_ledgers(paths or ["runs"])
    if not ledgers:
        raise CalibrationError(
            f"no run ledgers (ledger.json) under {', '.join(paths or ['runs'])}",
            "every run writes one in its run directory when it ends: name run directories, or the directory "
            "that holds them",
        )
    rows = [
        [r["strategy"], r["term"], str(r["runs"]), _pct(r["median_error"]), _pct(r["worst_error"])]
        for r in accuracy(ledgers)
    ]
    click.echo(f"plan against measurement over {len(ledgers)} run(s) (error = measured / planned - 1):")
    for ln in table(["strategy", "term", "runs", "median", "worst"], rows, left=("strategy", "term")):
        click.echo("  " + ln)


@click.command("calibrate")
@click.argument("recipe_path", metavar="RECIPE")
@TARGET
@OVERRIDE
@click.option("--steps", type=click.IntRange(4), default=30, show_default=True, help="Steps the run trains.")
@click.option("--nodes", type=click.IntRange(1), default=1, show_default=True, help="Nodes it runs on.")
@click.option("-o", "--out", "out_dir", default=None, help="Where the run's files go (as `up -o`).")
@click.option(
    "--from",
    "from_dir",
    default=None,
    metavar="RUN_DIR|LOG",
    help="Submit nothing: write the calibration from a run that already ended: its run directory (ledger.json) or "
    "its log (`dtlaunch logs NAME > LOG`, a SkyPilot job's: the ledger is its last line from dtlaunch).",
)
@click.pass_context
def calibrate_cmd(ctx, recipe_path, target, overrides, steps, nodes, out_dir, from_dir):
    """Run the recipe briefly on its own hardware and target; write what it measured (step time, MFU, peak
    memory, checkpoint write time) to a calibration file for `plan --calibration`."""
    from ..recipe.calibration import CalibrationError, read_calibration
    from .rendering import out_dir_for, up_cmd

    if from_dir is None:
        recipe, _ = load(recipe_path, overrides)
        sets, said = calibration_overrides(recipe, steps, nodes)
        sets, cut = fit_depth(recipe_path, [*overrides, *sets])
        said += [cut] if cut else []
        cal, _ = load(recipe_path, sets)
        out = out_dir_for(cal, target or cal.targets.default, out_dir)
        click.echo(f"calibrating {recipe.name}: {'; '.join(said)}")
        try:  # `up` itself, its other options at their defaults (click fills them in)
            ctx.invoke(
                up_cmd,
                recipe_path=recipe_path,
                target=target,
                overrides=tuple(sets),
                out_dir=str(out),
                detach=False,
                fresh=True,
            )
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        if rc != 0:
            raise CalibrationError(
                f"the calibration run ended with exit code {rc}: nothing was calibrated",
                f"read its log (dtlaunch logs {cal.job_name}) and fix the recipe; `dtlaunch up` fails the same way",
            )
        ledger, where = find_ledger(out, _job_log(cal.job_name))
    else:
        ledger, where = find_ledger(Path(from_dir))
    path = write_calibration(ledger, where)
    doc = read_calibration(path)
    click.echo(f"wrote {path}")
    print_terms(doc)
    click.echo(
        f"use it: dtlaunch plan {recipe_path} --calibration {path}\n"
        f"    or in the recipe: resources:\n      calibration: {path}"
    )


def register(cli: click.Group) -> None:
    cli.add_command(calibrate_cmd)
