"""`plan`, `validate` and `schema`: what fits and why, and what would go wrong, before any GPU is paid for."""
from __future__ import annotations

import json
import sys

import click

from ..errors import RecipeError
from .common import OVERRIDE, TARGET, load, print_finding


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f}"  # the table's unit is in its title


def _print_plan(recipe, p) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..plan.memory import NOT_MODELLED

    con = Console()
    shape = recipe.model.shape()
    model = recipe.model.preset or ("custom" if shape else "params-only")
    con.print(f"[bold]{recipe.name}[/]: {model}, {p.params / 1e9:.2f}B parameters, seq {p.seq_len}, "
              f"{p.nodes} node(s) x {p.gpus_per_node} {p.accelerator} = {p.world_size} devices")
    t = Table(title=f"Per-device memory, GB (1e9 bytes), of {_gb(p.memory.gpu)} GB")
    for col in ("strategy", "weights", "grads", "optim", "activ", "buffers", "total", "fits"):
        t.add_column(col, justify="right" if col not in ("strategy", "fits") else "left", no_wrap=True)
    for name, m in p.candidates:
        chosen = name == p.strategy
        t.add_row(("* " if chosen else "  ") + name, _gb(m.params), _gb(m.grads), _gb(m.optimizer),
                  _gb(m.activations), _gb(m.buffers), _gb(m.total), "yes" if m.fits else "no",
                  style="bold green" if chosen else None)
    con.print(t)
    con.print("* = chosen")
    lay = p.layout
    extra = (" sequence_parallel" if lay.tp > 1 and lay.sequence_parallel else "") + \
        (f" pipeline_schedule={lay.pp_schedule}" if lay.pp > 1 else "")
    con.print(f"layout: strategy={lay.strategy} dp={lay.dp} tp={lay.tp} pp={lay.pp}{extra} precision={lay.precision} "
              f"activation_checkpointing={lay.activation_checkpointing} offload={lay.offload}")
    con.print(f"batch: micro {lay.micro_batch} x dp {lay.dp} x grad_accum {p.grad_accum} = global {p.global_batch} "
              f"sequences ({p.tokens_per_step:,} tokens/step)")
    con.print("[bold]why:[/]")
    for r in p.reasons:
        con.print(f"  - {r}")
    for n in p.notes:
        con.print(f"  [yellow]note:[/] {n}")
    step = f"time: {p.flops_per_step:.3g} FLOPs/step, {p.step_seconds:.3g} s/step at MFU {recipe.resources.mfu}"
    if p.steps is None:
        con.print(step + "; total time and cost need a training length (training.steps or training.tokens)")
    else:
        con.print(step + f", {p.steps:,} steps = {p.total_hours:,.1f} h")
        con.print(f"cost: ${p.usd:,.0f} ({p.world_size} x {p.total_hours:,.1f} h x "
                  f"${recipe.resources.device().usd_per_hour}/h)")
    con.print(f"checkpoint: every {p.checkpoint_every} steps (write ~{p.checkpoint_write_seconds:.1f} s"
              + (", Young/Daly)" if recipe.checkpoint.every == "auto" else ")"))
    con.print("not modelled: " + "; ".join(n.split(" (")[0] for n in NOT_MODELLED)
              + " (memory and time figures leave them out). GB = 1e9 bytes; mixed-precision Adam states 16 "
              "bytes/param (+4 in DeepSpeed's optimizer step).", highlight=False)


def _plan_sweep(recipe_path, overrides, sweeps, as_json):
    from ..sweep import expand

    rows = []
    for combo in expand(sweeps):
        _, p = load(recipe_path, list(overrides) + combo)
        rows.append({"overrides": combo, **p.to_dict()})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        m = r["memory"]
        length = (f"{r['time']['total_hours']:10.1f} h ${r['cost']['usd']:,.0f}" if r["steps"] is not None
                  else "  (no training length)")
        click.echo(f"{' '.join(r['overrides']):50s} {r['strategy']:13s} tp={r['tp']} pp={r['pp']} dp={r['dp']:<5d} "
                   f"ac={r['activation_checkpointing']:9s} {m['total'] / 1e9:7.1f} GB "
                   f"{'fits' if m['fits'] else 'NO FIT'} {length}")


@click.command("plan")
@click.argument("recipe_path", metavar="RECIPE")
@OVERRIDE
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (a stable contract).")
@click.option("--sweep", "sweeps", multiple=True, metavar="KEY=V1,V2",
              help="Plan every combination, one line each, e.g. --sweep resources.nodes=1,2,4 (repeatable).")
@click.option("--trace", "trace", is_flag=True,
              help="Also run the runtime's own model and FSDP2 wrapping for this plan on fake tensors under "
                   "PyTorch's memory tracker, and compare it with the estimate term by term (needs torch).")
@click.option("--compare", "compare", type=click.Choice(["deepspeed"]), default=None,
              help="Also print DeepSpeed's own ZeRO memory estimators for this layout beside the planner's "
                   "figures, with the reason for each difference (needs DeepSpeed).")
def plan_cmd(recipe_path, overrides, as_json, sweeps, trace, compare):
    """Show per-GPU memory for each strategy, the chosen one and why, step time, total time and cost."""
    if sweeps:
        if trace or compare:
            raise click.UsageError("--trace and --compare check one plan: drop --sweep, or pick the combination "
                                   "with --set")
        return _plan_sweep(recipe_path, overrides, sweeps, as_json)
    recipe, p = load(recipe_path, overrides)
    if as_json:
        d = p.to_dict()
        if recipe.targets.sky.accelerators:  # only then: the plain `plan --json` contract stays as it was
            from .choices import choices_json

            d["sky_accelerators"] = choices_json(recipe, p)
        if trace:
            from . import tracing

            d["trace"] = tracing.run(recipe, p).to_dict()
        if compare:
            from . import compare as cmp  # imports deepspeed (and torch): only for this flag

            d["compare"] = {"deepspeed": cmp.compare(recipe, p).to_dict()}
        click.echo(json.dumps(d, indent=2))
        return
    _print_plan(recipe, p)
    if recipe.targets.sky.accelerators:
        from .choices import print_choices

        print_choices(recipe, p)
    if trace:  # after the plan, so that a plan that cannot be traced is still shown
        from . import tracing

        tracing.print_comparison(tracing.run(recipe, p))
    if compare:
        from . import compare as cmp  # imports deepspeed (and torch): only for this flag

        cmp.print_comparison(cmp.compare(recipe, p))


@click.command("validate")
@click.argument("recipe_paths", metavar="RECIPE...", nargs=-1, required=True)
@OVERRIDE
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
@TARGET
def validate_cmd(recipe_paths, overrides, fmt, target):
    """Check recipes for known sharp edges. Exit 1 if any error is found (usable in CI)."""
    from ..validate import has_errors
    from ..validate import validate as run_rules

    results, failed = [], False
    for path in recipe_paths:
        try:
            recipe, p = load(path, overrides)
        except RecipeError as e:
            failed = True
            results.append({"file": path, "ok": False, "findings": [
                {"rule": "recipe", "severity": "error", "field": pr.field, "message": pr.message, "fix": pr.fix,
                 "file": pr.file, "line": pr.line} for pr in e.problems]})
            continue
        findings = run_rules(recipe, p, target)
        failed |= has_errors(findings)
        results.append({"file": path, "ok": not has_errors(findings), "target": target or recipe.targets.default,
                        "findings": [f.to_dict() for f in findings]})
    if fmt == "json":
        click.echo(json.dumps(results, indent=2))
    else:
        from types import SimpleNamespace

        for res in results:
            if not res["findings"]:
                click.echo(f"{res['file']}: ok")
            for f in res["findings"]:
                print_finding(SimpleNamespace(**f), res["file"])
    sys.exit(1 if failed else 0)


@click.command("schema")
def schema_cmd():
    """Print the recipe's JSON Schema (for editors' YAML completion)."""
    from ..recipe import json_schema

    click.echo(json.dumps(json_schema(), indent=2))


def register(cli: click.Group) -> None:
    for cmd in (plan_cmd, validate_cmd, schema_cmd):
        cli.add_command(cmd)
