"""Rules that belong to one target: what a SkyPilot cloud or a SLURM site will do to this job."""

from __future__ import annotations

import math
import os

from ..pdsh import describe, unsafe
from ..plan import Plan
from ..recipe import Recipe
from ..recipe.slurmsyntax import expand_hostlist
from ..recipe.target_specs import MOUNT_PATH
from ..render.slurm_container import checkpoint_root, image_for
from ..render.slurm_directives import PLAN_OPTIONS, field_clashes, option_name
from ..render.torchrun import grace_seconds
from .core import rule

SKY, SLURM, LOCAL = ("sky",), ("slurm",), ("local",)


def _sky_managed(r: Recipe) -> bool:
    return r.targets.sky.managed or r.targets.sky.spot


@rule(
    "sky-checkpoint-storage",
    "error",
    "targets.sky.checkpoint_storage",
    "a multi-node, managed or spot SkyPilot job without shared checkpoint storage",
    SKY,
)
def _sky_storage(r: Recipe, p: Plan):
    if r.targets.sky.checkpoint_storage is None and (p.nodes > 1 or _sky_managed(r)):
        why = []
        if p.nodes > 1:
            why.append(f"{p.nodes} nodes each write their shards to their own disk, so no node sees a whole checkpoint")
        if _sky_managed(r):
            why.append("a managed-job recovery starts on fresh VMs and would resume from step 0")
        return (
            "checkpoints would go to node-local disk: " + "; ".join(why),
            "add targets.sky.checkpoint_storage: {bucket: s3://YOUR-BUCKET/ckpt} (or {volume: NAME}); it is "
            "mounted at /checkpoints on every node",
        )


@rule(
    "sky-checkpoint-dir-outside-storage",
    "error",
    "checkpoint.dir",
    "checkpoint.dir outside the mounted checkpoint storage",
    SKY,
)
def _sky_dir(r: Recipe, p: Plan):
    st = r.targets.sky.checkpoint_storage
    d = r.checkpoint.dir
    if st is not None and d and not (d == st.mount or d.startswith(st.mount.rstrip("/") + "/")):
        return (
            f"checkpoint.dir {d!r} is not under the storage mount {st.mount!r}: checkpoints would stay on node disks",
            f"set checkpoint.dir to {st.mount}/{{run_id}} or leave it unset",
        )


@rule(
    "sky-aws-efa-interfaces",
    "warning",
    "resources.network",
    "AWS network_tier: best across nodes uses one EFA interface by default",
    SKY,
)
def _aws_efa(r: Recipe, p: Plan):
    where = (r.targets.sky.infra or r.targets.sky.cloud or "").lower()
    if where.startswith("aws") and r.resources.network in ("best", "efa") and p.nodes > 1:
        return (
            "SkyPilot attaches only one of up to 32 EFA interfaces unless aws.use_internal_ips is set, so the "
            "fabric delivers a fraction of what the plan assumes",
            "set `aws: {use_internal_ips: true}` in ~/.sky/config.yaml (it cannot be set per task)",
        )


@rule("cpu-multi-node", "warning", "resources.accelerator", "CPU accelerator across cloud nodes", SKY)
def _cpu_nodes(r: Recipe, p: Plan):
    if not r.resources.device().is_gpu and p.nodes > 1:
        return ("cpu:N on the cloud trains on CPUs", "use a GPU accelerator such as H100:8")


@rule(
    "deepspeed-launcher-target",
    "error",
    "parallelism.launcher",
    "the deepspeed launcher outside SkyPilot",
    SLURM + LOCAL,
)
def _ds_launcher_target(r: Recipe, p: Plan):
    if r.parallelism.launcher == "deepspeed":
        return (
            "launcher: deepspeed is used on SkyPilot only; here torchrun starts the DeepSpeed engines on every node "
            "(the same engines, without pdsh or ssh between nodes)",
            "remove parallelism.launcher (torchrun)",
        )


def _ds_ssh(r: Recipe) -> bool:
    """The head-only DeepSpeed launch: values reach the other nodes through one remote shell (launcher/pdsh.py)."""
    return r.parallelism.launcher == "deepspeed" and r.targets.sky.deepspeed_ssh


_DS_SSH_FIX = (
    "leave targets.sky.deepspeed_ssh off (every node launches its own workers and gets the environment "
    "from SkyPilot: no value passes through a remote shell)"
)


@rule("deepspeed-ssh-env", "error", "env", "env values the head-only DeepSpeed launch would run as shell", SKY)
def _ds_env(r: Recipe, p: Plan):
    bad = sorted(k for k, v in r.env.items() if unsafe(v)) if _ds_ssh(r) else []
    if bad:
        chars = describe("".join(sorted({c for k in bad for c in unsafe(r.env[k])})))
        return (
            f"{', '.join(bad)}: DeepSpeed's pdsh launch writes env values into each worker's shell inside double "
            f"quotes, where {chars} would run as shell code or break the launch",
            "remove those characters, or " + _DS_SSH_FIX,
            f"env.{bad[0]}",
        )


def _ds_ssh_values(r: Recipe) -> list[tuple[str, str, str]]:
    """(field, value, launcher.pdsh kind) of what the head-only launch carries besides env: the checkpoint
    directory (in .deepspeed_env) and the entrypoint's words (on pdsh's command line)."""
    out = []
    st = r.targets.sky.checkpoint_storage
    if r.checkpoint.dir:
        out.append(("checkpoint.dir", r.checkpoint.dir, "env"))
    elif st is not None:  # the checkpoint directory is then {mount}/{run_id}
        out.append(("targets.sky.checkpoint_storage.mount", st.mount, "env"))
    ep = r.entrypoint
    if ep is not None:
        out.append(("entrypoint.script", ep.script, "arg") if ep.script else ("entrypoint.module", ep.module, "arg"))
        out += [(f"entrypoint.args.{i}", a, "arg") for i, a in enumerate(ep.args)]
    return out


@rule(
    "deepspeed-ssh-values",
    "error",
    "checkpoint.dir",
    "a checkpoint directory or entrypoint argument the head-only DeepSpeed launch would run as shell",
    SKY,
)
def _ds_values(r: Recipe, p: Plan):
    for field, value, kind in _ds_ssh_values(r) if _ds_ssh(r) else []:
        chars = unsafe(value, kind)
        if chars:
            where = (
                "in .deepspeed_env, which it writes into each worker's shell inside double quotes"
                if kind == "env"
                else "on pdsh's command line, bare (in double quotes when it holds a space)"
            )
            return (
                f"{value!r} holds {describe(chars)}: DeepSpeed's pdsh launch passes it {where}, unescaped, so it "
                "would run as shell code on every node or break the launch",
                f"remove those characters from {field}, or " + _DS_SSH_FIX,
                field,
            )


@rule("deepspeed-ssh-secrets", "error", "secrets", "secrets with the head-only DeepSpeed launch", SKY)
def _ds_secrets(r: Recipe, p: Plan):
    if _ds_ssh(r) and r.secrets:
        return (
            "the head-only DeepSpeed launch can only pass variables to other nodes through .deepspeed_env, which "
            "DeepSpeed puts on its pdsh command line and in the job log: secrets would leak",
            "leave targets.sky.deepspeed_ssh off (each node then gets its secrets from SkyPilot)",
        )


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


def _inputs(r: Recipe) -> list[tuple[str, str]]:
    """(field, absolute path) of the files every node must read: the weights and a data file."""
    out = []
    if r.model.hf_weights and str(r.model.hf_weights).startswith("/"):
        out.append(("model.hf_weights", str(r.model.hf_weights)))
    d = r.training.data
    if d.source == "file" and d.path and d.path.startswith("/"):
        out.append(("training.data.path", d.path))
    return out


def _under(path: str, dirs) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _unmounted(r: Recipe, mounted: list[str]) -> list[tuple[str, str]]:
    return [(f, path) for f, path in _inputs(r) if not _under(path, mounted)]


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
    missing = _unmounted(r, [m.split(":")[1] for m in c.mounts] + ([root] if root else []))
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
    local = [(f, path) for f, path in _inputs(r) if _under(path, NODE_LOCAL_DIRS)]
    if local:
        f, path = local[0]
        return (
            f"{f} {path} is on a node-local path: the other nodes of the job do not have it",
            "put it on storage every node mounts (the submit directory's file system, a shared /data)",
            f,
        )


# Node-local on every cluster: what lies here on the submitting machine is not on the compute nodes.
NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")


@rule(
    "sky-input-unmounted",
    "error",
    "model.hf_weights",
    "weights or a data file that is a path on the machine that renders",
    SKY,
)
def _sky_inputs(r: Recipe, p: Plan):
    sk = r.targets.sky
    st = sk.checkpoint_storage
    missing = _unmounted(r, [m.path for m in sk.data_mounts] + ([st.mount] if st else []))
    if missing:
        f, path = missing[0]
        return (
            f"{f} {path} is a path on this machine: the cloud nodes do not have it, and every node would "
            "fail to read it (then be relaunched)",
            f"mount it: targets.sky.data_mounts: [{{path: /inputs, source: s3://BUCKET/..., mode: COPY}}] (or "
            f"source: {path if f == 'model.hf_weights' else os.path.dirname(path)} to copy it from here), and set "
            f"{f} under /inputs",
            f,
        )


@rule("image-local", "warning", "resources.image", "resources.image on the local target", LOCAL)
def _image_local(r: Recipe, p: Plan):
    if r.resources.image:
        return (
            f"the local target runs this machine's Python, not {r.resources.image}",
            "fine for a quick test; the image is used on SLURM and SkyPilot",
        )


# ----------------------------------------------------------------------------- SkyPilot knobs


@rule(
    "sky-fallback-dropped",
    "warning",
    "targets.sky.accelerators",
    "accelerator fallbacks that cannot run the job",
    SKY,
    choices=True,
)
def _fallbacks(r: Recipe, p: Plan, choices):
    dropped = choices.dropped if choices is not None else []
    if dropped:
        return (
            "; ".join(f"{c.accelerator}: {c.dropped}" for c in dropped)
            + " -- the task does not ask for "
            + ("it" if len(dropped) == 1 else "them"),
            "remove them, or change the recipe so that they fit (dtlaunch plan shows each one)",
        )


@rule(
    "sky-instance-type-fallbacks",
    "error",
    "targets.sky.instance_type",
    "an instance type together with accelerator fallbacks",
    SKY,
)
def _instance_fallbacks(r: Recipe, p: Plan):
    sk = r.targets.sky
    if sk.instance_type and sk.accelerators and r.resources.device().is_gpu:
        return (
            f"instance type {sk.instance_type} has one kind of GPU, but the task lists "
            f"{len(sk.accelerators) + 1} accelerators: every choice but one would fail to launch",
            "drop targets.sky.instance_type, or the fallbacks",
        )


@rule("sky-cpus-fewer-than-ranks", "error", "targets.sky.cpus", "fewer vCPUs than CPU ranks", SKY)
def _sky_cpus(r: Recipe, p: Plan):
    cpus = r.targets.sky.cpus
    if cpus is not None and not r.resources.device().is_gpu and float(cpus.rstrip("+")) < r.resources.per_node:
        return (
            f"{r.resources.accelerator} runs {r.resources.per_node} ranks per node, but cpus: {cpus} may give "
            "fewer cores than that",
            f"set targets.sky.cpus to at least {r.resources.per_node}+ (or leave it unset)",
        )


@rule("sky-k8s-unsupported", "error", "targets.sky", "a SkyPilot feature Kubernetes does not have", SKY)
def _sky_k8s(r: Recipe, p: Plan):
    from ..render.sky import is_managed, on_kubernetes

    sk = r.targets.sky
    if not on_kubernetes(r):
        return None
    if sk.disk_tier is not None:
        return (
            "Kubernetes has no disk tiers (SkyPilot refuses disk_tier there at launch)",
            "remove targets.sky.disk_tier",
        )
    if not is_managed(r) and sk.autostop_minutes is not None and not sk.autodown:
        return (
            "Kubernetes clusters cannot be stopped, only torn down: autostop with autodown: false fails at launch",
            "set targets.sky.autodown: true (or autostop_minutes: null)",
        )
    return None


@rule("sky-k8s-spot", "warning", "targets.sky.spot", "spot capacity on Kubernetes", SKY)
def _sky_k8s_spot(r: Recipe, p: Plan):
    from ..render.sky import on_kubernetes

    if on_kubernetes(r) and r.targets.sky.spot:
        return (
            "SkyPilot places spot jobs on Kubernetes only where the cluster labels spot nodes (GKE, some "
            "others); elsewhere the launch finds no capacity",
            "check the cluster's node labels, or spot: false",
        )


@rule(
    "sky-disk-checkpoint-cache",
    "error",
    "targets.sky.disk_size",
    "a node disk too small for the MOUNT_CACHED checkpoint cache",
    SKY,
)
def _sky_disk(r: Recipe, p: Plan):
    from ..plan.cost import checkpoint_bytes
    from ..render.sky import DEFAULT_DISK_GB

    storage = r.targets.sky.checkpoint_storage
    if storage is None or storage.bucket is None or storage.mode != "MOUNT_CACHED":
        return None
    per_node = checkpoint_bytes(p.params, p.layout.optimizer) / max(1, p.nodes) / 1e9
    # rclone caches what it writes until uploaded and what it reads on a resume: a resume read and a save
    # within the cache's lifetime hold two checkpoints' share of this node, beside the image and the system.
    need = math.ceil(2 * per_node + IMAGE_AND_SYSTEM_GB)
    disk = r.targets.sky.disk_size or DEFAULT_DISK_GB
    if disk < need:
        return (
            f"each node writes ~{per_node:.0f} GB per checkpoint into rclone's local cache before it uploads, and "
            f"a resume reads as much: {need} GB of disk needed, the nodes get {disk} GB"
            + ("" if r.targets.sky.disk_size else " (SkyPilot's default)"),
            f"set targets.sky.disk_size: {need} (or more)",
        )
    return None


IMAGE_AND_SYSTEM_GB = 50  # an NGC-size image (~20 GB unpacked) with the system and logs
