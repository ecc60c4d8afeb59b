"""The local target: one node, torchrun with c10d rendezvous on loopback, restarts on failure."""
from __future__ import annotations

import shlex
import sys

from ..recipe import Recipe
from .environment import job_env
from .shell import Sh, exports, join
from .torchrun import torchrun_command

HEADER = "#!/usr/bin/env bash\n# Rendered by dtlaunch for the local target. Run it: bash launch.sh\nset -euo pipefail\n"


def launch_script(recipe: Recipe, plan: dict, python: str | None = None) -> str:
    env = job_env(recipe)
    cmd = torchrun_command(
        python=Sh("$PYTHON"), nnodes="1", nproc_per_node=str(plan["gpus_per_node"]),
        rdzv_endpoint=Sh("127.0.0.1:$PORT"), rdzv_id=Sh("$DTLAUNCH_RUN_ID"),
        max_restarts=recipe.targets.local.max_restarts, plan_path=Sh("$HERE/plan.json"), run_dir=Sh("$DTLAUNCH_RUN_DIR"),
    )
    py = python or sys.executable
    return (
        HEADER
        + 'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
        + 'PYTHON="${DTLAUNCH_PYTHON:-}"\n'
        + f'if [ -z "$PYTHON" ]; then PYTHON={shlex.quote(py)}; fi\n'
        + exports(env) + "\n"
        + 'export DTLAUNCH_RUN_ID="${DTLAUNCH_RUN_ID:-$(basename "$HERE")}"\n'
        + 'export DTLAUNCH_RUN_DIR="${DTLAUNCH_RUN_DIR:-$HERE}"\n'
        # A free port, not 29500: another job on this machine may hold it (shared notes, pitfall 9).
        + 'PORT="${DTLAUNCH_PORT:-$("$PYTHON" -c \'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])\')}"\n'
        + "set +e\n"
        + join(cmd) + "\n"
        + 'rc=$?\necho "$rc" > "$DTLAUNCH_RUN_DIR/exit_code"\nexit "$rc"\n'
    )
