"""validate's rules for SLURM: what sbatch, the site or the container runtime will do to this job."""

from __future__ import annotations

import math
import os

from ...plan import Plan
from ...recipe import Recipe
from ...render.torchrun import grace_seconds
from ...validate.core import rule
from ...validate.rules_targets import inputs, under, unmounted
from .container import checkpoint_root, image_for
from .directives import PLAN_OPTIONS, field_clashes, option_name
from .spec import MOUNT_PATH
from .syntax import expand_hostlist

SLURM = ("slurm",)


@rule(
    "slurm-extra-sbatch-plan",
    "error",
    "targets.slurm.extra_sbatch",
    "extra_sbatch options that contradict what dtlaunch derives from the plan",
    SLURM,
)
def _extra_sbatch(r: Recipe, p: Plan):
    clash = [e for e in r.targets.slurm.extra_sbatch if option_name(e) in PLAN_OPTIONS]
    if clash:
        return (
            f"{', '.join(clash)}: dtlaunch sets these from the plan (nodes, tasks, GPUs, signal, requeue, output); "
            "a second value would give an allocation the plan did not size",
            "change the recipe's resources/targets.slurm fields instead, and drop these from extra_sbatch",
        )


@rule("slurm-submitit-ssh", "error", "targets.slurm.submit", "submitit through targets.slurm.ssh", SLURM)
def _submitit_ssh(r: Recipe, p: Plan):
    t = r.targets.slurm
    if t.submit == "submitit" and t.ssh is not None:
        return (
            "submitit runs sbatch on the machine that submits (and keeps its pickles there); it cannot submit "
            "through targets.slurm.ssh",
            "run on the login node without targets.slurm.ssh, or use targets.slurm.submit: sbatch",
        )


@rule("slurm-cpus", "warning", "targets.slurm.cpus_per_task", "a shared GPU node without a CPU count", SLURM)
def _slurm_cpus(r: Recipe, p: Plan):
    t = r.targets.slurm
    if r.resources.device().is_gpu and not t.exclusive and not (t.cpus_per_task or t.cpus_per_gpu):
        return (
            "not exclusive and no CPU count: SLURM gives the job one CPU per node by default, for "
            f"{p.gpus_per_node} ranks and their data loaders",
            "set targets.slurm.cpus_per_gpu (e.g. 8)",
        )


@rule("slurm-time-short", "warning", "targets.slurm.signal_seconds", "the preemption signal leaves no time", SLURM)
def _slurm_signal(r: Recipe, p: Plan):
    t = r.targets.slurm
    need = grace_seconds(r, p)
    if t.signal_seconds < need:
        return (
            f"USR2 comes {t.signal_seconds} s before the time limit, but stopping may take up to {need} s: the "
            f"step in progress (~{math.ceil(p.step_seconds)} s planned, with a margin), a checkpoint write "
            f"(~{math.ceil(p.checkpoint_write_seconds)} s) and the exit; a rank still saving at the limit is "
            "killed and the allocation's last steps are lost",
            f"set targets.slurm.signal_seconds to at least {need}",
        )


# ----------------------------------------------------------------------------- SLURM knobs


@rule(
    "slurm-extra-sbatch-field",
    "error",
    "targets.slurm.extra_sbatch",
    "extra_sbatch options that a targets.slurm field already writes",
    SLURM,
)
def _extra_field(r: Recipe, p: Plan):
    clash = field_clashes(r, p)
    if clash:
        return (
            "; ".join(f"{e!r} beside {w} (from targets.slurm.{f})" for e, w, f in clash)
            + ": two values for one option, or options sbatch refuses together",
            "set the targets.slurm field instead ("
            + ", ".join(sorted({f for _, _, f in clash}))
            + ") and drop the entry from extra_sbatch",
        )


@rule("slurm-mem-per-gpu-without-gpus", "error", "targets.slurm.mem_per_gpu", "mem_per_gpu on a CPU recipe", SLURM)
def _mem_per_gpu_cpu(r: Recipe, p: Plan):
    if r.targets.slurm.mem_per_gpu is not None and not r.resources.device().is_gpu:
        return (
            f"the job asks for no GPUs ({r.resources.accelerator}), so there is nothing to count memory per; "
            "sbatch refuses --mem-per-gpu without GPUs",
            "use targets.slurm.mem (per node) instead",
        )


@rule("slurm-cpus-per-gpu-without-gpus", "error", "targets.slurm.cpus_per_gpu", "cpus_per_gpu on a CPU recipe", SLURM)
def _cpus_per_gpu_cpu(r: Recipe, p: Plan):
    if r.targets.slurm.cpus_per_gpu is not None and not r.resources.device().is_gpu:
        return (
            f"the job asks for no GPUs ({r.resources.accelerator}), so there is nothing to count CPUs per; "
            "sbatch refuses --cpus-per-gpu without GPUs",
            "use targets.slurm.cpus_per_task instead",
        )


@rule("slurm-gpu-type-without-gpus", "warning", "targets.slurm.gpu_type", "gpu_type on a CPU recipe", SLURM)
def _gpu_type_cpu(r: Recipe, p: Plan):
    if r.targets.slurm.gpu_type is not None and not r.resources.device().is_gpu:
        return (
            f"the job asks for no GPUs ({r.resources.accelerator}): gpu_type is not used",
            "remove targets.slurm.gpu_type, or set resources.accelerator to a GPU",
        )


@rule(
    "slurm-gres-per-gpu-options",
    "warning",
    "targets.slurm.gpu_request",
    "per-GPU options on a cluster asked for GPUs as --gres",
    SLURM,
)
def _gres_per_gpu(r: Recipe, p: Plan):
    t = r.targets.slurm
    used = [f for f in ("cpus_per_gpu", "mem_per_gpu") if getattr(t, f) is not None]
    if t.gpu_request == "gres" and used and r.resources.device().is_gpu:
        return (
            f"{' and '.join(used)} (--{used[0].replace('_', '-')}) are options of SLURM's select/cons_tres, and "
            "gpu_request: gres is for clusters without it: sbatch there refuses them",
            "use cpus_per_task and mem (per node) on such a cluster, or gpu_request: gpus_per_node if it has cons_tres",
        )


@rule("slurm-nodelist-count", "error", "targets.slurm.nodelist", "a nodelist with more nodes than the job", SLURM)
def _nodelist_count(r: Recipe, p: Plan):
    t = r.targets.slurm
    if t.nodelist:
        hosts = expand_hostlist(t.nodelist)
        if len(hosts) > p.nodes:
            return (
                f"{t.nodelist} names {len(hosts)} nodes but the job has {p.nodes}: sbatch refuses a node list "
                "longer than --nodes (it would run on all of them)",
                f"list at most {p.nodes} node(s), or raise resources.nodes",
            )


@rule("slurm-nodelist-excluded", "error", "targets.slurm.exclude", "a node both listed and excluded", SLURM)
def _nodelist_excluded(r: Recipe, p: Plan):
    t = r.targets.slurm
    if t.nodelist and t.exclude:
        both = [h for h in expand_hostlist(t.nodelist) if h in set(expand_hostlist(t.exclude))]
        if both:
            return (
                f"{', '.join(both[:5])}{' ...' if len(both) > 5 else ''} in both nodelist and exclude: sbatch "
                "refuses the job (Invalid node name specified)",
                "remove those nodes from one of the two",
            )


@rule("slurm-mail-user-no-type", "warning", "targets.slurm.mail_user", "a mail address without mail events", SLURM)
def _mail_user(r: Recipe, p: Plan):
    t = r.targets.slurm
    if t.mail_user and not t.mail_type:
        return (
            f"mail_user {t.mail_user} gets no mail: without mail_type SLURM sends none",
            "add targets.slurm.mail_type, e.g. [END, FAIL]",
        )


@rule("slurm-image-no-container", "error", "resources.image", "an image but no SLURM container runtime", SLURM)
def _image_runtime(r: Recipe, p: Plan):
    if r.resources.image and r.targets.slurm.container is None:
        return (
            f"resources.image is {r.resources.image}, but targets.slurm.container does not say how this cluster "
            "runs containers: the job would run outside the image",
            "add targets.slurm.container: {runtime: pyxis} (srun --container-image) or {runtime: apptainer}",
        )


@rule("slurm-container-no-image", "error", "targets.slurm.container", "a SLURM container without an image", SLURM)
def _container_image(r: Recipe, p: Plan):
    if r.targets.slurm.container is not None and image_for(r) is None:
        return (
            "targets.slurm.container names a runtime but no image",
            "set resources.image (e.g. nvcr.io/nvidia/pytorch:24.05-py3) or targets.slurm.container.image",
        )


@rule(
    "slurm-container-checkpoint-mount",
    "error",
    "checkpoint.dir",
    "a checkpoint directory that cannot be mounted into the container",
    SLURM,
)
def _container_ckpt(r: Recipe, p: Plan):
    root = checkpoint_root(r) if r.targets.slurm.container is not None else None
    if root and not MOUNT_PATH.fullmatch(root):
        return (
            f"checkpoints go to {root}, outside the submit directory, so it is bind-mounted into the container; "
            "a mount path cannot hold ',', ':', spaces or quotes",
            "use a plainer checkpoint.dir, or a relative one (under the submit directory)",
        )


@rule(
    "slurm-container-input-unmounted",
    "error",
    "model.hf_weights",
    "weights or a data file the container does not see",
    SLURM,
)
def _container_inputs(r: Recipe, p: Plan):
    c = r.targets.slurm.container
    if c is None:
        return None
    root = checkpoint_root(r)
    missing = unmounted(r, [m.split(":")[1] for m in c.mounts] + ([root] if root else []))
    if missing:
        f, path = missing[0]
        src = path if f == "model.hf_weights" else os.path.dirname(path)
        return (
            f"{f} {path} is outside every mount: the container sees only the submit directory and "
            "targets.slurm.container.mounts, so every rank would fail to read it",
            f"add {src}:{src}:ro to targets.slurm.container.mounts",
            f,
        )


@rule(
    "slurm-input-node-local",
    "error",
    "model.hf_weights",
    "weights or a data file on a node-local path in a multi-node job",
    SLURM,
)
def _node_local_inputs(r: Recipe, p: Plan):
    if p.nodes < 2:
        return None
    local = [(f, path) for f, path in inputs(r) if under(path, NODE_LOCAL_DIRS)]
    if local:
        f, path = local[0]
        return (
            f"{f} {path} is on a node-local path: the other nodes of the job do not have it",
            "put it on storage every node mounts (the submit directory's file system, a shared /data)",
            f,
        )


# Node-local on every cluster: what lies here on the submitting machine is not on the compute nodes.
NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
