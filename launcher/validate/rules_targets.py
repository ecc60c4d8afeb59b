"""What the targets' rules share: the inputs every node must read, and the rule for the targets DeepSpeed's own
launcher does not run on. Each target's own rules are in its package (launcher/targets/NAME/rules.py), which
launcher.validate loads from launcher.targets.TARGETS after this module."""

from __future__ import annotations

from ..plan import Plan
from ..recipe import Recipe
from ..targets import TARGET_NAMES
from .core import rule

# parallelism.launcher: deepspeed starts through SkyPilot's task only (targets/sky/render.py); everywhere else
# torchrun starts the DeepSpeed engines.
NOT_SKY = tuple(t for t in TARGET_NAMES if t != "sky")
# Only the SLURM job script requeues a job without the node a 44 names (its ExcNodeList); SkyPilot's own rule
# (targets/sky/rules.py) says when its recovery leaves the node behind.
NOT_SLURM_OR_SKY = tuple(t for t in TARGET_NAMES if t not in ("slurm", "sky"))


def inputs(r: Recipe) -> list[tuple[str, str]]:
    """(field, absolute path) of the files every node must read: the weights and a data file."""
    out = []
    if r.model.hf_weights and str(r.model.hf_weights).startswith("/"):
        out.append(("model.hf_weights", str(r.model.hf_weights)))
    d = r.training.data
    if d.source == "file" and d.path and d.path.startswith("/"):
        out.append(("training.data.path", d.path))
    return out


def under(path: str, dirs) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def unmounted(r: Recipe, mounted: list[str]) -> list[tuple[str, str]]:
    return [(f, path) for f, path in inputs(r) if not under(path, mounted)]


@rule(
    "deepspeed-launcher-target",
    "error",
    "parallelism.launcher",
    "the deepspeed launcher outside SkyPilot",
    NOT_SKY,
)
def _ds_launcher_target(r: Recipe, p: Plan):
    if r.parallelism.launcher == "deepspeed":
        return (
            "launcher: deepspeed is used on SkyPilot only; here torchrun starts the DeepSpeed engines on every node "
            "(the same engines, without pdsh or ssh between nodes)",
            "remove parallelism.launcher (torchrun)",
        )


@rule(
    "straggler-exit-target",
    "warning",
    "training.on_straggler",
    "a straggler's exit where nothing excludes its node",
    NOT_SLURM_OR_SKY,
)
def _straggler_exit(r: Recipe, p: Plan):
    if r.training.on_straggler == "exit":
        return (
            "on_straggler: exit ends the attempt with 44 naming the slow node, but nothing here runs the job again "
            "without it: the job ends (the SLURM job script requeues without the node; a managed SkyPilot job with "
            "targets.sky.recovery: fresh_nodes recovers onto new ones)",
            "keep the default warn here (the straggler is still named in the log, metrics.jsonl and status)",
        )
