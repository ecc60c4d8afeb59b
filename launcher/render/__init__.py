"""Plan -> artifacts for a target. Pure: returns text; writing and submitting happen elsewhere.

Each target renders in its own package (launcher/targets/NAME/render.py, found through launcher.targets.TARGETS);
this package keeps what they share: the files every target ships, the torchrun line, shell quoting, the job's
environment, dtlaunch's wheel, the Artifacts record and the shared templates.
"""

from __future__ import annotations

import json

import yaml

from .. import planfile
from ..plan import Plan
from ..recipe import Recipe
from ..targets import target as target_spec
from .artifacts import Artifacts
from .code import collect as collect_code

_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's emitter: the same text, faster


def common_files(recipe: Recipe, plan: Plan) -> dict[str, str | bytes]:
    """What every target ships: the resolved plan the job reads, the recipe as resolved, DeepSpeed's config,
    and the user's code when the recipe names an entrypoint."""
    files: dict[str, str | bytes] = {
        "plan.json": planfile.dumps(recipe, plan),
        "recipe.yaml": "# The recipe as dtlaunch resolved it (defaults filled in).\n"
        + yaml.dump(recipe.to_dict(), Dumper=_DUMPER, sort_keys=False),
    }
    files.update(collect_code(recipe))  # the user's entrypoint code, as code/...
    if plan.layout.spec.zero_stage is not None:
        from ..plan.deepspeed import deepspeed_config

        files["ds_config.json"] = json.dumps(deepspeed_config(recipe, plan), indent=2) + "\n"
    return files


def render(recipe: Recipe, plan: Plan, target: str, choices=None) -> Artifacts:
    """`plan`: the recipe's own; `choices`: the SkyPilot accelerator choices, if already made
    (plan.choices.for_target: made here otherwise)."""
    renderer = target_spec(target).load("renderer")  # an unknown target is refused here
    from ..plan.choices import for_target

    choices = choices or for_target(recipe, plan, target)
    if choices is not None:
        # The task may land on any of several accelerators: ship the plan valid on all of them.
        plan = choices.shipped
    return renderer(recipe, plan, common_files(recipe, plan), choices=choices)
