"""`dtlaunch`: thin click commands over recipe -> plan -> render -> backend.

Importing this module must stay cheap: no torch, deepspeed, sky, submitit or paramiko here, and rich is
imported only by the commands that draw tables.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from . import __version__
from .errors import DtlaunchError, RecipeError

OVERRIDE = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                        help="Override a recipe field, e.g. --set training.steps=100 (repeatable).")


def _load(path: str, overrides=()):
    from .plan import make_plan
    from .recipe import load

    recipe = load(path, list(overrides))
    return recipe, make_plan(recipe)


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f}"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dtlaunch")
def cli():
    """Plan, validate, render and launch distributed training from one recipe YAML."""


@cli.command()
@click.argument("recipe_path", metavar="RECIPE")
@OVERRIDE
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (a stable contract).")
@click.option("--sweep", "sweeps", multiple=True, metavar="KEY=V1,V2",
              help="Plan every combination, one line each, e.g. --sweep resources.nodes=1,2,4 (repeatable).")
def plan(recipe_path, overrides, as_json, sweeps):
    """Show per-GPU memory for each strategy, the chosen one and why, step time, total time and cost."""
    if sweeps:
        return _plan_sweep(recipe_path, overrides, sweeps, as_json)
    recipe, p = _load(recipe_path, overrides)
    d = p.to_dict()
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    shape = recipe.model.shape()
    model = recipe.model.preset or ("custom" if shape else "params-only")
    con.print(f"[bold]{recipe.name}[/]: {model}, {p.params / 1e9:.2f}B parameters, seq {p.seq_len}, "
              f"{p.nodes} node(s) x {p.gpus_per_node} {p.accelerator} = {p.world_size} devices")
    t = Table(title=f"Per-device memory, GB (1e9 bytes), of {_gb(p.memory.gpu)} GB")
    for col in ("strategy", "weights", "grads", "optim", "activ", "buffers", "total", "fits"):
        t.add_column(col, justify="right" if col not in ("strategy", "fits") else "left", no_wrap=True)
    lay = p.layout
    for name, m in p.candidates:
        chosen = name == p.strategy
        t.add_row(("* " if chosen else "  ") + name, _gb(m.params), _gb(m.grads), _gb(m.optimizer),
                  _gb(m.activations), _gb(m.buffers), _gb(m.total), "yes" if m.fits else "no",
                  style="bold green" if chosen else None)
    con.print(t)
    con.print("* = chosen")
    con.print(f"layout: strategy={lay.strategy} dp={lay.dp} tp={lay.tp} pp={lay.pp} precision={lay.precision} "
              f"activation_checkpointing={lay.activation_checkpointing} offload={lay.offload}")
    con.print(f"batch: micro {lay.micro_batch} x dp {lay.dp} x grad_accum {p.grad_accum} = global {p.global_batch} "
              f"sequences ({p.tokens_per_step:,} tokens/step)")
    con.print("[bold]why:[/]")
    for r in p.reasons:
        con.print(f"  - {r}")
    for n in p.notes:
        con.print(f"  [yellow]note:[/] {n}")
    con.print(f"time: {p.flops_per_step:.3g} FLOPs/step, {p.step_seconds:.3g} s/step at MFU {recipe.resources.mfu}, "
              f"{p.steps:,} steps = {p.total_hours:,.1f} h")
    con.print(f"cost: ${p.usd:,.0f} ({p.world_size} x {p.total_hours:,.1f} h x ${recipe.resources.device().usd_per_hour}/h)")
    con.print(f"checkpoint: every {p.checkpoint_every} steps (write ~{p.checkpoint_write_seconds:.1f} s"
              + (", Young/Daly)" if recipe.checkpoint.every == "auto" else ")"))


def _plan_sweep(recipe_path, overrides, sweeps, as_json):
    from .plan import make_plan
    from .recipe import load
    from .sweep import expand

    rows = []
    for combo in expand(sweeps):
        p = make_plan(load(recipe_path, list(overrides) + combo))
        d = p.to_dict()
        rows.append({"overrides": combo, **d})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        m = r["memory"]
        click.echo(f"{' '.join(r['overrides']):50s} {r['strategy']:13s} tp={r['tp']} pp={r['pp']} dp={r['dp']:<5d} "
                   f"ac={r['activation_checkpointing']:9s} {m['total'] / 1e9:7.1f} GB {'fits' if m['fits'] else 'NO FIT'} "
                   f"{r['time']['total_hours']:10.1f} h ${r['cost']['usd']:,.0f}")


@cli.command()
@click.argument("recipe_paths", metavar="RECIPE...", nargs=-1, required=True)
@OVERRIDE
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
def validate(recipe_paths, overrides, fmt):
    """Check recipes for known sharp edges. Exit 1 if any error is found (usable in CI)."""
    from .validate import has_errors
    from .validate import validate as run_rules

    results, failed = [], False
    for path in recipe_paths:
        try:
            recipe, p = _load(path, overrides)
        except RecipeError as e:
            failed = True
            results.append({"file": path, "ok": False, "findings": [
                {"rule": "recipe", "severity": "error", "field": pr["field"], "line": pr.get("line"),
                 "message": pr["message"], "fix": pr.get("fix")} for pr in e.problems]})
            continue
        findings = run_rules(recipe, p)
        failed |= has_errors(findings)
        results.append({"file": path, "ok": not has_errors(findings), "findings": [f.to_dict() for f in findings]})
    if fmt == "json":
        click.echo(json.dumps(results, indent=2))
    else:
        for res in results:
            if not res["findings"]:
                click.echo(f"{res['file']}: ok")
            for f in res["findings"]:
                where = res["file"] + (f":{f['line']}" if f.get("line") else "")
                click.echo(f"{where}: {f['severity']} [{f['rule']}] {f['field']}: {f['message']}")
                if f.get("fix"):
                    click.echo(f"    fix: {f['fix']}")
    sys.exit(1 if failed else 0)


SWEEP = click.option("--sweep", "sweeps", multiple=True, metavar="KEY=V1,V2",
                     help="SLURM: one array task per combination, e.g. --sweep training.seed=1,2,3 (repeatable).")


def _render(recipe_path, overrides, target, sweeps=()):
    from .render import render as do_render

    recipe, p = _load(recipe_path, overrides)
    target = target or recipe.targets.default
    if not sweeps:
        return recipe, p, do_render(recipe, p, target)
    if target != "slurm":
        raise DtlaunchError("--sweep renders a SLURM array job; use --target slurm (or run one `up` per setting)")
    from .render.slurm import render_slurm_array
    from .sweep import expand

    items = [_load(recipe_path, list(overrides) + combo) for combo in expand(sweeps)]
    return recipe, p, render_slurm_array(items)


@cli.command()
@click.argument("recipe_path", metavar="RECIPE")
@click.option("--target", "-t", type=click.Choice(["local", "slurm", "sky"]), default=None,
              help="Default: the recipe's targets.default.")
@click.option("-o", "--out", "out_dir", default=None, help="Output directory (default: rendered/<job name>-<target>).")
@OVERRIDE
@SWEEP
@click.option("--quiet", "-q", is_flag=True, help="Only list the files written.")
def render(recipe_path, target, out_dir, overrides, sweeps, quiet):
    """Write the artifacts a user can run by hand (never submits)."""
    recipe, p, art = _render(recipe_path, overrides, target, sweeps)
    out = art.write(out_dir or Path("rendered") / f"{art.job_name}-{art.target}")
    for rel, content in art.files.items():
        if not quiet and rel != "plan.json":
            click.echo(f"# ---- {out / rel}")
            click.echo(content.rstrip("\n"))
    click.echo(f"wrote {', '.join(str(out / f) for f in art.files)}")
    click.echo(f"submit by hand: cd {out} && {' '.join(art.submit_command)}")


@cli.command()
@click.argument("recipe_path", metavar="RECIPE")
@click.option("--target", "-t", type=click.Choice(["local", "slurm", "sky"]), default=None)
@OVERRIDE
@click.option("-o", "--out", "out_dir", default=None, help="Where the job's files go (local: the run directory).")
@click.option("--dry-run", is_flag=True, help="Render and print the submit command without submitting.")
@click.option("--detach/--wait", default=None, help="Return after submitting, or stream logs until the job ends.")
@click.option("--force", is_flag=True, help="Submit even if validate finds errors.")
@SWEEP
def up(recipe_path, target, overrides, out_dir, dry_run, detach, force, sweeps):
    """Validate, render and submit a job; record it so status/logs/down can follow it."""
    from .targets import backend
    from .targets.registry import Registry
    from .validate import has_errors
    from .validate import validate as run_rules

    recipe, p, art = _render(recipe_path, overrides, target, sweeps)
    findings = run_rules(recipe, p)
    for f in findings:
        click.echo(f"{f.severity} [{f.rule}] {f.field}: {f.message}\n    fix: {f.fix}", err=True)
    if has_errors(findings) and not force:
        raise DtlaunchError(f"{recipe_path}: validation failed; fix the errors above (or pass --force)")
    if out_dir is None:
        out_dir = (Path(recipe.targets.local.run_dir) / art.job_name) if art.target == "local" else (
            Path("rendered") / f"{art.job_name}-{art.target}")
    out = art.write(out_dir)
    if dry_run:
        click.echo(f"# ---- {out / art.entrypoint}")
        click.echo(art.files[art.entrypoint].rstrip("\n"))
        click.echo(f"dry run: wrote {out}; would run in it: {' '.join(art.submit_command)}")
        return
    wait = (not detach) if detach is not None else art.target == "local"
    be = backend(art.target)
    rec = be.submit(art, str(out), wait=wait)
    Registry().add(rec)
    click.echo(f"submitted {rec.name} ({art.target} job {rec.job_id}); files in {rec.run_dir}")
    if wait and hasattr(be, "wait"):
        rc = be.wait(rec)
        click.echo(f"{rec.name}: {be.status(rec)['state']} (exit code {rc})")
        sys.exit(rc)


@cli.command()
@click.argument("job", required=False)
@click.option("--json", "as_json", is_flag=True)
def status(job, as_json):
    """Show the state of one job (by name or id), or of all recorded jobs."""
    from .targets import backend
    from .targets.registry import Registry

    reg = Registry()
    recs = [reg.find(job)] if job else reg.all()
    rows = []
    for r in recs:
        try:
            st = backend(r.target).status(r)
        except DtlaunchError as e:
            st = {"state": "UNKNOWN", "detail": str(e)}
        rows.append({"name": r.name, "target": r.target, "job_id": r.job_id, "run_dir": r.run_dir, **st})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no jobs recorded yet (dtlaunch up RECIPE)")
    for row in rows:
        extra = f" exit={row['exit_code']}" if row.get("exit_code") is not None else ""
        click.echo(f"{row['name']}\t{row['target']}:{row['job_id']}\t{row['state']}{extra}\t{row['run_dir']}")


@cli.command()
@click.argument("job")
@click.option("-f", "--follow", is_flag=True, help="Keep streaming until the job ends.")
def logs(job, follow):
    """Print a job's output."""
    from .targets import backend
    from .targets.registry import Registry

    rec = Registry().find(job)
    try:
        for line in backend(rec.target).logs(rec, follow=follow):
            click.echo(line, nl=False)
    except KeyboardInterrupt:
        pass


@cli.command()
@click.argument("job")
def down(job):
    """Cancel a job (it gets SIGTERM first, so it can checkpoint)."""
    from .targets import backend
    from .targets.registry import Registry

    rec = Registry().find(job)
    backend(rec.target).cancel(rec)
    click.echo(f"cancelled {rec.name} ({rec.target} job {rec.job_id})")


@cli.command()
def schema():
    """Print the recipe's JSON Schema (for editors' YAML completion)."""
    from .recipe import json_schema

    click.echo(json.dumps(json_schema(), indent=2))


@cli.command()
@click.argument("run")
@click.option("-o", "--out", "out_png", default=None, help="PNG path (default: RUN/loss.png).")
def plot(run, out_png):
    """Draw the loss curve of a run directory (or its metrics.jsonl) as a PNG."""
    run_path = Path(run)
    if not run_path.exists():
        from .targets.registry import Registry

        run_path = Path(Registry().find(run).run_dir)
    try:
        from .plot import plot_metrics
    except ImportError as e:
        raise DtlaunchError(f"plotting needs matplotlib: pip install 'dtlaunch[train]' ({e})") from None
    out = out_png or str((run_path if run_path.is_dir() else run_path.parent) / "loss.png")
    plot_metrics(str(run_path), out)
    click.echo(f"wrote {out}")


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except DtlaunchError as e:
        click.secho(f"error: {e}", fg="red", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # a bug of ours: one line, and the traceback only on request
        if os.environ.get("DTLAUNCH_DEBUG"):
            raise
        click.secho(f"internal error: {type(e).__name__}: {e} (set DTLAUNCH_DEBUG=1 for the traceback, and please report it)",
                    fg="red", err=True)
        sys.exit(70)


if __name__ == "__main__":
    main()
