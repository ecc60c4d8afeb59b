"""`plan`, `validate` and `schema`: what fits and why, and what would go wrong, before any GPU is paid for."""

from __future__ import annotations

import json
import os
import sys

import click

from ..errors import RecipeError
from .calibrate import print_accuracy, print_calibrated_plan
from .common import OVERRIDE, TARGET, duration, load, print_finding, seconds, table


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f}"


def _unit(chosen_total: float) -> tuple[str, float]:
    """The memory table's unit: GB, or MB when the chosen layout needs under 1 GB (small and CPU models), where
    GB would print a column of 0.0s."""
    return ("GB", 1e9) if chosen_total >= 1e9 else ("MB", 1e6)


def count(n: float) -> str:
    """A parameter count as people write it: 70.6B, 1.2B, 0.6M, 12.3K."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale or (suffix == "M" and n >= 1e5):
            return f"{n / scale:.2f}B" if suffix == "B" else f"{n / scale:.1f}{suffix}"
    return f"{n:.0f}"


def model_name(recipe) -> str:
    """What the recipe trains: its preset, its Hugging Face model, its explicit shape, or only a size."""
    m = recipe.model
    if m.preset:
        return m.preset
    if m.hf:
        return str(m.hf).rstrip("/").split("/")[-1]
    shape = m.shape()
    if shape is not None:
        return f"{m.architecture or 'llama'}-style, {shape.layers} layers x {shape.hidden} hidden"
    return "params-only"


def host_memory_bytes() -> int | None:
    """This machine's memory (Linux), for CPU recipes: a CPU rank has the host's memory, not a device's."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _print_plan(recipe, p) -> None:
    from ..plan.memory import NOT_MODELLED

    echo = click.echo
    device = recipe.resources.device()
    echo(
        f"{click.style(recipe.name, bold=True)}: {model_name(recipe)}, {count(p.params)} parameters, "
        f"seq {p.seq_len}, {p.nodes} node(s) x {p.gpus_per_node} {p.accelerator} = {p.world_size} devices"
    )
    unit, scale = _unit(p.memory.total)

    def fig(b: float) -> str:
        return f"{b / scale:.1f}"

    echo(f"Per-device memory, {unit} (1e{len(str(int(scale))) - 1} bytes), of {fig(p.memory.gpu)} {unit}")
    host = None if device.is_gpu else host_memory_bytes()
    if host:
        echo(
            f"  (a CPU rank uses host memory: this machine has {host / 1e9:.1f} GB for its "
            f"{p.gpus_per_node} rank(s) per node; the {fig(p.memory.gpu)} {unit} above is the catalog's figure per rank)"
        )
    rows, styles = [], []
    for name, m in p.candidates:
        chosen = name == p.strategy
        rows.append(
            [
                ("* " if chosen else "  ") + name,
                fig(m.params),
                fig(m.grads),
                fig(m.optimizer),
                fig(m.activations),
                fig(m.buffers),
                fig(m.total),
                "yes" if m.fits else "no",
            ]
        )
        styles.append({"fg": "green", "bold": True} if chosen else None)
    for ln in table(
        ["strategy", "weights", "grads", "optim", "activ", "buffers", "total", "fits"],
        rows,
        left=("strategy", "fits"),
        styles=styles,
    ):
        echo("  " + ln)
    echo("* = chosen")
    lay = p.layout
    extra = (
        (" sequence_parallel" if lay.tp > 1 and lay.sequence_parallel else "")
        + (f" pipeline_schedule={lay.pp_schedule}" if lay.pp > 1 else "")
        + (" grad_reduce=once_per_step" if lay.reduces_once_per_step else "")
    )
    echo(
        f"layout: strategy={lay.strategy} dp={lay.dp} tp={lay.tp} pp={lay.pp}{extra} precision={lay.precision} "
        f"activation_checkpointing={lay.activation_checkpointing} offload={lay.offload}"
    )
    per_step = lay.micro_batch * lay.dp * p.grad_accum
    if per_step == p.global_batch:
        echo(
            f"batch: micro {lay.micro_batch} x dp {lay.dp} x grad_accum {p.grad_accum} = global {p.global_batch} "
            f"sequences ({p.tokens_per_step:,} tokens/step)"
        )
    else:  # the recipe's batch does not split: the product is not the global batch (the notes say why)
        echo(
            f"batch: micro {lay.micro_batch} x dp {lay.dp} x grad_accum {p.grad_accum} = {per_step} sequences per "
            f"step, "
            + click.style(f"not the recipe's global_batch {p.global_batch}", fg="red")
            + " (see the note below; validate refuses it)"
        )
    echo(click.style("why:", bold=True))
    for r in p.reasons:
        echo(f"  - {r}")
    for n in p.notes:
        echo(f"  {click.style('note:', fg='yellow')} {n}")
    mfu = f"MFU {recipe.resources.mfu:.3g}" + (" (measured)" if recipe.resources.calibration else "")
    step = f"time: {p.flops_per_step:.3g} FLOPs/step, {p.step_seconds:.3g} s/step at {mfu}"
    if p.steps is None:
        echo(step + "; total time and cost need a training length (training.steps or training.tokens)")
    else:
        echo(step + f", {p.steps:,} steps = {duration(p.total_hours)}")
        if device.usd_per_hour:
            echo(f"cost: ${p.usd:,.0f} ({p.world_size} x {p.total_hours:,.1f} h x ${device.usd_per_hour}/h)")
        else:
            echo(f"cost: none counted ({p.accelerator} has no hourly price in the catalog)")
    echo(
        f"checkpoint: every {p.checkpoint_every} steps (write ~{seconds(p.checkpoint_write_seconds)}"
        + (", Young/Daly)" if recipe.checkpoint.every == "auto" else ")")
    )
    echo(
        "not modelled: "
        + "; ".join(n.split(" (")[0] for n in NOT_MODELLED)
        + " (memory and time figures leave them out). GB = 1e9 bytes; mixed-precision Adam states 16 "
        "bytes/param (+4 in DeepSpeed's optimizer step)."
    )


def _plan_sweep(recipe_path, overrides, sweeps, as_json):
    from .sweep import expand

    rows = []
    for combo in expand(sweeps):
        _, p = load(recipe_path, list(overrides) + combo)
        rows.append({"overrides": combo, **p.to_dict()})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        m = r["memory"]
        length = (
            f"{r['time']['total_hours']:10.1f} h ${r['cost']['usd']:,.0f}"
            if r["steps"] is not None
            else "  (no training length)"
        )
        click.echo(
            f"{' '.join(r['overrides']):50s} {r['strategy']:13s} tp={r['tp']} pp={r['pp']} dp={r['dp']:<5d} "
            f"ac={r['activation_checkpointing']:9s} {m['total'] / 1e9:7.1f} GB "
            f"{'fits' if m['fits'] else 'NO FIT'} {length}"
        )


@click.command("plan")
@click.argument("args", nargs=-1, metavar="RECIPE | --accuracy [RUNS...]")
@OVERRIDE
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (a stable contract).")
@click.option(
    "--sweep",
    "sweeps",
    multiple=True,
    metavar="KEY=V1,V2",
    help="Plan every combination, one line each, e.g. --sweep resources.nodes=1,2,4 (repeatable).",
)
@click.option(
    "--trace",
    "trace",
    is_flag=True,
    help="Also run the runtime's own model and FSDP2 wrapping for this plan on fake tensors under "
    "PyTorch's memory tracker, and compare it with the estimate term by term (needs torch).",
)
@click.option(
    "--compare",
    "compare",
    type=click.Choice(["deepspeed"]),
    default=None,
    help="Also print DeepSpeed's own ZeRO memory estimators for this layout beside the planner's "
    "figures, with the reason for each difference (needs DeepSpeed).",
)
@click.option(
    "--calibration",
    "calibration",
    default=None,
    metavar="FILE",
    help="Time, cost and the checkpoint interval from a calibration file (`dtlaunch calibrate`) instead of the "
    "assumed MFU and storage rate; prints the calibration run's plan against what it measured.",
)
@click.option(
    "--accuracy",
    is_flag=True,
    help="Instead of a plan: the plan's error against measurement (memory, step time, checkpoint write; median "
    "and worst per strategy) over the ledgers of the runs named (run directories, or directories of runs; "
    "default: runs/).",
)
def plan_cmd(args, overrides, as_json, sweeps, trace, compare, calibration, accuracy):
    """Show per-GPU memory for each strategy, the chosen one and why, step time, total time and cost."""
    if accuracy:
        return print_accuracy(list(args))
    if len(args) != 1:
        raise click.UsageError("plan takes one RECIPE (or --accuracy and run directories)")
    (recipe_path,) = args
    if calibration:  # a path on the command line is the shell's, not the recipe's (as resources.calibration is)
        overrides = (*overrides, f"resources.calibration={os.path.abspath(calibration)}")
    if sweeps:
        if trace or compare:
            raise click.UsageError(
                "--trace and --compare check one plan: drop --sweep, or pick the combination with --set"
            )
        return _plan_sweep(recipe_path, overrides, sweeps, as_json)
    recipe, p = load(recipe_path, overrides)
    from ..validate import validate as run_rules

    # What validate would say, said by plan too (the same rules, the same exit code): a plan that "fits" must
    # not hide that `up` refuses the recipe, e.g. for a default the user never wrote.
    findings = run_rules(recipe, p, None)
    if as_json:
        return _plan_json(recipe, p, findings, trace, compare)
    _print_plan(recipe, p)
    if recipe.resources.calibration:
        print_calibrated_plan(recipe, p)
    if recipe.targets.sky.accelerators:
        from .choices import print_choices

        print_choices(recipe, p)
    if trace:  # after the plan, so that a plan that cannot be traced is still shown
        from . import tracing

        tracing.print_comparison(tracing.run(recipe, p))
    if compare:
        from . import compare as cmp  # imports deepspeed (and torch): only for this flag

        cmp.print_comparison(cmp.compare(recipe, p))
    _print_findings(recipe_path, findings)


def _plan_json(recipe, p, findings, trace, compare) -> None:
    from ..validate import has_errors

    d = p.to_dict()
    d["findings"] = [f.to_dict() for f in findings]
    if recipe.targets.sky.accelerators:  # only then: the plain `plan --json` contract stays as it was
        from .choices import choices_json

        d["sky_accelerators"] = choices_json(recipe, p)
    refused = None
    if trace:
        from ..trace import TraceError
        from . import tracing

        try:
            d["trace"] = tracing.run(recipe, p).to_dict()
        except TraceError as e:  # the plan still goes to stdout, as in text mode; the error and exit code follow
            d["trace"], refused = {"refused": e.message, "fix": e.fix}, e
    if compare and refused is None:
        from . import compare as cmp  # imports deepspeed (and torch): only for this flag

        d["compare"] = {"deepspeed": cmp.compare(recipe, p).to_dict()}
    click.echo(json.dumps(d, indent=2))
    if refused is not None:
        raise refused
    if has_errors(findings):
        sys.exit(1)


def _print_findings(recipe_path: str, findings: list) -> None:
    """validate's findings after the plan, on stderr (stdout stays the plan); exit 1 on an error, as validate."""
    from ..validate import has_errors

    if not findings:
        return
    click.echo("", err=True)
    for f in findings:
        print_finding(f, recipe_path, err=True)
    if has_errors(findings):
        click.echo(
            click.style("validate refuses this recipe", fg="red", bold=True)
            + ": `up` and `render` would stop here; the fix lines above say what to change",
            err=True,
        )
        sys.exit(1)


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
            results.append(
                {
                    "file": path,
                    "ok": False,
                    "findings": [
                        {
                            "rule": "recipe",
                            "severity": "error",
                            "field": pr.field,
                            "message": pr.message,
                            "fix": pr.fix,
                            "file": pr.file,
                            "line": pr.line,
                        }
                        for pr in e.problems
                    ],
                    "more": e.more,
                }
            )
            continue
        findings = run_rules(recipe, p, target)
        failed |= has_errors(findings)
        results.append(
            {
                "file": path,
                "ok": not has_errors(findings),
                "target": target or recipe.targets.default,
                "findings": [f.to_dict() for f in findings],
            }
        )
    if fmt == "json":
        click.echo(json.dumps(results, indent=2))
    else:
        from types import SimpleNamespace

        for res in results:
            if not res["findings"]:
                click.echo(f"{res['file']}: ok")
            for f in res["findings"]:
                print_finding(SimpleNamespace(**f), res["file"])
            if res.get("more"):
                click.echo(f"{res['file']}: ... and {res['more']} more problem(s) not listed")
    sys.exit(1 if failed else 0)


@click.command("schema")
def schema_cmd():
    """Print the recipe's JSON Schema (for editors' YAML completion)."""
    from ..recipe import json_schema

    click.echo(json.dumps(json_schema(), indent=2))


def register(cli: click.Group) -> None:
    for cmd in (plan_cmd, validate_cmd, schema_cmd):
        cli.add_command(cmd)
