"""Plan -> an sbatch job script (job.sbatch) plus the per-node step script (step.sh). Pure: text only.

The job script is the contract with the cluster, so it is written to be read: every SLURM option is
an `#SBATCH` line, the environment is exported in plain sight, and the requeue/preemption logic is a
few shell lines with comments. What it guarantees (field lessons):

* the rendezvous address is the first node of the allocation, never a silent localhost fallback;
* USR2 (time limit, via `--signal=B:USR2@N`) reaches the batch shell, which forwards it to the
  training processes, not to torchrun (torchrun would die or restart the workers), then requeues;
* `scontrol requeue` restarts the script from the top with the same job id, so an attempts ledger,
  a failure ledger (crash loops stop after max_failures) and a `finished` flag keep a requeued job
  from training twice or forever;
* DTLAUNCH_RUN_ID is $SLURM_JOB_ID, stable across requeues, so checkpoints resume.

Secrets are passed by name only: sbatch's default `--export=ALL` hands the submitting shell's
exported environment to the job; the script only checks that each named secret is set.
"""
from __future__ import annotations

import re
import shlex
import sys
from typing import Optional, Sequence

from .. import exitcodes
from ..errors import DtlaunchError
from ..plan import Plan
from ..recipe import Recipe
from .artifacts import Artifacts
from .environment import job_env
from .shell import Sh, exports, join, quote
from .torchrun import torchrun_command

JOB_SCRIPT = "job.sbatch"
STEP_SCRIPT = "step.sh"
# Where a job keeps its ledgers and logs, relative to the submit directory. One directory per job id:
# a requeue keeps the id, so the ledgers survive it; a new submission starts clean.
JOBS_DIR = "jobs"
STATE_FILES = ("attempts", "requeues", "failures", "exit_codes", "state", "finished")

_SAFE_SBATCH = re.compile(r"^[A-Za-z0-9_.,:=@%/+\-\[\]]+$")


def sbatch_value(value: object) -> str:
    """Quote a value for an `#SBATCH` line.

    sbatch parses these lines itself (not the shell): it understands double quotes and backslash,
    not single quotes, and treats an unescaped `#` as a comment. A newline would start a new line of
    the script, so it is refused outright.
    """
    s = str(value)
    if "\n" in s or "\r" in s or "\x00" in s:
        raise DtlaunchError(f"SLURM option value {s!r} contains a newline; it cannot go into an #SBATCH line")
    if _SAFE_SBATCH.match(s):
        return s
    return '"' + re.sub(r'(["\\#])', r"\\\1", s) + '"'


def sbatch_directives(recipe: Recipe, plan: dict, array: Optional[str] = None) -> list[str]:
    t = recipe.targets.slurm
    res = recipe.resources
    opts: list[tuple[str, object]] = [
        ("job-name", recipe.job_name),
        ("nodes", plan["nodes"]),
        ("ntasks-per-node", 1),  # one torchrun per node; it spawns one process per device (field lessons)
    ]
    if res.device().is_gpu:
        opts.append(("gpus-per-node", plan["gpus_per_node"]))
    cpus = t.cpus_per_task or (None if res.device().is_gpu else plan["gpus_per_node"])
    if cpus:
        opts.append(("cpus-per-task", cpus))
    if t.mem is not None:
        opts.append(("mem", t.mem))
    opts.append(("time", t.time))
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(t, key):
            opts.append((key, getattr(t, key)))
    if array is not None:
        opts.append(("array", array))
    opts += [
        ("output", "%x-%j.out" if array is None else "%x-%A_%a.out"),  # relative: the submit directory
        ("open-mode", "append"),  # a requeued attempt appends instead of wiping the first one's output
        ("signal", f"B:USR2@{t.signal_seconds}"),  # B: the batch shell gets it and forwards it
    ]
    lines = [f"#SBATCH --{k}={sbatch_value(v)}" for k, v in opts]
    lines.append("#SBATCH --requeue")
    if t.exclusive:
        lines.append("#SBATCH --exclusive")
    for extra in t.extra_sbatch:
        extra = extra.strip()
        if not extra.startswith("-"):
            raise DtlaunchError(f"targets.slurm.extra_sbatch: {extra!r} is not an sbatch option (start it with --)")
        name, sep, val = extra.partition("=")
        lines.append(f"#SBATCH {sbatch_value(name)}" + (f"={sbatch_value(val)}" if sep else ""))
    return lines


def _python_lines(python: Optional[str]) -> str:
    py = python or sys.executable
    return (
        "# The interpreter: $DTLAUNCH_PYTHON, else the one that rendered this file if the node has it, else python3.\n"
        'PYTHON="${DTLAUNCH_PYTHON:-}"\n'
        f'if [ -z "$PYTHON" ]; then PYTHON={shlex.quote(py)}; [ -x "$PYTHON" ] || PYTHON="$(command -v python3)"; fi\n'
        "export PYTHON\n"
    )


def step_script(recipe: Recipe, plan: dict) -> str:
    """What srun runs once per node: torchrun, shielded from USR2, with the signal forwarded to its workers.

    torchrun must not get USR2 (its default action would kill it and orphan the workers), and a worker
    that exits 42 after checkpointing must not be restarted by torchrun. So torchrun starts with USR2
    ignored (inherited through exec; the workers install their own handler), and on USR2 this wrapper
    signals the workers, waits for them to exit, then stops torchrun before it can restart them, and
    exits 42. TERM is not a preemption here: srun --kill-on-bad-exit sends it to the healthy nodes when
    another node failed, so it must not turn a crash into "requeue me"; torchrun handles TERM itself.
    """
    cmd = torchrun_command(
        python=Sh("$PYTHON"), nnodes=Sh("$SLURM_NNODES"), nproc_per_node=str(plan["gpus_per_node"]),
        rdzv_endpoint=Sh("$MASTER_ADDR:$MASTER_PORT"), rdzv_id=Sh("$SLURM_JOB_ID"),
        max_restarts=recipe.targets.slurm.max_restarts, plan_path=Sh("$DTLAUNCH_PLAN"),
        run_dir=Sh("$DTLAUNCH_RUN_DIR"),
    )
    return f"""#!/usr/bin/env bash
# Rendered by dtlaunch: run by srun once per node (see {JOB_SCRIPT}). Not meant to be run by hand.
set -uo pipefail
PREEMPT=0
# USR2 is ignored in torchrun (and inherited by its workers until they install their own handler).
( trap '' USR2; exec {join(cmd)} ) &
TORCHRUN=$!
preempt() {{
  PREEMPT=1
  echo "dtlaunch[$(hostname)]: USR2: forwarding to the training processes, then stopping torchrun" >&2
  pkill -USR2 -P "$TORCHRUN" 2>/dev/null || true
  # Wait for the workers to checkpoint and exit (PREEMPTED={exitcodes.PREEMPTED}), then stop torchrun so
  # that it does not restart them.
  while pgrep -P "$TORCHRUN" >/dev/null 2>&1; do sleep 0.1; done
  kill -TERM "$TORCHRUN" 2>/dev/null || true
}}
trap preempt USR2
trap 'echo "dtlaunch[$(hostname)]: TERM: torchrun stops its workers" >&2' TERM
rc=0
while :; do
  wait "$TORCHRUN"; rc=$?
  kill -0 "$TORCHRUN" 2>/dev/null || break
done
if [ "$PREEMPT" = 1 ]; then exit {exitcodes.PREEMPTED}; fi
exit "$rc"
"""


def job_script(recipe: Recipe, plan: dict, *, python: Optional[str] = None, array: Optional[str] = None) -> str:
    t = recipe.targets.slurm
    env = job_env(recipe)
    plan_file = Sh("$SUBMIT_DIR/task-$SLURM_ARRAY_TASK_ID/plan.json") if array else Sh("$SUBMIT_DIR/plan.json")
    secrets = "".join(
        f'[ -n "${{{name}+x}}" ] || fail {exitcodes.CONFIG} {quote(f"secret {name} is not set: export it in the shell that runs sbatch (--export=ALL passes it)")}\n'
        for name in recipe.secrets
    )
    setup = "\n".join(t.setup)
    srun = [
        "srun", "--kill-on-bad-exit=1", "--wait=60", Sh("--nodes=$SLURM_NNODES"), Sh("--ntasks=$SLURM_NNODES"),
        "--ntasks-per-node=1", "bash", Sh("$SUBMIT_DIR/" + STEP_SCRIPT),
    ]
    return f"""#!/usr/bin/env bash
# Rendered by dtlaunch for SLURM. Submit from this directory: sbatch --parsable {JOB_SCRIPT}
{chr(10).join(sbatch_directives(recipe, plan, array))}
#
# Secrets ({', '.join(recipe.secrets) or 'none'}) are passed by name: sbatch's default --export=ALL copies the
# submitting shell's exported environment into the job. Their values never appear in this file.
set -uo pipefail
fail() {{ local rc=$1; shift; echo "dtlaunch: error: $*" >&2; exit "$rc"; }}
SUBMIT_DIR="${{SLURM_SUBMIT_DIR:-$PWD}}"
[ -n "${{SLURM_JOB_ID:-}}" ] || fail {exitcodes.CONFIG} "not inside a SLURM job: submit with sbatch {JOB_SCRIPT}"

# ---- job state: one directory per job id, kept across requeues (same id)
export DTLAUNCH_RUN_ID="$SLURM_JOB_ID"
export DTLAUNCH_RUN_DIR="$SUBMIT_DIR/{JOBS_DIR}/$SLURM_JOB_ID"
export DTLAUNCH_PLAN={quote(plan_file)}
STATE="$DTLAUNCH_RUN_DIR"
ATTEMPT="${{SLURM_RESTART_COUNT:-0}}"
mkdir -p "$STATE/logs" || fail 1 "cannot create $STATE"
if [ -e "$STATE/finished" ]; then
  echo "dtlaunch: job $SLURM_JOB_ID already finished; nothing to do (requeued after completion)"
  exit 0
fi
echo "$ATTEMPT $(date +%s) $(hostname) $SLURM_JOB_NODELIST" >> "$STATE/attempts"
echo RUNNING > "$STATE/state"
count() {{ [ -f "$1" ] && wc -l < "$1" || echo 0; }}

# ---- environment: loud failures, network profile, the recipe's env
{exports(env)}
{secrets}{_python_lines(python)}
# ---- setup lines from the recipe (targets.slurm.setup), run as written
{setup}

# ---- rendezvous: the first node of the allocation (no loopback fallback: each node would form its own world)
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
[ -n "$MASTER_ADDR" ] || fail {exitcodes.PREFLIGHT} "could not derive MASTER_ADDR from SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
echo "dtlaunch: job $SLURM_JOB_ID attempt $ATTEMPT on $SLURM_JOB_NODELIST; rendezvous $MASTER_ADDR:$MASTER_PORT"

# ---- preemption: USR2 (time limit) or TERM reaches this shell; forward USR2 to the training steps
SIGNALLED=""
on_signal() {{
  SIGNALLED="$1"
  echo "dtlaunch: got SIG$1: asking the training processes to checkpoint" >&2
  scancel --signal=USR2 "$SLURM_JOB_ID" 2>/dev/null || true  # every step, not this batch shell
}}
trap 'on_signal USR2' USR2
trap 'on_signal TERM' TERM

# ---- train: one torchrun per node (step.sh), output also kept per attempt
LOG="$STATE/logs/attempt-$ATTEMPT.log"
{join(srun)} > >(tee -a "$LOG") 2>&1 &
SRUN=$!
rc=0
while :; do
  wait "$SRUN"; rc=$?
  kill -0 "$SRUN" 2>/dev/null || break  # wait returns early when a trapped signal arrives
done
echo "$ATTEMPT $rc ${{SIGNALLED:-none}}" >> "$STATE/exit_codes"
echo "dtlaunch: training exited with $rc (signal: ${{SIGNALLED:-none}})"

requeue() {{
  echo REQUEUED > "$STATE/state"
  echo "dtlaunch: requeueing job $SLURM_JOB_ID ($1)"
  scontrol requeue "$SLURM_JOB_ID" || {{ echo FAILED > "$STATE/state"; fail "$rc" "scontrol requeue failed"; }}
  sleep 60  # the requeue ends this attempt; do not fall through
  exit "$rc"
}}
if [ "$rc" = 0 ]; then
  touch "$STATE/finished"; echo COMPLETED > "$STATE/state"; exit 0
fi
if [ "$rc" = {exitcodes.PREEMPTED} ] || [ -n "$SIGNALLED" ]; then
  if [ "$(count "$STATE/requeues")" -lt {int(t.max_requeues)} ]; then
    echo "$ATTEMPT $(date +%s)" >> "$STATE/requeues"; requeue "preempted, checkpoint written"
  fi
  echo PREEMPTED > "$STATE/state"; fail "$rc" "preempted, but max_requeues={int(t.max_requeues)} is used up"
fi
echo "$ATTEMPT $(date +%s) $rc" >> "$STATE/failures"
if [ "$rc" != {exitcodes.CONFIG} ] && [ "$(count "$STATE/failures")" -lt {int(t.max_failures)} ]; then
  requeue "failure $(count "$STATE/failures") of at most {int(t.max_failures)}"
fi
echo FAILED > "$STATE/state"
fail "$rc" "training failed with exit code $rc (failures: $(count "$STATE/failures"), max_failures={int(t.max_failures)})"
"""


def render_slurm(recipe: Recipe, plan: Plan, files: dict[str, str], *, python: Optional[str] = None) -> Artifacts:
    """The sbatch artifacts; `files` already holds plan.json, recipe.yaml (and ds_config.json for ZeRO)."""
    pd = plan.to_dict()
    out = dict(files)
    out[JOB_SCRIPT] = job_script(recipe, pd, python=python)
    out[STEP_SCRIPT] = step_script(recipe, pd)
    return Artifacts("slurm", recipe.job_name, out, JOB_SCRIPT, ["sbatch", "--parsable", JOB_SCRIPT],
                     {JOB_SCRIPT, STEP_SCRIPT}, notes=_notes(recipe))


def _notes(recipe: Recipe) -> list[str]:
    notes = []
    if recipe.secrets:
        notes.append("secrets " + ", ".join(recipe.secrets) + " must be exported in the shell that runs sbatch")
    if recipe.targets.slurm.ssh:
        notes.append(f"submitted over ssh to {recipe.targets.slurm.ssh.host}; secrets must be set there")
    return notes


# ----------------------------------------------------------------------------- sweeps (array jobs)


def render_slurm_array(items: Sequence[tuple[Recipe, Plan]], *, python: Optional[str] = None) -> Artifacts:
    """One array job for a sweep (override sets from launcher.sweep.expand): task i reads task-i/plan.json. All tasks must share the allocation
    (nodes, devices, targets.slurm), since an array has one set of #SBATCH lines."""
    from . import common_files

    if not items:
        raise DtlaunchError("a sweep needs at least one override set")
    first, first_plan = items[0]
    pd0 = first_plan.to_dict()
    for i, (r, p) in enumerate(items[1:], 1):
        pd = p.to_dict()
        if (r.targets.slurm, r.resources.accelerator, r.secrets) != (first.targets.slurm, first.resources.accelerator,
                                                                      first.secrets) \
                or (pd["nodes"], pd["gpus_per_node"]) != (pd0["nodes"], pd0["gpus_per_node"]):
            raise DtlaunchError(f"sweep task {i} changes the allocation (nodes, accelerator, secrets or targets.slurm); "
                                "an array job has one allocation: sweep only training/model settings, or submit separately")
    files: dict[str, str] = {}
    for i, (r, p) in enumerate(items):
        for rel, content in common_files(r, p).items():
            files[f"task-{i}/{rel}"] = content
    files[JOB_SCRIPT] = job_script(first, pd0, python=python, array=f"0-{len(items) - 1}")
    files[STEP_SCRIPT] = step_script(first, pd0)
    return Artifacts("slurm", first.job_name, files, JOB_SCRIPT, ["sbatch", "--parsable", JOB_SCRIPT],
                     {JOB_SCRIPT, STEP_SCRIPT}, notes=_notes(first))
