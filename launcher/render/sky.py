"""The SkyPilot target: one task YAML that `sky launch` (or `sky jobs launch`) accepts as it is.

The YAML is the stable contract (field lessons: the SDK's arguments churn between releases), so all
of SkyPilot's knowledge lives here as text; `targets/sky.py` only hands the file over.

Layout on every node: SkyPilot syncs the workdir (by default the rendered directory itself: plan.json,
recipe.yaml, ds_config.json) and runs `setup` then `run` in it. Recipe values reach the shell only
through `shell.quote`; environment values travel in `envs:` (SkyPilot exports them), never in `run`.
Secrets are listed by name with no value and supplied with `--secret NAME` from the submitting shell.
"""
from __future__ import annotations

import os

import yaml

from .. import __version__, exitcodes
from ..catalog import NETWORKS
from ..plan import Plan
from ..plan.memory import ZERO_FAMILY
from ..recipe import Recipe
from .artifacts import Artifacts
from .environment import job_env
from .shell import Sh, Word, flag, join, quote
from .torchrun import TRAIN_MODULE, torchrun_command

DEFAULT_PORT = 29500
JOB_MOUNT = "~/dtlaunch-job"  # where the rendered files land when the workdir is the user's project


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (setup, run) as literal blocks, so the YAML reads like the script it holds."""


def _str(dumper: yaml.SafeDumper, s: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)


def is_managed(recipe: Recipe) -> bool:
    """Spot capacity only makes sense with recovery, so spot implies a managed job."""
    return recipe.targets.sky.managed or recipe.targets.sky.spot


def infra(recipe: Recipe) -> str | None:
    """`infra: cloud[/region[/zone]]` (SkyPilot >= 0.10 spelling), from `infra` or cloud/region/zone."""
    sk = recipe.targets.sky
    if sk.infra:
        return sk.infra
    parts = [sk.cloud or "*", sk.region or "*", sk.zone or ""]
    while parts and parts[-1] in ("", "*"):
        parts.pop()
    return "/".join(parts) or None


def resources(recipe: Recipe) -> dict:
    res, sk = recipe.resources, recipe.targets.sky
    out: dict = {}
    if res.device().is_gpu:
        out["accelerators"] = res.accelerator
    else:  # SkyPilot has no "cpu" accelerator: ask for vCPUs instead, one rank per requested core
        out["cpus"] = f"{res.per_node}+"
    tier = NETWORKS[res.network].sky_network_tier
    if tier == "best":
        out["network_tier"] = "best"
    where = infra(recipe)
    if where:
        out["infra"] = where
    if sk.spot:
        out["use_spot"] = True
    out["disk_size"] = sk.disk_size
    if is_managed(recipe):
        out["job_recovery"] = {
            # Spot capacity vanishes region-wide; on-demand failures are usually one bad node.
            "strategy": "EAGER_NEXT_REGION" if sk.spot else "FAILOVER",
            "max_restarts_on_errors": sk.max_restarts_on_errors,
            "recover_on_exit_codes": list(exitcodes.RESTARTABLE),
        }
    return out


def envs(recipe: Recipe) -> dict[str, str]:
    env = job_env(recipe)
    env.update({"DTLAUNCH_TARGET": "sky", "DTLAUNCH_RECIPE_HASH": recipe.digest(), "DTLAUNCH_PORT": str(DEFAULT_PORT)})
    return env


def setup_script(recipe: Recipe, plan: Plan) -> str:
    """Install what the job needs. A workdir holding the dtlaunch project is installed from source;
    otherwise the same dtlaunch version that rendered the plan comes from PyPI (the plan format matches)."""
    lines = [
        "set -e",
        'if [ -f pyproject.toml ] && grep -q \'^name = "dtlaunch"\' pyproject.toml; then',
        "  " + join(["pip", "install", "-e", ".[train]"]),
        "else",
        "  " + join(["pip", "install", f"dtlaunch[train]=={__version__}"]),
        "fi",
    ]
    if plan.strategy in ZERO_FAMILY or recipe.parallelism.launcher == "deepspeed":
        lines.append(join(["pip", "install", "deepspeed>=0.15"]))
    if recipe.parallelism.launcher == "deepspeed" and recipe.resources.nodes > 1:
        # The head-only launch reaches the other nodes with pdsh over SkyPilot's ssh keys.
        lines.append("command -v pdsh >/dev/null || { sudo apt-get update -q && sudo apt-get install -y -q pdsh; }")
    lines += list(recipe.targets.sky.setup)  # the user's own shell lines (module load, apt, ...), verbatim
    return "\n".join(lines) + "\n"


def _preamble(recipe: Recipe, job_dir: str) -> list[str]:
    """Head address, run id and run dir: derived explicitly, failing fast (field lessons: rendezvous)."""
    return [
        "set -uo pipefail",
        f"JOB_DIR={job_dir}",
        'MASTER_ADDR="$(echo "$SKYPILOT_NODE_IPS" | head -n1)"',
        'if [ -z "$MASTER_ADDR" ]; then',
        '  echo "dtlaunch: SKYPILOT_NODE_IPS is empty: no head-node address for the rendezvous" >&2',
        f"  exit {exitcodes.PREFLIGHT}",
        "fi",
        "export MASTER_ADDR",
        # The task id is stable across managed-job recoveries, so a recovered job resumes its own checkpoints.
        'export DTLAUNCH_RUN_ID="${SKYPILOT_TASK_ID:?SKYPILOT_TASK_ID is not set}"',
        'export DTLAUNCH_RUN_DIR="${DTLAUNCH_RUN_DIR:-$JOB_DIR/runs/$DTLAUNCH_RUN_ID}"',
        'mkdir -p "$DTLAUNCH_RUN_DIR"',
        f'PORT="${{DTLAUNCH_PORT:-{DEFAULT_PORT}}}"',
    ]


def _nproc(recipe: Recipe, plan: dict) -> Word:
    """GPUs per node from SkyPilot; on CPU nodes SkyPilot reports 0 GPUs, so the plan's count is used."""
    return Sh("$SKYPILOT_NUM_GPUS_PER_NODE") if recipe.resources.device().is_gpu else str(plan["gpus_per_node"])


def torchrun_run(recipe: Recipe, plan: dict, job_dir: str) -> str:
    cmd = torchrun_command(
        python="python", nnodes=Sh("$SKYPILOT_NUM_NODES"), nproc_per_node=_nproc(recipe, plan),
        rdzv_endpoint=Sh("$MASTER_ADDR:$PORT"), rdzv_id=Sh("$DTLAUNCH_RUN_ID"),
        max_restarts=recipe.targets.sky.max_restarts, plan_path=Sh("$JOB_DIR/plan.json"),
        run_dir=Sh("$DTLAUNCH_RUN_DIR"),
        # A survivor of a dead node waits this long to re-rendezvous, then fails so SkyPilot can recover
        # the whole job (torchrun's default is 600 s of idle GPUs).
        # No --node-rank: torch ignores it with c10d ("only used for static rdzv_backend"), ranks are
        # assigned at rendezvous (field lessons: rendezvous address).
        extra=(f"--rdzv-conf=join_timeout={recipe.training.init_timeout_seconds}",),
    )
    return "\n".join(_preamble(recipe, job_dir) + [
        'STARTED="$DTLAUNCH_RUN_DIR/.started.$SKYPILOT_NODE_RANK"',
        'touch "$STARTED"',
        join(cmd),
        "rc=$?",
        *_restartable_code(),
        'exit "$rc"',
    ]) + "\n"


def _restartable_code() -> list[str]:
    """torchrun exits 1 whatever its workers' codes were, which would hide PREEMPTED/HANG from SkyPilot's
    `recover_on_exit_codes`. The runtime also records each rank's code in RUN_DIR/status/rank-N.json:
    when this attempt's ranks ended with a restartable code, exit with it."""
    codes = "|".join(str(c) for c in exitcodes.RESTARTABLE)
    return [
        'if [ "$rc" -ne 0 ]; then',
        '  for f in "$DTLAUNCH_RUN_DIR"/status/rank-*.json; do',
        f'    if [ "$f" -nt "$STARTED" ] && grep -qE \'"code": ({codes})[^0-9]\' "$f"; then',
        f'      rc="$(grep -oE \'"code": ({codes})\' "$f" | grep -oE \'[0-9]+$\')"',
        "    fi",
        "  done",
        "fi",
    ]


def deepspeed_run(recipe: Recipe, plan: dict, job_dir: str) -> str:
    """Head-only DeepSpeed: rank 0 writes the hostfile and `.deepspeed_env` (the runner forwards only
    some variables to other nodes) and starts everyone over SkyPilot's ssh; other nodes exit 0.
    DTLAUNCH_DEEPSPEED_NO_SSH=1 instead runs `deepspeed --no_ssh --node_rank` on every node."""
    names = list(envs(recipe)) + ["DTLAUNCH_RUN_ID", "DTLAUNCH_RUN_DIR", "MASTER_ADDR"] + list(recipe.secrets)
    ds_args: list[Word] = [
        flag("--hostfile", Sh("$HOSTFILE")), flag("--master_addr", Sh("$MASTER_ADDR")), flag("--master_port", Sh("$PORT")),
        "--no_local_rank", "--module", TRAIN_MODULE,
        "--plan", Sh("$JOB_DIR/plan.json"), "--run-dir", Sh("$DTLAUNCH_RUN_DIR"),
    ]
    lines = _preamble(recipe, job_dir) + [
        f"NPROC={quote(_nproc(recipe, plan))}",
        'HOSTFILE="$DTLAUNCH_RUN_DIR/hostfile.$SKYPILOT_NODE_RANK"',
        'echo "$SKYPILOT_NODE_IPS" | awk -v n="$NPROC" \'NF {print $1 " slots=" n}\' > "$HOSTFILE"',
        "umask 077  # .deepspeed_env may hold secret values: owner-only",
        'ENVFILE="$(mktemp .deepspeed_env.XXXXXX)"  # written whole, then renamed: readers never see half',
        f"for k in {' '.join(names)}; do",
        '  if [ -n "${!k+x}" ]; then printf \'%s=%s\\n\' "$k" "${!k}" >> "$ENVFILE"; fi',
        "done",
        'mv -f "$ENVFILE" .deepspeed_env',
        "umask 022",
        'if [ "${DTLAUNCH_DEEPSPEED_NO_SSH:-0}" = "1" ]; then',
        "  " + join(["deepspeed", "--no_ssh", flag("--node_rank", Sh("$SKYPILOT_NODE_RANK")), *ds_args]),
        'elif [ "$SKYPILOT_NODE_RANK" = "0" ]; then',
        "  " + join(["deepspeed", *ds_args]),
        "else",
        '  echo "dtlaunch: node $SKYPILOT_NODE_RANK: the head node starts this node\'s workers over ssh"',
        "fi",
    ]
    return "\n".join(lines) + "\n"


def render_sky(recipe: Recipe, plan: Plan, files: dict[str, str]) -> Artifacts:
    sk = recipe.targets.sky
    pd = plan.to_dict()
    task: dict = {"name": recipe.job_name, "num_nodes": recipe.resources.nodes, "resources": resources(recipe)}
    if sk.workdir:  # the user's project is the workdir; the rendered files ride along as a mount
        task["workdir"] = os.path.abspath(os.path.expanduser(sk.workdir))
        task["file_mounts"] = {JOB_MOUNT: "."}
        job_dir = '"$HOME/dtlaunch-job"'
    else:  # the rendered directory is the workdir (submit_command runs in it)
        task["workdir"] = "."
        job_dir = '"$PWD"'
    task["envs"] = envs(recipe)
    if recipe.secrets:
        task["secrets"] = {name: None for name in recipe.secrets}  # names only; values come from --secret
    task["setup"] = setup_script(recipe, plan)
    ds_head = recipe.parallelism.launcher == "deepspeed"
    task["run"] = deepspeed_run(recipe, pd, job_dir) if ds_head else torchrun_run(recipe, pd, job_dir)

    header = ("# Rendered by dtlaunch for SkyPilot. Submit from this directory:\n#   "
              + join(_submit(recipe)) + "\n")
    out = dict(files)
    out["task.yaml"] = header + yaml.dump(task, Dumper=_Dumper, sort_keys=False, width=1000)
    notes = []
    if recipe.checkpoint.dir is None and (recipe.resources.nodes > 1 or is_managed(recipe)):
        notes.append("checkpoint.dir is not set: checkpoints stay on each node's disk and a recovered managed job "
                     "starts on fresh VMs; mount a bucket (file_mounts) and point checkpoint.dir at it")
    if recipe.secrets:
        notes.append("export " + ", ".join(recipe.secrets) + " in the submitting shell: `--secret NAME` reads them there")
    return Artifacts("sky", recipe.job_name, out, "task.yaml", _submit(recipe), set(), notes)


def _submit(recipe: Recipe) -> list[str]:
    secrets = [a for name in recipe.secrets for a in ("--secret", name)]
    if is_managed(recipe):
        return ["sky", "jobs", "launch", "-n", recipe.job_name, *secrets, "task.yaml"]
    return ["sky", "launch", "-c", recipe.job_name, *secrets, "task.yaml"]
