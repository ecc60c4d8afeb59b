"""`targets.slurm.submit: sbatch` (the default): plan -> the job script (job.sbatch), beside the per-node step
script (step.sh, common.py's, which submitit's jobs run too); a sweep -> one array job. Pure: text only.

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
targets.slurm.container the steps run in an image (container.py); without it nothing of that renders.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import DtlaunchError
from ...jobenv import FINAL_CODES, RESUME_CODES, TIME_LIMIT_SLACK_S
from ...plan import Plan
from ...recipe import Recipe
from ...render import common_files
from ...render.artifacts import Artifacts
from ...render.code import CODE_DIR
from ...render.templates import render_template
from ...runtime.checkpoint import disk
from .common import JOB_SCRIPT, STEP_SCRIPT, batch_context, notes, srun_words, step_script, with_wheel
from .directives import directives
from .request import SlurmRequest


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
        ckpt_prefix=disk.STEP_PREFIX,
        ckpt_marker=disk.MARKER,
        ckpt_corrupt=disk.CORRUPT,
        time_limit_slack=TIME_LIMIT_SLACK_S,
        host_python=False,
        **batch_context(recipe, array is not None),
    )


def _request(recipe: Recipe, array: bool) -> SlurmRequest:
    return SlurmRequest(JOB_SCRIPT, recipe.targets.slurm, array=array, secrets=tuple(recipe.secrets))


def render_sbatch(recipe: Recipe, plan: Plan, files: dict[str, str | bytes]) -> Artifacts:
    """job.sbatch and step.sh, submitted with `sbatch --parsable job.sbatch`; `files` already holds what every
    target ships (and the wheel, with a container)."""
    out = {**files, JOB_SCRIPT: job_script(recipe, plan), STEP_SCRIPT: step_script(recipe, plan)}
    return Artifacts(
        "slurm",
        recipe.job_name,
        out,
        _request(recipe, array=False),
        {JOB_SCRIPT, STEP_SCRIPT},
        notes=notes(recipe, plan),
    )


# ----------------------------------------------------------------------------- sweeps (array jobs)


def render_slurm_array(items: Sequence[tuple[Recipe, Plan]]) -> Artifacts:
    """One array job for a sweep (override sets from launcher.cli.sweep.expand): task i reads task-i/plan.json.
    All tasks must share the allocation (nodes, devices, targets.slurm), since an array has one set of
    #SBATCH lines."""
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
    files: dict[str, str | bytes] = {}
    for i, (r, p) in enumerate(items):
        for rel, content in common_files(r, p).items():
            # The code is the same for every task (checked above): one copy, where the step script looks.
            files[rel if rel.startswith(f"{CODE_DIR}/") else f"task-{i}/{rel}"] = content
    files[JOB_SCRIPT] = job_script(first, first_plan, array=f"0-{len(items) - 1}")
    files[STEP_SCRIPT] = step_script(first, first_plan)
    return Artifacts(
        "slurm",
        first.job_name,
        with_wheel(first, files),
        _request(first, array=True),
        {JOB_SCRIPT, STEP_SCRIPT},
        notes=notes(first, first_plan),
    )
