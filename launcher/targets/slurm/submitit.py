"""`targets.slurm.submit: submitit`: the plan as submitit's executor parameters, plus the batch preamble that
submitit's batch script sources. Pure, like every renderer: text and plain data, no submitit import.

The job submitit submits (submitit_job.py) runs in the batch step, one process, started with
`exec` so the time-limit signal (`--signal=B:USR2@N`) reaches it: bash would die of a B: signal it does not
trap, and without `exec` submitit's python would be bash's child and never see it. That process runs the
same `srun ... bash step.sh` as job.sbatch, so every node runs the same torchrun step either way.

The #SBATCH lines come from `directives()`, the sbatch path's own list, mapped onto submitit's named
parameters where it has one (it writes those itself, e.g. --time and --job-name) and its
`additional_parameters` otherwise. submitit writes each value through shlex.quote; sbatch reads single
quotes but still treats a backslash in them as an escape, and a line break would end the #SBATCH line and
start a shell command, so such values are refused here instead of being mangled or run.
"""

from __future__ import annotations

import math
from typing import Any

from ...errors import DtlaunchError
from ...jobenv import TIME_LIMIT_SLACK_S
from ...plan import Plan
from ...recipe import Recipe
from ...render.artifacts import Artifacts
from ...render.shell import sbatch_value
from ...render.templates import render_template
from ...render.torchrun import grace_seconds
from .common import STEP_SCRIPT, batch_context, notes, srun_words, step_script
from .container import cleanup_command, container
from .directives import directives
from .request import SlurmRequest, SubmititSpec
from .timelimit import parse_time

SETUP_SCRIPT = "submitit_setup.sh"
REQUEST_FILE = "submitit.json"
FOLDER = "submitit"
# The interpreter the preamble resolved (after the recipe's setup lines) and exported; `exec` makes the
# batch process itself submitit's python, the one process --signal=B:USR2@N signals.
PYTHON = 'exec "$PYTHON"'
# sbatch options submitit has a parameter for (it writes these lines itself, under these names).
# --cpus-per-gpu and --reservation go through additional_parameters: submitit has no `reservation`, and its
# `cpus_per_gpu` warns that it "requires gpus_per_task" (untrue for a --gpus-per-node job) on every submit.
NAMED = {
    "--job-name": "job_name",
    "--nodes": "nodes",
    "--ntasks-per-node": "ntasks_per_node",
    "--gpus-per-node": "gpus_per_node",
    "--cpus-per-task": "cpus_per_task",
    "--mem": "mem",
    "--mem-per-gpu": "mem_per_gpu",
    "--gres": "gres",
    "--partition": "partition",
    "--account": "account",
    "--qos": "qos",
    "--constraint": "constraint",
    "--exclude": "exclude",
    "--nodelist": "nodelist",
    "--dependency": "dependency",
    "--mail-type": "mail_type",
    "--mail-user": "mail_user",
}
# submitit writes the job's log into its own folder (--output/--error with %j) and appends across requeues.
SUBMITIT_WRITES = ("--output", "--open-mode")
SUBMITIT_HINT = (
    "the batch step runs submitit in the job's own interpreter: install dtlaunch[slurm] (submitit) in "
    "the environment targets.slurm.setup activates"
)


def minutes(time: str) -> int:
    """submitit's `time` is whole minutes; a limit with seconds rounds up (SLURM counts in minutes too)."""
    return math.ceil(parse_time(time) / 60)


def _check(option: str, value: object) -> None:
    sbatch_value(value, f"targets.slurm ({option})")  # refuses line breaks and NUL
    if "\\" in str(value):
        raise DtlaunchError(
            f"targets.slurm ({option}): {str(value)[:80]!r} contains a backslash, which sbatch reads "
            "as an escape even inside the single quotes submitit writes",
            fix="remove the backslash, or use targets.slurm.submit: sbatch",
        )


def parameters(recipe: Recipe, plan: Plan) -> dict[str, Any]:
    """SlurmExecutor.update_parameters(**these): one task per node in the batch step, no srun of submitit's
    own (the callable runs the step's srun), stdout and stderr in one log like job.sbatch's."""
    t = recipe.targets.slurm
    params: dict[str, Any] = {"use_srun": False, "stderr_to_stdout": True, "signal_delay_s": t.signal_seconds}
    extra: dict[str, Any] = {}
    for option, value in directives(recipe, plan):
        if option in SUBMITIT_WRITES:
            continue
        if value is not None:
            _check(option, value)
        if option == "--time":
            params["time"] = minutes(t.time)
        elif option == "--exclusive":
            params["exclusive"] = True
        elif option in NAMED:
            params[NAMED[option]] = value
        elif option.startswith("--") and len(option) > 2:
            # --signal=B:USR2@N replaces submitit's own USR2@N (batch process only, see the module docstring);
            # --requeue lets `scontrol requeue` requeue the job; the recipe's extra_sbatch follows.
            extra[option[2:]] = True if value is None else value
        else:
            raise DtlaunchError(
                f"targets.slurm.extra_sbatch: {option!r}: submitit writes long options only",
                fix="use the long form, e.g. --nodelist=node1 instead of -w node1",
            )
    params["additional_parameters"] = extra
    return params


def max_num_timeout(recipe: Recipe, plan: Plan) -> int:
    """submitit refuses to requeue after this many signals it counts as time-outs (on jobs of 10 minutes or
    less, every signal). dtlaunch decides requeues itself, so this only has to be out of the way: a
    continuation after a time limit needs progress (at least one step) and a preemption counts against
    max_requeues, so no run can use more than steps + max_requeues."""
    steps = plan.steps if plan.steps is not None else 10_000
    return steps + recipe.targets.slurm.max_requeues + 1


def step_settings(recipe: Recipe, plan: Plan) -> dict[str, Any]:
    """The job-side callable's settings (plain data: it is pickled into every attempt)."""
    t = recipe.targets.slurm
    return {
        "srun": [str(w) for w in srun_words(recipe)],
        "signal_seconds": t.signal_seconds,
        "time_limit_slack": TIME_LIMIT_SLACK_S,
        # how long to wait for the steps after forwarding USR2: torchrun's grace for the workers' checkpoint,
        # plus the time step.sh and srun take to report (bounded at run time by the time left)
        "stop_seconds": grace_seconds(recipe, plan) + 30,
        "max_requeues": t.max_requeues,
        "max_failures": t.max_failures,
        # run on every node when the job ends for good (pyxis's named container), or None
        "cleanup": [str(w) for w in cleanup] if (cleanup := cleanup_command(container(recipe))) else None,
    }


def render_submitit(recipe: Recipe, plan: Plan, files: dict[str, str | bytes]) -> Artifacts:
    """step.sh (the same as job.sbatch's), the batch preamble and submitit.json; `files` already holds what every
    target ships (and the wheel, with a container)."""
    files = {**files, STEP_SCRIPT: step_script(recipe, plan)}
    spec = SubmititSpec(
        FOLDER,
        SETUP_SCRIPT,
        PYTHON,
        max_num_timeout(recipe, plan),
        parameters(recipe, plan),
        step_settings(recipe, plan),
    )
    setup = render_template(
        "submitit_setup.sh.j2",
        setup_script=SETUP_SCRIPT,
        step_script=STEP_SCRIPT,
        outside_hint=f"submitit's batch script sources {SETUP_SCRIPT}",
        submitit_hint=SUBMITIT_HINT,
        host_python=True,
        **batch_context(recipe, array=False),
    )
    out = {**files, SETUP_SCRIPT: setup, REQUEST_FILE: spec.to_json()}
    request = SlurmRequest(
        REQUEST_FILE, recipe.targets.slurm, secrets=tuple(recipe.secrets), submit="submitit", submitit=spec
    )
    return Artifacts(
        "slurm",
        recipe.job_name,
        out,
        request,
        {STEP_SCRIPT},
        notes=[*notes(recipe, plan), f"submitit: the job's log and pickles go to {FOLDER}/ in the submit directory"],
    )
