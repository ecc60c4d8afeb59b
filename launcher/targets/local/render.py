"""The local target: one node, torchrun with c10d rendezvous on loopback, restarts on failure.

Unlike a cluster job, the interpreter that rendered the script is the right default here (same machine).
"""

from __future__ import annotations

import sys

from ...jobenv import ATTEMPT, RUN_DIR
from ...plan import Plan
from ...recipe import Recipe
from ...render.artifacts import Artifacts
from ...render.code import CODE_DIR
from ...render.environment import checkpoint_template, job_env
from ...render.shell import ShellExpr, exported_or
from ...render.templates import render_template
from ...render.torchrun import entry_args, torchrun_command
from .request import LocalRequest

SCRIPT = "launch.sh"
SETUP_HINT = "set DTLAUNCH_PYTHON to the python of an environment that has dtlaunch[train] (or activate it)"


def launch_script(recipe: Recipe, plan: Plan, python: str | None = None) -> str:
    cmd = torchrun_command(
        recipe,
        plan,
        python=ShellExpr("$PYTHON"),
        nnodes="1",
        nproc_per_node=str(plan.gpus_per_node),
        rdzv_endpoint=ShellExpr("127.0.0.1:$PORT"),
        rdzv_id=ShellExpr("$DTLAUNCH_RUN_ID"),
        max_restarts=recipe.targets.local.max_restarts,
        is_host="1",
        local_addr="127.0.0.1",
        entry=entry_args(recipe, ShellExpr("$DTLAUNCH_PLAN"), ShellExpr("$DTLAUNCH_RUN_DIR")),
        check_plan=ShellExpr("$DTLAUNCH_PLAN"),
    )
    return render_template(
        "local_launch.sh.j2",
        env=job_env(recipe),
        default_run_id=recipe.run_id or recipe.job_name,
        checkpoint_template=checkpoint_template(recipe),
        secrets=recipe.secrets,
        setup_hint=SETUP_HINT,
        default_python=python or sys.executable,
        torchrun=cmd,
        # an exported run directory or attempt (`dtlaunch up` names the attempt) wins over these defaults
        run_dir=exported_or(RUN_DIR, "$HERE"),
        plan_file=ShellExpr("$HERE/plan.json"),
        attempt=exported_or(ATTEMPT, "manual-$(date +%s)-$$"),
        code_dir=ShellExpr(f"$HERE/{CODE_DIR}") if recipe.entrypoint else None,
    )


def render_local(recipe: Recipe, plan: Plan, files: dict[str, str | bytes], *, choices=None) -> Artifacts:
    files = {**files, SCRIPT: launch_script(recipe, plan)}
    return Artifacts("local", recipe.job_name, files, LocalRequest(SCRIPT, tuple(recipe.secrets)), {SCRIPT})
