"""validate's rules for SkyPilot: what a cloud (or Kubernetes) will do to this job, and what the head-only
DeepSpeed launch (targets.sky.deepspeed_ssh) would carry through a remote shell."""

from __future__ import annotations

import math
import os

from ...pdsh import describe, unsafe
from ...plan import Plan
from ...recipe import Recipe
from ...validate.core import rule
from ...validate.rules_targets import unmounted

SKY = ("sky",)


@rule(
    "sky-checkpoint-storage",
    "error",
    "targets.sky.checkpoint_storage",
    "a multi-node, managed or spot SkyPilot job without shared checkpoint storage",
    SKY,
)
def _sky_storage(r: Recipe, p: Plan):
    if r.targets.sky.checkpoint_storage is None and (p.nodes > 1 or r.targets.sky.is_managed()):
        why = []
        if p.nodes > 1:
            why.append(f"{p.nodes} nodes each write their shards to their own disk, so no node sees a whole checkpoint")
        if r.targets.sky.is_managed():
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
    "sky-input-unmounted",
    "error",
    "model.hf_weights",
    "weights or a data file that is a path on the machine that renders",
    SKY,
)
def _sky_inputs(r: Recipe, p: Plan):
    sk = r.targets.sky
    st = sk.checkpoint_storage
    missing = unmounted(r, [m.path for m in sk.data_mounts] + ([st.mount] if st else []))
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
    from .render import on_kubernetes

    sk = r.targets.sky
    if not on_kubernetes(r):
        return None
    if sk.disk_tier is not None:
        return (
            "Kubernetes has no disk tiers (SkyPilot refuses disk_tier there at launch)",
            "remove targets.sky.disk_tier",
        )
    if not r.targets.sky.is_managed() and sk.autostop_minutes is not None and not sk.autodown:
        return (
            "Kubernetes clusters cannot be stopped, only torn down: autostop with autodown: false fails at launch",
            "set targets.sky.autodown: true (or autostop_minutes: null)",
        )
    return None


@rule("sky-k8s-spot", "warning", "targets.sky.spot", "spot capacity on Kubernetes", SKY)
def _sky_k8s_spot(r: Recipe, p: Plan):
    from .render import on_kubernetes

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
    from ...plan.cost import checkpoint_bytes
    from .render import DEFAULT_DISK_GB

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


@rule(
    "sky-straggler-same-nodes",
    "warning",
    "training.on_straggler",
    "a straggler's exit that SkyPilot recovers onto the same nodes",
    SKY,
)
def _sky_straggler(r: Recipe, p: Plan):
    if r.training.on_straggler != "exit":
        return None
    if not r.targets.sky.is_managed():
        return (
            "on_straggler: exit ends the attempt with 44 naming the slow node, and nothing recovers an unmanaged "
            "cluster's job: it ends there",
            "set targets.sky.managed: true and targets.sky.recovery: fresh_nodes, or keep on_straggler: warn",
        )
    if r.targets.sky.recovery_strategy() == "FAILOVER":
        return (
            "on_straggler: exit ends the attempt with 44 naming the slow node, but this managed job recovers with "
            "FAILOVER, which relaunches on the same cluster while it is up: the slow node comes back",
            "set targets.sky.recovery: fresh_nodes (the cluster is terminated and provisioned anew), or keep "
            "on_straggler: warn",
        )
    return None
