"""The SkyPilot target: one task YAML that `sky launch` (or `sky jobs launch`) accepts as it is.

The YAML is the stable contract (SkyPilot's SDK arguments change between releases), so all of SkyPilot's
knowledge lives here as text; backend.py only hands the file over.

What a cloud node has is its own disk, the task's workdir (copied to every node) and what `file_mounts`
and `volumes` name. So the rendered directory carries dtlaunch itself as a wheel (setup installs it with
no package index), checkpoints go to a bucket or volume every node and every recovery sees, and `sky
launch` clusters stop themselves when idle. Recipe values reach the shell only through the templates'
quoting filters; environment values travel in `envs:` (SkyPilot exports them); secrets are listed by name
and supplied with `--secret NAME` from the submitting shell.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import yaml

from ...catalog import NETWORKS
from ...jobenv import FINAL_CODES, FINAL_MARKER, RESUME_CODES, RUN_DIR, RUN_ID
from ...plan import Plan
from ...recipe import Recipe, images
from ...render.artifacts import Artifacts
from ...render.code import CODE_DIR
from ...render.environment import job_env
from ...render.package import build_wheel, image_requirements, installed_version, wheel_name
from ...render.shell import ShellExpr, Word, exported_or, flag
from ...render.templates import render_template
from ...render.torchrun import entry_args, entry_module, torchrun_command
from ...strategies import Family
from .request import SkyRequest

if TYPE_CHECKING:
    from ...plan.choices import Choices

DEFAULT_PORT = 29500
JOB_MOUNT = "~/dtlaunch-job"  # where the rendered files land when the workdir is the user's project
TASK_FILE = "task.yaml"
# The DeepSpeed version the job installs when the rendering machine has none (the one tested with).
DEEPSPEED_TESTED = "0.19.8"
SETUP_HINT = "the task's setup installs dtlaunch from the wheel next to task.yaml; check the setup log (sky logs)"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (setup, run) as literal blocks, so the YAML reads like the script it holds."""


def _str(dumper: yaml.SafeDumper, s: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)


# SkyPilot's disk per node when a task names none (sky/resources.py's default).
DEFAULT_DISK_GB = 256


def on_kubernetes(recipe: Recipe) -> bool:
    where = (infra(recipe) or "").split("/")[0].lower()
    return where in ("k8s", "kubernetes")


def is_managed(recipe: Recipe) -> bool:
    return recipe.targets.sky.is_managed()


def infra(recipe: Recipe) -> str | None:
    """`infra: cloud[/region[/zone]]` (SkyPilot >= 0.10 spelling), from `infra` or cloud/region/zone."""
    sk = recipe.targets.sky
    if sk.infra:
        return sk.infra
    parts = [sk.cloud or "*", sk.region or "*", sk.zone or ""]
    while parts and parts[-1] in ("", "*"):
        parts.pop()
    return "/".join(parts) or None


def checkpoint_dir(recipe: Recipe) -> str | None:
    """Where the job checkpoints: checkpoint.dir, else a directory per run on the mounted storage."""
    storage = recipe.targets.sky.checkpoint_storage
    if recipe.checkpoint.dir:
        return recipe.checkpoint.dir
    return f"{storage.mount}/{{run_id}}" if storage else None


def resources(recipe: Recipe, choices: Choices | None = None) -> dict:
    """The task's `resources:`. With accelerator fallbacks (`choices`), SkyPilot's `ordered` (tried in this
    order: dtlaunch's cheapest plan first) or `any_of` (SkyPilot picks), one entry per accelerator that can
    run the shipped plan; every other field applies to all of them."""
    res, sk = recipe.resources, recipe.targets.sky
    out = _devices(recipe, choices)
    # The fast fabric matters only between nodes; on one node `best` would only pin a special image.
    if NETWORKS[res.network].sky_network_tier == "best" and res.nodes > 1:
        out["network_tier"] = "best"
    where = infra(recipe)
    if where:
        out["infra"] = where
    if sk.spot:
        out["use_spot"] = True
    if sk.disk_size is not None:  # on Kubernetes a disk_size is an ephemeral-storage request pods must meet
        out["disk_size"] = sk.disk_size
    # The machine's own fields, where the recipe sets them.
    out.update({k: v for k, v in (("disk_tier", sk.disk_tier), ("ports", list(sk.ports or []))) if v})
    if res.image:  # the job runs in this container on every node (setup and run alike)
        out["image_id"] = images.for_sky(res.image)
    out.update(_lifecycle(recipe))
    return out


def _devices(recipe: Recipe, choices: Choices | None) -> dict:
    """accelerators (or the fallbacks' list), instance_type, cpus and memory."""
    res, sk = recipe.resources, recipe.targets.sky
    out: dict = {}
    kept = [c.accelerator for c in choices.kept] if choices else []
    if res.device().is_gpu and len(kept) > 1:
        out[sk.fallback] = [{"accelerators": a} for a in kept]
    elif res.device().is_gpu:
        out["accelerators"] = kept[0] if kept else res.accelerator
    elif sk.cpus is None:  # SkyPilot has no "cpu" accelerator: ask for vCPUs instead, one rank per requested core
        out["cpus"] = f"{res.per_node}+"
    if sk.instance_type:
        out["instance_type"] = sk.instance_type
    if sk.cpus is not None:
        out["cpus"] = sk.cpus
    if sk.memory is not None:
        out["memory"] = sk.memory
    return out


def _lifecycle(recipe: Recipe) -> dict:
    """A managed job's recovery, or an unmanaged cluster's autostop."""
    sk = recipe.targets.sky
    if is_managed(recipe):
        return {
            "job_recovery": {
                "strategy": sk.recovery_strategy(),
                "max_restarts_on_errors": sk.max_restarts_on_errors,
                # Only the policy's "resume" codes (PREEMPTED) recover without limit: SkyPilot does not count these
                # recoveries, and a reproducible hang (43) must count against max_restarts_on_errors like any
                # error. Final codes (2, 45) cannot be told apart here: the run's terminal marker ends them.
                "recover_on_exit_codes": list(RESUME_CODES),
            }
        }
    if sk.autostop_minutes:
        return {"autostop": {"idle_minutes": sk.autostop_minutes, "down": sk.autodown}}
    return {}


def envs(recipe: Recipe) -> dict[str, str]:
    env = job_env(recipe)
    env.update({"DTLAUNCH_TARGET": "sky", "DTLAUNCH_RECIPE_HASH": recipe.digest()})
    return env


def _job_paths(recipe: Recipe) -> tuple[Word, Word]:
    """(JOB_DIR, the wheel as a pip requirement): the rendered files are the workdir, or a mount beside the
    user's own workdir (targets.sky.workdir)."""
    extras = "" if recipe.resources.image else "[train]"  # an image brings torch: see setup_script
    if recipe.targets.sky.workdir:
        return ShellExpr("$HOME/dtlaunch-job"), ShellExpr(f"$HOME/dtlaunch-job/{wheel_name()}{extras}")
    return ShellExpr("$PWD"), f"./{wheel_name()}{extras}"


def code_dir(recipe: Recipe, job_dir: Word) -> ShellExpr | None:
    """Where the user's code lands on a node: code/ in the rendered files (None: dtlaunch's own trainer)."""
    return ShellExpr(f"{job_dir}/{CODE_DIR}") if recipe.entrypoint else None


def setup_script(recipe: Recipe, plan: Plan) -> str:
    _, wheel = _job_paths(recipe)
    extra = []
    deepspeed = plan.layout.spec.family is Family.DEEPSPEED or recipe.parallelism.launcher == "deepspeed"
    if deepspeed:  # the version that rendered (and validated) the config, not whatever is newest
        extra.append(f"deepspeed=={installed_version('deepspeed') or DEEPSPEED_TESTED}")
    head_only = deepspeed and recipe.parallelism.launcher == "deepspeed" and recipe.targets.sky.deepspeed_ssh
    # With an image, its torch stays: the wheel without its dependencies, then those besides torch
    # (package.image_requirements); the run's check says which torch the plan needs.
    image_deps = image_requirements() if recipe.resources.image else None
    return render_template(
        "sky_setup.sh.j2",
        wheel_requirement=wheel,
        extra_requirements=extra,
        image_deps=image_deps,
        install_pdsh=head_only and recipe.resources.nodes > 1,
        setup=recipe.targets.sky.setup,
    )


def _nproc(recipe: Recipe, plan: Plan) -> Word:
    """GPUs per node from SkyPilot; on CPU nodes SkyPilot reports 0 GPUs, so the plan's count is used."""
    return ShellExpr("$SKYPILOT_NUM_GPUS_PER_NODE") if recipe.resources.device().is_gpu else str(plan.gpus_per_node)


# DeepSpeed's launcher through the node's interpreter, not the `deepspeed` console script: an image may put its
# own Python's scripts first on PATH, and workers started from that Python would not see the dtlaunch that
# setup installed into the activated environment.
_DEEPSPEED: list[Word] = [ShellExpr("$PYTHON"), "-m", "deepspeed.launcher.runner"]


def run_script(recipe: Recipe, plan: Plan) -> str:
    job_dir, _ = _job_paths(recipe)
    entry = entry_args(recipe, ShellExpr("$DTLAUNCH_PLAN"), ShellExpr("$DTLAUNCH_RUN_DIR"))
    deepspeed = recipe.parallelism.launcher == "deepspeed"
    torchrun = torchrun_command(
        recipe,
        plan,
        python=ShellExpr("$PYTHON"),
        nnodes=ShellExpr("$SKYPILOT_NUM_NODES"),
        nproc_per_node=_nproc(recipe, plan),
        rdzv_endpoint=ShellExpr("$MASTER_ADDR:$PORT"),
        rdzv_id=ShellExpr("$DTLAUNCH_RUN_ID"),
        max_restarts=recipe.targets.sky.max_restarts,
        is_host=ShellExpr("$IS_HOST"),
        local_addr=ShellExpr("$NODE_ADDR"),
        entry=entry,
        # torchrun's agent checks its node against the plan in the torch import it makes anyway; DeepSpeed's
        # launchers start the workers without it, so there the script checks in a python of its own
        check_plan=ShellExpr("$DTLAUNCH_PLAN"),
    )
    module, module_args = entry_module(recipe, ShellExpr("$DTLAUNCH_PLAN"), ShellExpr("$DTLAUNCH_RUN_DIR"))
    ds_args: list[Word] = [
        flag("--hostfile", ShellExpr("$HOSTFILE")),
        flag("--master_addr", ShellExpr("$MASTER_ADDR")),
        flag("--master_port", ShellExpr("$PORT")),
        "--no_local_rank",
        "--module",
    ]
    return render_template(
        "sky_run.sh.j2",
        job_dir=job_dir,
        code_dir=code_dir(recipe, job_dir),
        default_run_id=recipe.run_id or ShellExpr("$SKYPILOT_TASK_ID"),
        run_dir=exported_or(RUN_DIR, f"$JOB_DIR/runs/${RUN_ID}"),
        plan_file=ShellExpr("$JOB_DIR/plan.json"),
        attempt=ShellExpr("$(sky_attempt)"),
        final_codes=FINAL_CODES,
        final_marker=FINAL_MARKER,
        checkpoint_template=checkpoint_dir(recipe),
        port=DEFAULT_PORT,
        setup_hint=SETUP_HINT,
        default_python=None,
        deepspeed=deepspeed,
        check="process" if deepspeed else "agent",
        deepspeed_ssh=recipe.targets.sky.deepspeed_ssh,
        nproc=_nproc(recipe, plan),
        ds_env=envs(recipe),
        torchrun=torchrun,
        ds_module=[module, *module_args],
        deepspeed_node=[
            *_DEEPSPEED,
            "--no_ssh",
            flag("--node_rank", ShellExpr("$SKYPILOT_NODE_RANK")),
            *ds_args,
            module,
            *module_args,
        ],
        # the head's module words are DS_MODULE, which the script checks before it launches
        deepspeed_head=[*_DEEPSPEED, "--log_level=warning", *ds_args, ShellExpr("${DS_MODULE[@]}")],
    )


def task(recipe: Recipe, plan: Plan, choices: Choices | None = None) -> dict:
    """`choices`: the accelerator fallbacks as planned (plan.choices.for_target), `plan` their shipped plan."""
    sk = recipe.targets.sky
    out: dict = {"name": recipe.job_name, "num_nodes": recipe.resources.nodes, "resources": resources(recipe, choices)}
    mounts: dict = {}
    if sk.workdir:  # the user's project is the workdir; the rendered files ride along as a mount
        out["workdir"] = os.path.expanduser(sk.workdir)
        mounts[JOB_MOUNT] = "."
    else:  # the rendered directory is the workdir (the submit command runs in it)
        out["workdir"] = "."
    storage = sk.checkpoint_storage
    if storage and storage.bucket:
        mounts[storage.mount] = {"source": storage.bucket, "mode": storage.mode}
    for m in sk.data_mounts:  # a bucket as a storage mount; a local directory copied (SkyPilot's plain form)
        mounts[m.path] = {"source": m.source, "mode": m.mode} if "://" in m.source else os.path.expanduser(m.source)
    if mounts:
        out["file_mounts"] = mounts
    if storage and storage.volume:
        out["volumes"] = {storage.mount: storage.volume}
    out["envs"] = envs(recipe)
    if recipe.secrets:
        out["secrets"] = {name: None for name in recipe.secrets}  # names only; values come from --secret
    out["setup"] = setup_script(recipe, plan)
    out["run"] = run_script(recipe, plan)
    return out


def request(recipe: Recipe) -> SkyRequest:
    return SkyRequest(TASK_FILE, recipe.job_name, is_managed(recipe), tuple(recipe.secrets))


def render_sky(
    recipe: Recipe, plan: Plan, files: dict[str, str | bytes], *, choices: Choices | None = None
) -> Artifacts:
    req = request(recipe)
    header = "# Rendered by dtlaunch for SkyPilot. Submit from this directory:\n#   " + " ".join(req.argv) + "\n"
    out: dict[str, str | bytes] = dict(files)
    out[TASK_FILE] = header + yaml.dump(task(recipe, plan, choices), Dumper=_Dumper, sort_keys=False, width=1000)
    out[wheel_name()] = build_wheel()
    return Artifacts("sky", recipe.job_name, out, req, set(), _notes(recipe, choices))


def _notes(recipe: Recipe, choices: Choices | None) -> list[str]:
    notes = list(choices.notes) if choices else []
    sk = recipe.targets.sky
    if sk.checkpoint_storage is None and (recipe.resources.nodes > 1 or is_managed(recipe)):
        notes.append(
            "no targets.sky.checkpoint_storage: checkpoints stay on each node's disk, so other nodes cannot "
            "see them and a recovered job starts on fresh VMs from step 0"
        )
    if recipe.secrets:
        notes.append(
            "export " + ", ".join(recipe.secrets) + " in the submitting shell: `--secret NAME` reads them there"
        )
    if not is_managed(recipe) and sk.autostop_minutes:
        notes.append(
            f"the cluster {'is torn down' if sk.autodown else 'stops'} after {sk.autostop_minutes} idle "
            "minutes (targets.sky.autostop_minutes: null keeps it up)"
        )
    return notes
