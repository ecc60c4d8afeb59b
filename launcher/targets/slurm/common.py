"""What both SLURM submissions share (job.sbatch with sbatch, submitit_setup.sh with submitit): the step script
every node runs (step.sh: torchrun, or the interpreter check), the srun line that starts it once per node, the
batch-level context of _slurm_batch.sh.j2 (the run's identity, the environment, setup lines, the container),
dtlaunch's wheel for a container, and the notes. sbatch.py and submitit.py each add their own batch step.
"""

from __future__ import annotations

from ...jobenv import PORT_BASE, PORT_SPAN, RUN_ID
from ...plan import Plan
from ...recipe import Recipe
from ...render.code import CODE_DIR
from ...render.environment import checkpoint_template, job_env
from ...render.package import build_wheel, wheel_name
from ...render.shell import ShellExpr, Word
from ...render.templates import render_template
from ...render.torchrun import entry_args, torchrun_command
from ...strategies import Family
from .container import (
    CHECK_ARG,
    DIAGNOSE_ARG,
    JOB_ENV,
    MOUNTS_VAR,
    check_command,
    cleanup_command,
    container,
    diagnose_command,
    exec_prefix,
    srun_flags,
)

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
# The check a node makes before any rank starts (launcher.runtime.train --check): its interpreter, its GPUs, the plan.
CHECK_WORDS: tuple[Word, ...] = (
    ShellExpr("$PYTHON"),
    "-m",
    "launcher.runtime.train",
    "--plan",
    ShellExpr("$DTLAUNCH_PLAN"),
    "--check",
)
# A hang's culprit nodes, one a line (launcher.cli.diagnose over the run's records and flight-recorder dumps).
DIAGNOSE_WORDS: tuple[Word, ...] = (ShellExpr("$PYTHON"), "-m", "launcher.cli.diagnose", ShellExpr("$DTLAUNCH_RUN_DIR"))


def _step_command(recipe: Recipe, plan: Plan) -> list[Word]:
    # Without a container each node's torchrun agent checks its node before the rendezvous (no job step of its
    # own for the check). With one, the batch shell's check step stays: it also starts (pyxis: imports) the
    # image on every node, which can take minutes, before any node's rendezvous clock runs.
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
        check_plan=None if container(recipe) else ShellExpr("$DTLAUNCH_PLAN"),
    )


def step_script(recipe: Recipe, plan: Plan) -> str:
    """What srun runs once per node: torchrun, then the workers' own exit code for this node. With a
    container, also the interpreter check (`step.sh --check`), so it runs where training will."""
    c = container(recipe)
    torchrun = _step_command(recipe, plan)
    check: list[Word] = list(CHECK_WORDS)
    diagnose: list[Word] = list(DIAGNOSE_WORDS)
    if c is not None and not c.pyxis:
        torchrun, check, diagnose = exec_prefix(c) + torchrun, exec_prefix(c) + check, exec_prefix(c) + diagnose
    return render_template(
        "slurm_step.sh.j2",
        job_script=JOB_SCRIPT,
        torchrun=torchrun,
        code_dir=recipe.entrypoint is not None,
        container=c,
        check=check,
        check_arg=CHECK_ARG,
        diagnose=diagnose,
        diagnose_arg=DIAGNOSE_ARG,
        image_hint=IMAGE_HINT,
        job_env_var=JOB_ENV,
    )


def srun_words(recipe: Recipe) -> list[Word]:
    """The one srun line both submissions run: one task per node, each running the step script. The words
    hold run-time expressions ($SLURM_NNODES, $SUBMIT_DIR): the job script quotes them for bash, the submitit
    callable expands them from the batch environment the preamble exported."""
    srun: list[Word] = [
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


def batch_context(recipe: Recipe, array: bool) -> dict:
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
        # in the image when there is one (the host may have no dtlaunch), else the batch shell's own Python
        max_excluded=recipe.targets.slurm.max_excluded_nodes,
        # the partitions a requeued job may start in (a list a,b); the one it runs in when the recipe names none
        partitions=recipe.targets.slurm.partition or ShellExpr("${SLURM_JOB_PARTITION:-}"),
        hang_culprits=diagnose_command(c, ShellExpr("$SUBMIT_DIR/" + STEP_SCRIPT)) if c else list(DIAGNOSE_WORDS),
    )


def with_wheel(recipe: Recipe, files: dict[str, str | bytes]) -> dict[str, str | bytes]:
    """`files`, with dtlaunch's wheel when the steps run in a container. The image brings torch; the job brings
    the dtlaunch that planned it (as for SkyPilot): imported from this wheel, first on PYTHONPATH in the
    container, whatever the image has installed."""
    if container(recipe) is None:
        return files
    return {**files, wheel_name(): build_wheel()}


def notes(recipe: Recipe, plan: Plan) -> list[str]:
    notes = []
    if recipe.secrets:
        notes.append("secrets " + ", ".join(recipe.secrets) + " must be exported in the shell that runs sbatch")
    if recipe.targets.slurm.ssh:
        notes.append(f"submitted over ssh to {recipe.targets.slurm.ssh.host}; secrets must be set there")
    if plan.layout.spec.family is Family.DEEPSPEED:
        notes.append("DeepSpeed runs under torchrun on every node (no pdsh or ssh between nodes needed)")
    return notes
