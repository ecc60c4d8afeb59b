"""`dtlaunch rehearse`: the recipe's layout trained here, scaled down (launcher.plan.rehearsal), before any GPU is
paid for. Each run is a real local job (the local target's launch.sh, torchrun, gloo ranks), and the checks are
what a layout must do:

- parity: its first losses are those of one rank training the same model on the same data;
- preemption: a USR2 at a step ends the job with 42 after a committed checkpoint;
- reshard: that checkpoint resumes into another layout (data parallel only, the same ranks), which is preempted in
  turn, and the recipe's layout resumes from it and finishes: every loss after a resume is the one-rank run's;
- hang: a rank that stops answering ends the job with 43 within the collective timeout;
- world: the recipe's own layout at its full size, every rank on a fake process group (no process per rank): each
  rank's place in the mesh, one step's collectives and its memory traced against the plan.

Exit 0 only when every check passes (1 otherwise); `--json` prints the same for CI.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..jobenv import FAULT, MEMTRACK_DIR, TRACK_MEMORY, ExitCode, read_metrics
from .common import OVERRIDE, load, table

if TYPE_CHECKING:
    from ..plan.rehearsal import Rehearsal

# Test-only: a fault (launcher.runtime.inject's syntax) for every run of the rehearsal's layout, so that a test or
# a drill can break the layout on purpose and see which check catches it.
REHEARSAL_FAULT = "DTLAUNCH_REHEARSAL_FAULT"
HANG_TIMEOUT_S = 8  # the hang run's training.timeout_seconds


@dataclass
class Run:
    name: str
    rc: int
    losses: dict[int, float]
    saved: list[int]  # steps of the committed checkpoints
    resumed_from: int | None
    seconds: float
    log: Path  # the job's log
    dir: Path  # its run directory


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    runs: list[str] = field(default_factory=list)


def run_one(root: Path, name: str, data: dict, fault: str | None = None, track: int | None = None) -> Run:
    """One local job of recipe `data` in root/name, started and followed to its end by the local target's own
    backend (not recorded in the registry); its exit code and what it logged."""
    from ..prepare import check, prepare
    from ..recipe.loading import load_data
    from ..targets.local.backend import LocalBackend

    recipe = load_data(copy.deepcopy(data), f"<rehearsal {name}>")
    prep = prepare(recipe, (), "local")
    check(prep, False, "rehearsed")
    d = prep.artifacts.write(root / name, origin="up")
    env = {k: v for k, v in os.environ.items() if k not in (FAULT, TRACK_MEMORY)}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if fault:
        env[FAULT] = fault
    if track is not None:
        env[TRACK_MEMORY] = str(track)
    t0 = time.monotonic()
    backend = LocalBackend(cwd=str(d))
    rec = backend.submit(prep.artifacts, str(d), env)
    with open(os.devnull, "w") as quiet:  # the log stays in the run directory; the rehearsal prints its table
        rc = backend.wait(rec, stream=quiet)
    recs = read_metrics(d) if (d / "metrics.jsonl").exists() else []
    losses = {int(r["step"]): float(r["loss"]) for r in recs if "event" not in r and "loss" in r}
    saved = [int(r["step"]) for r in recs if r.get("event") == "checkpoint"]
    resumed = [int(r["step"]) for r in recs if r.get("event") == "resume" and "step" in r]
    log = Path(rec.handle.log)
    return Run(name, rc, losses, saved, resumed[0] if resumed else None, time.monotonic() - t0, log, d)


def _worst(run: Run, control: Run, steps) -> tuple[float, int | None]:
    worst, at = 0.0, None
    for s in steps:
        if s not in run.losses or s not in control.losses:
            return float("inf"), s
        d = abs(run.losses[s] - control.losses[s])
        if d > worst:
            worst, at = d, s
    return worst, at


def _code(rc: int) -> str:
    return f"{rc} ({ExitCode.name_of(rc)})"


CHECKS = ("parity", "preemption", "reshard", "memory", "hang", "world")
TRACKED_STEP = 2  # the first step with the optimizer's states: the peak of every later step


def _join(*faults: str | None) -> str | None:
    return ";".join(f for f in faults if f) or None


def rehearse(recipe, plan, root: Path, max_ranks: int, only: tuple[str, ...] = CHECKS) -> tuple[Rehearsal, list[Check]]:
    from ..plan.rehearsal import FIRST, PARITY_TOL, STEPS, scale_down

    r = scale_down(recipe, plan, max_ranks)
    fault = os.environ.get(REHEARSAL_FAULT)
    checks: list[Check] = []
    control = None
    if {"parity", "reshard"} & set(only):
        control = run_one(root, "control", r.control)
        if control.rc != 0 or len(control.losses) < STEPS:
            checks.append(Check("control", False, f"the one-rank run ended {_code(control.rc)}: see {control.log}"))
            return r, checks
    if {"parity", "preemption", "reshard", "memory"} & set(only):
        # USR2 at the last step a check asks for (an 8-rank step takes seconds on a CPU): the preemption and the
        # reshard a step past the checkpoint at FIRST, parity its FIRST steps, the memory check its traced step
        stop_at = TRACKED_STEP
        if "parity" in only:
            stop_at = FIRST
        if {"preemption", "reshard"} & set(only):
            stop_at = FIRST + 1
        first = run_one(
            root,
            "layout",
            _chained(r.layout, root),
            _join(f"signal:rank=0:step={stop_at}:sig=USR2", fault),
            track=TRACKED_STEP if "memory" in only else None,
        )
        if control is not None:
            worst, at = _worst(first, control, range(1, FIRST + 1))
            checks.append(
                Check(
                    "parity",
                    worst <= PARITY_TOL,
                    f"steps 1-{FIRST}: largest loss difference from one rank {worst:.2e} (step {at}), tolerance "
                    f"{PARITY_TOL:.0e}",
                    [first.name, control.name],
                )
            )
        checks.append(
            Check(
                "preemption",
                first.rc == ExitCode.PREEMPTED and bool(first.saved),
                f"USR2 at step {stop_at}: exit {_code(first.rc)}, "
                + (f"checkpoint at step {first.saved[-1]}" if first.saved else "no checkpoint committed"),
                [first.name],
            )
        )
        if "memory" in only:
            checks.append(_memory(r, first))
        if "reshard" in only and control is not None:
            checks.append(_reshard(r, root, control, first, fault))
    if "hang" in only:
        checks.append(_hang(r, root, fault))
    if "world" in only:
        checks.append(world(recipe, plan))
    return r, [c for c in checks if c.name in only]


def world(recipe, plan, coords=None) -> Check:
    """The recipe's own layout at its full world size, on a fake process group in this process: every rank's place
    in the mesh (launcher.trace.world), then one step of the full-width model traced (launcher.trace): its
    collectives and its memory against the plan's. `coords`: see check_mesh."""
    from ..trace import TraceError
    from ..trace.report import per_step
    from ..trace.world import check_mesh
    from . import tracing

    layout, _ = plan.layout.for_world(plan.world_size)
    mesh = check_mesh(layout, plan.world_size, recipe.resources.per_node, coords)
    detail = f"{plan.world_size} ranks as {mesh.describe()}: " + (
        "each rank once, where the runtime places it, every tensor group inside a node"
        if mesh.ok
        else "; ".join(mesh.problems[:3]) + (f" (and {len(mesh.problems) - 3} more)" if len(mesh.problems) > 3 else "")
    )
    try:
        c = tracing.run(recipe, plan)
    except TraceError as e:
        return Check("world", mesh.ok, f"{detail}; the step not traced: {e.message}")
    calls = per_step(c.traced.collectives, layout.grad_accum)
    sizes = [v for v in mesh.shape.values() if v > 1]
    dim = {v: f" ({k})" for k, v in mesh.shape.items() if v > 1 and sizes.count(v) == 1}
    said = ", ".join(f"{n} {kind} over {ranks} ranks{dim.get(ranks, '')}" for (kind, ranks), n in calls.items())
    peak = next(r for r in c.rows if r.term == "total")
    agree = not c.warnings
    return Check(
        "world",
        mesh.ok and agree,
        f"{detail}; one step ({layout.grad_accum} micro-steps) calls {said or 'no collective'}; its memory at full "
        f"size: {peak.traced / 1e9:.2f} GB traced at the {c.peak_traced}, {peak.planned / 1e9:.2f} GB planned "
        f"({peak.planned / peak.traced:.3f})" + ("" if agree else f": {'; '.join(c.warnings)}"),
    )


def _memory(r, run: Run) -> Check:
    """The plan's tensors at its peak moment for the rehearsal layout against what each rank counted (PyTorch's
    MemTracker on the real tensors of step TRACKED_STEP), the largest rank against the plan's largest."""
    from ..plan import make_plan
    from ..plan.rehearsal import MEMORY_TOL
    from ..recipe.loading import load_data

    planned = make_plan(load_data(copy.deepcopy(r.layout), "<rehearsal>")).memory.active
    counted = []
    for f in sorted((run.dir / MEMTRACK_DIR).glob("rank-*.json")):
        doc = json.loads(f.read_text())
        counted.append(max(kinds.get("Total", 0) for kinds in doc["peak"].values()))
    if len(counted) != r.nproc:
        return Check("memory", False, f"{len(counted)} of {r.nproc} ranks counted their tensors: see {run.log}")
    err = max(counted) / planned - 1
    return Check(
        "memory",
        abs(err) <= MEMORY_TOL,
        f"step {TRACKED_STEP}'s peak, the largest rank: {max(counted) / 1e6:.2f} MB counted, {planned / 1e6:.2f} MB "
        f"planned ({err:+.1%}; tolerance {MEMORY_TOL:.0%})",
        [run.name],
    )


def _chained(data: dict, root: Path) -> dict:
    """The run with the rehearsal's one checkpoint directory: each layout resumes from the one before."""
    return {**data, "checkpoint": {**data["checkpoint"], "dir": str(root / "checkpoints")}}


def _reshard(r, root: Path, control: Run, first: Run, fault: str | None) -> Check:
    from ..plan.rehearsal import RESUME_TOL, STEPS

    stop2 = STEPS - 1
    other = run_one(root, "resharded", _chained(r.other, root), f"signal:rank=0:step={stop2}:sig=USR2")
    back = run_one(root, "layout-again", _chained(r.layout, root), fault)
    resumed = [x for x in (other, back) if x.losses]
    steps = sorted({s for x in resumed for s in x.losses})
    worst = max((_worst(x, control, sorted(x.losses))[0] for x in resumed), default=float("inf"))
    continues = (
        other.resumed_from == (first.saved[-1] if first.saved else None)
        and back.resumed_from == (other.saved[-1] if other.saved else None)
        and back.rc == 0
        and max(back.losses, default=0) == STEPS
    )
    return Check(
        "reshard",
        continues and worst <= RESUME_TOL,
        f"layout -> data parallel ({r.other['parallelism']['strategy']}, {r.nproc} ranks) -> layout: resumed "
        f"at steps {other.resumed_from} and {back.resumed_from}, exit {_code(back.rc)}; steps "
        f"{steps[0] if steps else '-'}-{steps[-1] if steps else '-'} within {worst:.2e} of one rank "
        f"(tolerance {RESUME_TOL:.0e})",
        [other.name, back.name],
    )


def _hang(r, root: Path, fault: str | None) -> Check:
    hang_data = copy.deepcopy(r.layout)
    hang_data["training"]["timeout_seconds"] = HANG_TIMEOUT_S
    hung = run_one(root, "hang", hang_data, _join(f"hang:rank={r.nproc - 1}:step=2", fault))
    return Check(
        "hang",
        hung.rc == ExitCode.HANG,
        f"rank {r.nproc - 1} stops at step 2: exit {_code(hung.rc)} after {hung.seconds:.0f} s "
        f"(collective timeout {HANG_TIMEOUT_S} s)",
        [hung.name],
    )


@click.command("rehearse")
@click.argument("recipe_path", metavar="RECIPE")
@OVERRIDE
@click.option("--max-ranks", type=click.IntRange(1, 64), default=8, show_default=True, help="CPU ranks at most.")
@click.option(
    "-o",
    "--out",
    "out_dir",
    default=None,
    help="Keep the rehearsal's runs here (default: a temporary directory, removed when every check passes).",
)
@click.option(
    "--only",
    "only",
    multiple=True,
    type=click.Choice(CHECKS),
    help="Run only these checks (repeatable); parity and preemption share one run.",
)
@click.option("--json", "as_json", is_flag=True, help="The checks as JSON.")
def rehearse_cmd(recipe_path, overrides, max_ranks, out_dir, only, as_json):
    """Train the recipe's layout scaled down on this machine's CPU and check it: loss parity with one rank,
    preemption, a reshard into another layout and back, a hang. Exit 0 only when every check passes."""
    import shutil
    import tempfile

    recipe, plan = load(recipe_path, overrides)
    root = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="dtlaunch-rehearse-"))
    root.mkdir(parents=True, exist_ok=True)
    if not as_json:
        click.echo(
            f"rehearsing {recipe.name} ({plan.strategy}, tp {plan.layout.tp} x pp {plan.layout.pp} x dp "
            f"{plan.layout.dp} on {plan.world_size} {plan.accelerator}) in {root}"
        )
    r, checks = rehearse(recipe, plan, root, max_ranks, tuple(only) or CHECKS)
    ok = all(c.ok for c in checks)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "recipe": recipe.name,
                    "ok": ok,
                    "ranks": r.nproc,
                    "degrees": r.degrees,
                    "full": r.full,
                    "changes": r.changes,
                    "checks": [c.__dict__ for c in checks],
                    "dir": str(root),
                },
                indent=2,
            )
        )
    else:
        d = r.degrees
        click.echo(f"rehearsal layout: tp {d['tp']} x pp {d['pp']} x dp {d['dp']} = {r.nproc} CPU ranks; changed:")
        for c in r.changes:
            click.echo(f"  - {c}")
        rows = [["pass" if c.ok else "FAIL", c.name, c.detail] for c in checks]
        styles = [None if c.ok else {"fg": "red", "bold": True} for c in checks]
        for ln in table(
            ["", "check", "what was measured"], rows, left=("", "check", "what was measured"), styles=styles
        ):
            click.echo("  " + ln)
    if ok and not out_dir:
        shutil.rmtree(root, ignore_errors=True)
    elif not ok and not as_json:
        click.echo(f"the runs' files and logs: {root}")
    sys.exit(0 if ok else 1)


def register(cli: click.Group) -> None:
    cli.add_command(rehearse_cmd)
