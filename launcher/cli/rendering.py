"""`render` and `up`: the artifacts a user can run by hand, and submitting exactly those."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import DtlaunchError
from ..prepare import check, prepare
from .common import OVERRIDE, SWEEP, TARGET


def _notes(art) -> None:
    for n in art.notes:
        click.echo(f"note: {n}", err=True)


@click.command("render")
@click.argument("recipe_path", metavar="RECIPE")
@TARGET
@click.option("-o", "--out", "out_dir", default=None, help="Output directory (default: rendered/<job name>-<target>).")
@OVERRIDE
@SWEEP
@click.option("--show", is_flag=True, help="Also print the scripts and the task file.")
@click.option("--force", is_flag=True, help="Render even if validate finds errors.")
def render_cmd(recipe_path, target, out_dir, overrides, sweeps, show, force):
    """Write the artifacts a user can run by hand (never submits)."""
    prep = prepare(recipe_path, overrides, target, sweeps)
    check(prep, force, "rendered")
    art = prep.artifacts
    out = art.write(out_dir or Path("rendered") / f"{art.job_name}-{art.target}", origin="render")
    if show:
        for rel in art.files:
            text = art.text(rel)
            if text is not None and rel != "plan.json":
                click.echo(f"# ---- {out / rel}")
                click.echo(text.rstrip("\n"))
    _notes(art)
    click.echo(
        f"wrote {len(art.files)} files to {out}: {', '.join(sorted(art.files)[:8])}"
        + (" ..." if len(art.files) > 8 else "")
    )
    click.echo(f"submit by hand: cd {out} && {' '.join(art.submit_command)}")


def _after(recipe_path, overrides, target, after) -> str:
    """`--after JOB...` as a --set item: the recipe's dependency plus afterok on each job. A name is looked up
    in the registry, and must be a SLURM job on the cluster this recipe submits to (job ids are per cluster)."""
    from ..recipe import load as load_recipe
    from ..targets.registry import Registry
    from ..targets.slurm.syntax import parse_dependency

    recipe = load_recipe(recipe_path, list(overrides))
    if (target or recipe.targets.default) != "slurm":
        raise DtlaunchError("--after chains SLURM jobs", fix="use --target slurm")
    host = recipe.targets.slurm.ssh.host if recipe.targets.slurm.ssh else None
    ids = []
    for key in after:
        if key.replace("_", "").isdigit():
            ids.append(key)
            continue
        rec = Registry().find(key)
        rec_host = (rec.handle.ssh or {}).get("host") if rec.target == "slurm" else None
        if rec.target != "slurm":
            raise DtlaunchError(
                f"--after {key}: that is a {rec.target} job; SLURM can only wait for SLURM jobs",
                fix="chain SLURM jobs, or wait for it yourself",
            )
        if rec_host != host:
            there, here = ("to " + rec_host if rec_host else "here"), ("to " + host if host else "here")
            raise DtlaunchError(
                f"--after {key}: job {rec.job_id} was submitted {there}, this one goes {here}: job ids are per cluster",
                fix="chain jobs on the same cluster",
            )
        ids.append(rec.job_id)
    existing = recipe.targets.slurm.dependency
    if existing and "?" in existing:
        raise DtlaunchError(
            f"targets.slurm.dependency {existing!r} is 'any of' (?); --after adds 'all of' (,), and "
            "SLURM allows one kind per job",
            fix="write the whole dependency in the recipe instead",
        )
    dep = ",".join(x for x in (existing, "afterok:" + ":".join(ids)) if x)
    try:
        parse_dependency(dep)
    except ValueError as e:
        raise DtlaunchError(f"--after: {e}") from None
    return f"targets.slurm.dependency={dep}"


def out_dir_for(recipe, target: str, out_dir=None) -> Path:
    """Where `up` puts a job's files."""
    if out_dir is not None:
        return Path(out_dir)
    if target == "local":  # the run directory itself: a second `up` resumes the same run
        return Path(recipe.targets.local.run_dir) / recipe.job_name
    return Path(recipe.targets.local.run_dir) / f"{recipe.job_name}-{target}"


def _completed_step(recipe, plan, out: Path, run_id: str) -> int | None:
    """The newest committed checkpoint of the run in `out` when it is at or past the recipe's last step (the run
    is complete: another attempt would train nothing); None when there is more to train or no checkpoint here."""
    from ..runtime.checkpoint import disk

    if plan.steps is None or "{run_id}" in (recipe.checkpoint.dir or "") and not run_id:
        return None
    root = disk.expand_dir(recipe.checkpoint.dir, out.resolve(), run_id)
    done = disk.complete_steps(root)
    return done[-1] if done and done[-1] >= plan.steps else None


def _start_over(recipe, art, out: Path, run_id: str) -> str:
    """`up --fresh`: set the run's history in `out` (checkpoints under it, metrics, status, logs, plots) aside in
    out/previous/<time>, and give a checkpoint.dir outside `out` a new run id; returns what was done. Nothing
    is deleted. A fixed checkpoint.dir outside `out` cannot be started over without losing it: refused."""
    import os
    import time

    from ..jobenv import RUN_ID
    from ..render.artifacts import MANIFEST, read_manifest
    from ..runtime.checkpoint import disk

    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = disk.expand_dir(recipe.checkpoint.dir, out.resolve(), run_id)
    said = []
    if not root.resolve().is_relative_to(out.resolve()) and root.is_dir():
        if "{run_id}" not in (recipe.checkpoint.dir or ""):
            raise DtlaunchError(
                f"--fresh: checkpoint.dir {recipe.checkpoint.dir} holds this run's checkpoints and names no "
                "{run_id}: a new run there would resume the old one",
                fix=f"move {root} aside first, or put {{run_id}} in checkpoint.dir",
            )
        new_id = f"{run_id}-{stamp}"
        os.environ[RUN_ID] = new_id  # the job script takes an exported run id over its default
        said.append(f"new run id {new_id} (the old checkpoints stay in {root})")
    rendered, _ = read_manifest(out)
    keep = {MANIFEST, "previous"} | {f.split("/")[0] for f in rendered}
    history = [p for p in sorted(out.iterdir()) if p.name not in keep] if out.is_dir() else []
    if history:
        aside = out / "previous" / stamp
        aside.mkdir(parents=True)
        for p in history:
            p.rename(aside / p.name)
        said.append(f"the previous run's {', '.join(p.name for p in history)} moved to {aside}")
    return "; ".join(said) or "nothing to set aside"


@click.command("up")
@click.argument("recipe_path", metavar="RECIPE")
@TARGET
@OVERRIDE
@click.option(
    "-o",
    "--out",
    "out_dir",
    default=None,
    help="Where the job's files go (default: runs/<job name> locally, runs/<job name>-<target> otherwise).",
)
@click.option("--dry-run", is_flag=True, help="Render and say what would be submitted, without submitting.")
@click.option("--show", is_flag=True, help="With --dry-run: also print the job script.")
@click.option(
    "--detach/--wait",
    default=None,
    help="Return after submitting, or stream the log until the job ends (default: wait for local jobs, "
    "detach from SLURM and SkyPilot).",
)
@click.option("--force", is_flag=True, help="Submit even if validate finds errors.")
@click.option(
    "--fresh",
    is_flag=True,
    help="Start the run over from step 0: the previous run's checkpoints, metrics and logs are kept, moved to "
    "OUT/previous/<time> (or, for a checkpoint.dir with {run_id}, left under a new run id).",
)
@SWEEP
@click.option(
    "--after",
    "after",
    multiple=True,
    metavar="JOB",
    help="SLURM: start only after JOB (a recorded job's name, or a job id) completed successfully, e.g. an "
    "evaluation after its training run (adds afterok:ID to targets.slurm.dependency; repeatable).",
)
def up_cmd(recipe_path, target, overrides, out_dir, dry_run, show, detach, force, fresh, sweeps, after):
    """Validate, render and submit a job; record it so status/logs/down can follow it."""
    from ..render.artifacts import read_manifest
    from ..targets import backend
    from ..targets.local.backend import claim_run_dir
    from ..targets.registry import Registry

    again = _again(recipe_path, target, out_dir, overrides)
    if after:
        overrides = (*overrides, _after(recipe_path, overrides, target, after))
    prep = prepare(recipe_path, overrides, target, sweeps)
    check(prep, force, "submitted")
    recipe, art = prep.recipe, prep.artifacts
    out = out_dir_for(recipe, art.target, out_dir)
    registry = Registry()
    if not dry_run:
        registry.check_writable()
    be = backend(art.target)
    # Before anything is written: a refused `up` changes nothing (a running job's torchrun restart would read a
    # rewritten plan). To submit, the check holds the directory's lock until the job is recorded: of two `up` at
    # once, one submits and the other is refused.
    run_id = recipe.run_id or art.job_name
    with claim_run_dir(out, registry, lock=not dry_run):
        done = None if fresh else _completed_step(recipe, prep.plan, out, run_id)
        if done is not None:
            click.echo(
                f"{out}: this run is complete (its newest checkpoint is step {done:,}, the recipe trains "
                f"{prep.plan.steps:,} steps); nothing to train, nothing submitted.\n"
                f"  to train further: raise training.steps, e.g. {again('--set', f'training.steps={2 * prep.plan.steps}')}\n"
                f"  to start over from step 0, keeping this run's files: {again('--fresh')}"
            )
            return
        if fresh and not dry_run:
            click.echo(f"--fresh: {_start_over(recipe, art, out, run_id)}")
        _, origin = read_manifest(out)
        if origin == "render":
            click.echo(
                f"note: replacing the files `dtlaunch render` wrote in {out} (use -o for another directory)", err=True
            )
        out = art.write(out, origin="up")
        _notes(art)
        if dry_run:
            if show:
                click.echo(f"# ---- {out / art.entrypoint}")
                click.echo((art.text(art.entrypoint) or "").rstrip("\n"))
            p = prep.plan
            click.echo(
                f"dry run: {art.target} job {art.job_name}: {p.strategy} on {p.world_size} ranks "
                f"({p.nodes} node(s) x {p.gpus_per_node} {p.accelerator})" + (f", {p.steps:,} steps" if p.steps else "")
            )
            click.echo(f"  wrote {len(art.files)} files to {out} (the entrypoint: {art.entrypoint}; --show prints it)")
            click.echo(f"  would run in it: {' '.join(art.submit_command)}")
            return
        rec = be.submit(art, str(out))
        try:
            registry.add(rec)
        except DtlaunchError as e:
            click.secho(
                f"warning: the job is running but could not be recorded ({e}); follow it by hand: "
                f"{art.target} job {rec.job_id}, files in {rec.run_dir}",
                fg="yellow",
                err=True,
            )
    click.echo(f"submitted {rec.name} ({art.target} job {rec.job_id}); files in {rec.run_dir}")
    wait = (not detach) if detach is not None else art.target == "local"
    if not wait:
        key = _key(registry, rec)
        click.echo(f"follow it: dtlaunch status {key}; dtlaunch logs -f {key}; stop it: dtlaunch down {key}")
        return
    rc = be.wait(rec)
    click.echo(f"{rec.name}: {be.status(rec).state} (exit code {rc})")
    sys.exit(rc)


def _again(recipe_path: str, target: str | None, out_dir: str | None, overrides: tuple[str, ...]):
    """This `up` command line again (its target, run directory and --set overrides) with more arguments: the
    hints `up` prints must act on this run, not on the recipe's default one. A training.steps given again
    replaces the one given here."""
    import shlex

    def line(*extra: str) -> str:
        steps = "training.steps=" if any(e.startswith("training.steps=") for e in extra) else None
        sets = [a for o in overrides if not (steps and o.startswith(steps)) for a in ("--set", o)]
        where = [*(["-t", target] if target else []), *(["-o", out_dir] if out_dir else [])]
        return shlex.join(["dtlaunch", "up", recipe_path, *where, *sets, *extra])

    return line


def _key(registry, rec) -> str:
    """How to name this job to status/logs/down: its name, unless jobs in other run directories have it too."""
    try:
        if len({r.run_dir for r in registry.matching(rec.name)}) <= 1:
            return rec.name
    except DtlaunchError:  # not recorded (up said so): its name is all there is
        return rec.name
    try:
        return "./" + str(Path(rec.run_dir).relative_to(Path.cwd()))
    except ValueError:
        return rec.run_dir


def register(cli: click.Group) -> None:
    cli.add_command(render_cmd)
    cli.add_command(up_cmd)
