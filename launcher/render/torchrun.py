"""The one launch command every target runs, with the per-target values filled in."""

from __future__ import annotations

import math

from ..plan import Plan
from ..recipe import Recipe
from .shell import ShellExpr, Word, flag

TRAIN_MODULE = "launcher.runtime.train"
ENTRY_MODULE = "launcher.runtime.entry"  # runs the user's entrypoint and records its exit code for the job scripts
# torchrun passes these to its workers and then shuts down without restarting them: TERM (cancel,
# scheduler preemption) and USR2 (the time-limit signal) both mean "checkpoint and stop".
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"
MIN_GRACE_SECONDS = 30  # torchrun's own default


# The planned step time is an estimate at an assumed MFU: a step may take this many times longer.
STEP_TIME_MARGIN = 2.0


def grace_seconds(recipe: Recipe, plan: Plan) -> int:
    """How long torchrun waits for workers to checkpoint and exit after a signal before it SIGKILLs them: the
    recipe's value, or what the worst case needs (the same margin validate asks of
    targets.slurm.signal_seconds): a signal just after a step began is acted on at the step's end, so a step
    (with a margin on the plan's estimate), then a checkpoint write, then 30 s for the exit; never less than
    torchrun's default. A rank SIGKILLed before it committed loses the step and writes no exit record."""
    g = recipe.checkpoint.grace_seconds
    if isinstance(g, int):
        return g
    need = STEP_TIME_MARGIN * plan.step_seconds + plan.checkpoint_write_seconds + 30
    return max(MIN_GRACE_SECONDS, math.ceil(need))


def entry_module(recipe: Recipe, plan_path: Word, run_dir: Word) -> tuple[str, list[Word]]:
    """(module every rank runs, its arguments): dtlaunch's trainer, or the user's entrypoint through
    launcher.runtime.entry (the script path is relative to the code directory the job scripts cd into)."""
    ep = recipe.entrypoint
    if ep is None:
        return TRAIN_MODULE, ["--plan", plan_path, "--run-dir", run_dir]
    target: list[Word] = ["--module", ep.module] if ep.module else [ep.script]
    return ENTRY_MODULE, [*target, *ep.args]


def entry_args(recipe: Recipe, plan_path: Word, run_dir: Word) -> list[Word]:
    """The worker command after torchrun's own flags: `-m MODULE ARGS...`."""
    module, args = entry_module(recipe, plan_path, run_dir)
    return ["-m", module, *args]


def torchrun_command(
    recipe: Recipe,
    plan: Plan,
    *,
    python: Word,
    nnodes: Word,
    nproc_per_node: Word,
    rdzv_endpoint: Word,
    rdzv_id: Word,
    max_restarts: int,
    is_host: Word,
    local_addr: Word,
    entry: list[Word],
    check_plan: Word | None = None,
) -> list[Word]:
    """c10d rendezvous with an explicit endpoint (never a silent localhost fallback), an explicit store host
    (`is_host`) and an explicit address for this node (`--local-addr`): torch's own guesses use the hostname,
    which on cloud images resolves to 127.0.1.1 and on some sites differs from the scheduler's node name, so
    no node would host the store, or the workers' store would be announced at an address others cannot
    reach. No --node-rank: with c10d the ranks are assigned at rendezvous. `check_plan`: the agent checks its
    node against that plan before it joins (launcher.runtime.elastic --check-plan)."""
    return [
        python,
        "-m",
        "launcher.runtime.elastic",
        *([flag("--check-plan", check_plan)] if check_plan is not None else []),
        flag("--nnodes", nnodes),
        flag("--nproc-per-node", nproc_per_node),
        "--rdzv-backend=c10d",
        flag("--rdzv-endpoint", rdzv_endpoint),
        flag("--rdzv-id", rdzv_id),
        ShellExpr(f"--rdzv-conf=join_timeout={int(recipe.training.init_timeout_seconds)},is_host={is_host}")
        if isinstance(is_host, ShellExpr)
        else f"--rdzv-conf=join_timeout={int(recipe.training.init_timeout_seconds)},is_host={is_host}",
        flag("--local-addr", local_addr),
        f"--max-restarts={int(max_restarts)}",
        f"--signals-to-handle={SIGNALS}",
        f"--shutdown-timeout={grace_seconds(recipe, plan)}",
        *entry,
    ]
