"""Plan -> the SLURM artifacts: the submission the recipe asks for (targets.slurm.submit), sbatch's job script
(sbatch.py) or submitit's request (submitit.py), over the same step script (common.py). Pure: text only."""

from __future__ import annotations

from ...plan import Plan
from ...recipe import Recipe
from ...render.artifacts import Artifacts
from .common import with_wheel
from .sbatch import render_sbatch
from .submitit import render_submitit


def render_slurm(recipe: Recipe, plan: Plan, files: dict[str, str | bytes], *, choices=None) -> Artifacts:
    """`files` already holds plan.json, recipe.yaml (and ds_config.json for ZeRO). Both submissions ship the same
    step.sh; sbatch gets job.sbatch, submitit its batch preamble and request."""
    files = with_wheel(recipe, files)
    if recipe.targets.slurm.submit == "submitit":
        return render_submitit(recipe, plan, files)
    return render_sbatch(recipe, plan, files)
