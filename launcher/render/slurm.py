"""Plan -> an sbatch job script (job.sbatch) plus the per-node step script (step.sh). Pure: text only.

The job script is the contract with the cluster, so it is written to be read (templates/slurm_job.sh.j2):
every SLURM option is an `#SBATCH` line, the environment is exported in plain sight, and the requeue and
preemption logic is a few commented shell lines. What it guarantees:

* the interpreter is the node's, resolved after `targets.slurm.setup`, and checked against the plan before
  any rank starts (exit 2 once, instead of a crash requeued three times);
* the rendezvous address is the first node of the allocation, never a silent localhost fallback, and node 0
  hosts the rendezvous store explicitly;
* USR2 (time limit, `--signal=B:USR2@N`) reaches the batch shell, which forwards it to the steps; torchrun
  passes it to the workers, which checkpoint and exit 42; the script requeues. A time-limit continuation
  is not a preemption: a run longer than the time limit continues as long as each allocation makes progress;
* TERM (scancel, the scheduler's own requeue or preemption) checkpoints and never requeues;
* the run (DTLAUNCH_RUN_ID, default the job id) outlives the job: resubmitting with DTLAUNCH_RUN_ID set
  resumes that run's checkpoints;
* ledgers under jobs/$SLURM_JOB_ID (attempts, requeues, continuations, failures, exit codes, `finished`)
  keep a requeued job from training twice or forever.

A site's own options (memory and CPUs per GPU, --gres on clusters without cons_tres, node lists, a
reservation, a dependency, mail) come from targets.slurm fields, checked where the recipe is read, so
extra_sbatch must not repeat them (one value per option; validate says which field to use). With
targets.slurm.container the steps run in an image (slurm_container.py); without it nothing of that renders.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import DtlaunchError
from ..jobenv import FINAL_CODES, PORT_BASE, PORT_SPAN, RESUME_CODES, RUN_ID, TIME_LIMIT_SLACK_S
from ..plan import Plan
from ..recipe import Recipe
from ..runtime import ckptdir
from ..strategies import Family
from .artifacts import Artifacts, SlurmRequest
from .code import CODE_DIR
from .environment import checkpoint_template, job_env
from .package import build_wheel, wheel_name
from .shell import ShellExpr, Word
from .slurm_container import (
    CHECK_ARG,
    EVERY_NODE,
    JOB_ENV,
    MOUNTS_VAR,
    check_command,
    cleanup_command,
    container,
    exec_prefix,
    srun_flags,
)
from .slurm_directives import directives
from .templates import render_template
from .torchrun import entry_args, torchrun_command

JOB_SCRIPT = "job.sbatch"
STEP_SCRIPT = "step.sh"
JOBS_DIR = "jobs"  # jobs/$SLURM_JOB_ID: one allocation's ledgers and logs (a requeue keeps the id)
RUNS_DIR = "runs"  # runs/$DTLAUNCH_RUN_ID: one training run's metrics, status and (by default) checkpoints
IMAGE_HINT = (
    "the image needs python3 with torch and dtlaunch's dependencies (msgspec, PyYAML, click, rich, "
    "safetensors, psutil); dtlaunch itself comes with the job; DTLAUNCH_PYTHON names another interpreter "
    "in the image"
)
SETUP_HINT = (
    "activate the environment that has torch and dtlaunch in targets.slurm.setup, "
    "e.g. `source /path/to/venv/bin/activate` or `module load ...`"
)
# The check a node makes before any rank starts (launcher.train --check): its interpreter, its GPUs, the plan.
CHECK_WORDS: tuple[Word, ...] = (
    ShellExpr("$PYTHON"),
    "-m",
    "launcher.train",
    "--plan",
    ShellExpr("$DTLAUNCH_PLAN"),
    "--check",
)


def _step_command(recipe: Recipe, plan: Plan) -> list[Word]:
    return torchrun_command(
        recipe,
        plan,
        python=ShellExpr("$PYTHON"),
        nnodes=ShellExpr("$SLURM_NNODES"),
        nproc_per_node=str(plan.gpus_per_node),
        rdzv_endpoint=ShellExpr("$MASTER_ADDR:$MASTER_PORT"),
        rdzv_id=ShellExpr("$SLURM_JOB_ID"),
        max_restarts=recipe.targets.slurm.max_restarts,
        is_host=ShellExpr("$IS_HOST"),
        local_addr=ShellExpr("$SLURMD_NODENAME"),
        entry=entry_args(recipe, ShellExpr("$DTLAUNCH_PLAN"), ShellExpr("$DTLAUNCH_RUN_DIR")),
    )


def step_script(recipe: Recipe, plan: Plan) -> str:
    """What srun runs once per node: torchrun, then the workers' own exit code for this node. With a
    container, also the interpreter check (`step.sh --check`), so it runs where training will."""
    c = container(recipe)
    torchrun = _step_command(recipe, plan)
    check: list[Word] = list(CHECK_WORDS)
    if c is not None and not c.pyxis:
        torchrun, check = exec_prefix(c) + torchrun, exec_prefix(c) + check
    return render_template(
        "slurm_step.sh.j2",
        job_script=JOB_SCRIPT,
        torchrun=torchrun,
        code_dir=recipe.entrypoint is not None,
        container=c,
        check=check,
        check_arg=CHECK_ARG,
        image_hint=IMAGE_HINT,
        job_env_var=JOB_ENV,
    )


def srun_words(recipe: Recipe) -> list[str | ShellExpr]:
    """The one srun line both submissions run: one task per node, each running the step script. The words
    hold run-time expressions ($SLURM_NNODES, $SUBMIT_DIR): the job script quotes them for bash, the submitit
    callable expands them from the batch environment the preamble exported."""
    srun: list[str | ShellExpr] = [
        "srun",
        "--kill-on-bad-exit=1",
        "--wait=60",
        ShellExpr("--nodes=$SLURM_NNODES"),
        ShellExpr("--ntasks=$SLURM_NNODES"),
        "--ntasks-per-node=1",
    ]
    if recipe.targets.slurm.cpus_per_task or not recipe.resources.device().is_gpu:
        # Since SLURM 22.05 srun no longer inherits the job's --cpus-per-task: say it again for the step.
        srun.append(ShellExpr("--cpus-per-task=$SLURM_CPUS_PER_TASK"))
    c = container(recipe)
    if c is not None and c.pyxis:
        srun += srun_flags(c)
    return srun + ["bash", ShellExpr("$SUBMIT_DIR/" + STEP_SCRIPT)]


def _batch_context(recipe: Recipe, array: bool) -> dict:
    """What the shared batch-level template (_slurm_batch.sh.j2) needs, for either submission."""
    plan_file = (
        ShellExpr("$SUBMIT_DIR/task-$SLURM_ARRAY_TASK_ID/plan.json") if array else ShellExpr("$SUBMIT_DIR/plan.json")
    )
    default_run_id = recipe.run_id or ShellExpr("$SLURM_ARRAY_JOB_ID" if array else "$SLURM_JOB_ID")
    c = container(recipe)
    env = job_env(recipe)
    # The run outlives the job (its directory is named by the run id), the attempt is this allocation's.
    run_dir = ShellExpr(f"$SUBMIT_DIR/{RUNS_DIR}/${RUN_ID}")
    return dict(
        array=array,
        default_run_id=default_run_id,
        plan_file=plan_file,
        run_dir=run_dir,
        attempt=ShellExpr("$SLURM_JOB_ID.$ATTEMPT"),
        env=env,
        checkpoint_template=checkpoint_template(recipe),
        secrets=recipe.secrets,
        setup=recipe.targets.slurm.setup,
        setup_hint=SETUP_HINT,
        default_python=None,
        port_base=PORT_BASE,
        port_span=PORT_SPAN,
        signal_seconds=recipe.targets.slurm.signal_seconds,
        code_dir=ShellExpr(f"$SUBMIT_DIR/{CODE_DIR}") if recipe.entrypoint else None,
        container=c,
        image_hint=IMAGE_HINT,
        mounts_var=MOUNTS_VAR,
        wheel=wheel_name() if c else None,
        container_check=check_command(c, ShellExpr("$SUBMIT_DIR/" + STEP_SCRIPT)) if c else None,
        job_env_var=JOB_ENV,
        job_vars=c.job_vars(env) if c else [],
        container_cleanup=cleanup_command(c),
        node_check=[*EVERY_NODE, *CHECK_WORDS],
    )


def job_script(recipe: Recipe, plan: Plan, *, array: str | None = None) -> str:
    t = recipe.targets.slurm
    return render_template(
        "slurm_job.sh.j2",
        directives=directives(recipe, plan, array),
        job_script=JOB_SCRIPT,
        outside_hint=f"submit with sbatch {JOB_SCRIPT}",
        srun=srun_words(recipe),
        max_requeues=t.max_requeues,
        max_failures=t.max_failures,
        final_codes=FINAL_CODES,
        resume_codes=RESUME_CODES,
        ckpt_prefix=ckptdir.STEP_PREFIX,
        ckpt_marker=ckptdir.MARKER,
        ckpt_corrupt=ckptdir.CORRUPT,
        time_limit_slack=TIME_LIMIT_SLACK_S,
        host_python=False,
        **_batch_context(recipe, array is not None),
    )


def _request(recipe: Recipe, array: bool) -> SlurmRequest:
    return SlurmRequest(JOB_SCRIPT, recipe.targets.slurm, array=array, secrets=tuple(recipe.secrets))


def render_slurm(recipe: Recipe, plan: Plan, files: dict[str, str]) -> Artifacts:
    """The SLURM artifacts; `files` already holds plan.json, recipe.yaml (and ds_config.json for ZeRO).
    Both submissions ship the same step.sh; sbatch gets job.sbatch, submitit its batch preamble and request."""
    if container(recipe) is not None:
        # The image brings torch; the job brings the dtlaunch that planned it (as for SkyPilot): imported from
        # this wheel, first on PYTHONPATH in the container, whatever the image has installed.
        files = {**files, wheel_name(): build_wheel()}
    if recipe.targets.slurm.submit == "submitit":
        from .slurm_submitit import render_submitit

        return render_submitit(
            recipe,
            plan,
            {**files, STEP_SCRIPT: step_script(recipe, plan)},
            batch_context=_batch_context(recipe, array=False),
            notes=_notes(recipe, plan),
        )
    out = {**files, JOB_SCRIPT: job_script(recipe, plan), STEP_SCRIPT: step_script(recipe, plan)}
    return Artifacts(
        "slurm",
        recipe.job_name,
        out,
        _request(recipe, array=False),
        {JOB_SCRIPT, STEP_SCRIPT},
        notes=_notes(recipe, plan),
    )


def _notes(recipe: Recipe, plan: Plan) -> list[str]:
    notes = []
    if recipe.secrets:
        notes.append("secrets " + ", ".join(recipe.secrets) + " must be exported in the shell that runs sbatch")
    if recipe.targets.slurm.ssh:
        notes.append(f"submitted over ssh to {recipe.targets.slurm.ssh.host}; secrets must be set there")
    if plan.layout.spec.family is Family.DEEPSPEED:
        notes.append("DeepSpeed runs under torchrun on every node (no pdsh or ssh between nodes needed)")
    return notes


# ----------------------------------------------------------------------------- sweeps (array jobs)


def render_slurm_array(items: Sequence[tuple[Recipe, Plan]]) -> Artifacts:
    """One array job for a sweep (override sets from launcher.sweep.expand): task i reads task-i/plan.json.
    All tasks must share the allocation (nodes, devices, targets.slurm), since an array has one set of
    #SBATCH lines."""
    from . import common_files

    if not items:
        raise DtlaunchError("a sweep needs at least one override set")
    first, first_plan = items[0]
    if first.targets.slurm.submit == "submitit":
        raise DtlaunchError(
            "--sweep renders one sbatch array job; targets.slurm.submit is submitit",
            fix="sweep with --set targets.slurm.submit=sbatch, or submit one job per setting",
        )
    for i, (r, p) in enumerate(items[1:], 1):
        if (r.targets.slurm, r.resources.accelerator, r.secrets, r.entrypoint) != (
            first.targets.slurm,
            first.resources.accelerator,
            first.secrets,
            first.entrypoint,
        ) or (p.nodes, p.gpus_per_node) != (first_plan.nodes, first_plan.gpus_per_node):
            raise DtlaunchError(
                f"sweep task {i} changes the allocation (nodes, accelerator, secrets, entrypoint or targets.slurm)",
                fix="an array job has one allocation: sweep only training/model settings, or submit separately",
            )
    files: dict[str, str] = {}
    for i, (r, p) in enumerate(items):
        for rel, content in common_files(r, p).items():
            # The code is the same for every task (checked above): one copy, where the step script looks.
            files[rel if rel.startswith(f"{CODE_DIR}/") else f"task-{i}/{rel}"] = content
    files[JOB_SCRIPT] = job_script(first, first_plan, array=f"0-{len(items) - 1}")
    files[STEP_SCRIPT] = step_script(first, first_plan)
    if container(first) is not None:
        files[wheel_name()] = build_wheel()
    return Artifacts(
        "slurm",
        first.job_name,
        files,
        _request(first, array=True),
        {JOB_SCRIPT, STEP_SCRIPT},
        notes=_notes(first, first_plan),
    )
