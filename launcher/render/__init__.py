"""Plan -> artifacts for a target. Pure: returns text; writing and submitting happen elsewhere."""
from __future__ import annotations

import json

import yaml

from .. import planfile
from ..errors import DtlaunchError
from ..plan import Plan
from ..plan.memory import ZERO_FAMILY
from ..recipe import Recipe
from .artifacts import Artifacts

TARGETS = ("local", "slurm", "sky")


def common_files(recipe: Recipe, plan: Plan) -> dict[str, str]:
    """What every target ships: the resolved plan the job reads, the recipe as resolved, DeepSpeed's config."""
    pd = plan.to_dict()
    files = {
        "plan.json": planfile.dumps(recipe, pd),
        "recipe.yaml": "# The recipe as dtlaunch resolved it (defaults filled in).\n"
        + yaml.safe_dump(recipe.to_dict(), sort_keys=False),
    }
    if plan.strategy in ZERO_FAMILY:
        from .deepspeed import deepspeed_config

        files["ds_config.json"] = json.dumps(deepspeed_config(recipe, pd), indent=2) + "\n"
    return files


def render(recipe: Recipe, plan: Plan, target: str) -> Artifacts:
    if target not in TARGETS:
        raise DtlaunchError(f"unknown target {target!r}; use one of {', '.join(TARGETS)}")
    files = common_files(recipe, plan)
    pd = plan.to_dict()
    if target == "local":
        from .local import launch_script

        files["launch.sh"] = launch_script(recipe, pd)
        return Artifacts("local", recipe.job_name, files, "launch.sh", ["bash", "launch.sh"], {"launch.sh"})
    if target == "slurm":
        from .slurm import render_slurm

        return render_slurm(recipe, plan, files)
    from .sky import render_sky

    return render_sky(recipe, plan, files)
