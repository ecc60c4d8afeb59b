"""Rules that belong to one target: what a SkyPilot cloud or a SLURM site will do to this job."""
from __future__ import annotations

import math
import re

from ..plan import Plan
from ..recipe import Recipe
from ..render.slurm import PLAN_OPTIONS
from ..render.torchrun import grace_seconds
from .core import rule

SKY, SLURM, LOCAL = ("sky",), ("slurm",), ("local",)
# DeepSpeed's pdsh runner writes each .deepspeed_env value into a remote shell inside double quotes.
_DS_UNSAFE = re.compile(r'[$`"\\\n\r]')


def _sky_managed(r: Recipe) -> bool:
    return r.targets.sky.managed or r.targets.sky.spot


@rule("sky-checkpoint-storage", "error", "targets.sky.checkpoint_storage",
      "a multi-node, managed or spot SkyPilot job without shared checkpoint storage", SKY)
def _sky_storage(r: Recipe, p: Plan):
    if r.targets.sky.checkpoint_storage is None and (p.nodes > 1 or _sky_managed(r)):
        why = []
        if p.nodes > 1:
            why.append(f"{p.nodes} nodes each write their shards to their own disk, so no node sees a whole checkpoint")
        if _sky_managed(r):
            why.append("a managed-job recovery starts on fresh VMs and would resume from step 0")
        return ("checkpoints would go to node-local disk: " + "; ".join(why),
                "add targets.sky.checkpoint_storage: {bucket: s3://YOUR-BUCKET/ckpt} (or {volume: NAME}); it is "
                "mounted at /checkpoints on every node")


@rule("sky-checkpoint-dir-outside-storage", "error", "checkpoint.dir",
      "checkpoint.dir outside the mounted checkpoint storage", SKY)
def _sky_dir(r: Recipe, p: Plan):
    st = r.targets.sky.checkpoint_storage
    d = r.checkpoint.dir
    if st is not None and d and not (d == st.mount or d.startswith(st.mount.rstrip("/") + "/")):
        return (f"checkpoint.dir {d!r} is not under the storage mount {st.mount!r}: checkpoints would stay on node disks",
                f"set checkpoint.dir to {st.mount}/{{run_id}} or leave it unset")


@rule("sky-aws-efa-interfaces", "warning", "resources.network",
      "AWS network_tier: best across nodes uses one EFA interface by default", SKY)
def _aws_efa(r: Recipe, p: Plan):
    where = (r.targets.sky.infra or r.targets.sky.cloud or "").lower()
    if where.startswith("aws") and r.resources.network in ("best", "efa") and p.nodes > 1:
        return ("SkyPilot attaches only one of up to 32 EFA interfaces unless aws.use_internal_ips is set, so the "
                "fabric delivers a fraction of what the plan assumes",
                "set `aws: {use_internal_ips: true}` in ~/.sky/config.yaml (it cannot be set per task)")


@rule("cpu-multi-node", "warning", "resources.accelerator", "CPU accelerator across cloud nodes", SKY)
def _cpu_nodes(r: Recipe, p: Plan):
    if not r.resources.device().is_gpu and p.nodes > 1:
        return ("cpu:N on the cloud trains on CPUs", "use a GPU accelerator such as H100:8")


@rule("deepspeed-launcher-target", "error", "parallelism.launcher", "the deepspeed launcher outside SkyPilot",
      SLURM + LOCAL)
def _ds_launcher_target(r: Recipe, p: Plan):
    if r.parallelism.launcher == "deepspeed":
        return ("launcher: deepspeed is used on SkyPilot only; here torchrun starts the DeepSpeed engines on every node "
                "(the same engines, without pdsh or ssh between nodes)", "remove parallelism.launcher (torchrun)")


@rule("deepspeed-ssh-env", "error", "env", "env values the head-only DeepSpeed launch would run as shell", SKY)
def _ds_env(r: Recipe, p: Plan):
    if r.parallelism.launcher == "deepspeed" and r.targets.sky.deepspeed_ssh:
        bad = sorted(k for k, v in r.env.items() if _DS_UNSAFE.search(v))
        if bad:
            return (f"{', '.join(bad)}: DeepSpeed's pdsh launch writes env values into each worker's shell inside double "
                    "quotes, where $, `, \", \\ and line breaks would run as shell code",
                    "remove those characters, or leave targets.sky.deepspeed_ssh off (every node launches its own "
                    "workers and gets the environment from SkyPilot)")


@rule("deepspeed-ssh-secrets", "error", "secrets", "secrets with the head-only DeepSpeed launch", SKY)
def _ds_secrets(r: Recipe, p: Plan):
    if r.parallelism.launcher == "deepspeed" and r.targets.sky.deepspeed_ssh and r.secrets:
        return ("the head-only DeepSpeed launch can only pass variables to other nodes through .deepspeed_env, which "
                "DeepSpeed puts on its pdsh command line and in the job log: secrets would leak",
                "leave targets.sky.deepspeed_ssh off (each node then gets its secrets from SkyPilot)")


@rule("slurm-extra-sbatch-plan", "error", "targets.slurm.extra_sbatch",
      "extra_sbatch options that contradict what dtlaunch derives from the plan", SLURM)
def _extra_sbatch(r: Recipe, p: Plan):
    clash = [e for e in r.targets.slurm.extra_sbatch if e.strip().partition("=")[0].split()[0] in PLAN_OPTIONS]
    if clash:
        return (f"{', '.join(clash)}: dtlaunch sets these from the plan (nodes, tasks, GPUs, signal, requeue, output); "
                "a second value would give an allocation the plan did not size",
                "change the recipe's resources/targets.slurm fields instead, and drop these from extra_sbatch")


@rule("slurm-submitit-ssh", "error", "targets.slurm.submit", "submitit through targets.slurm.ssh", SLURM)
def _submitit_ssh(r: Recipe, p: Plan):
    t = r.targets.slurm
    if t.submit == "submitit" and t.ssh is not None:
        return ("submitit runs sbatch on the machine that submits (and keeps its pickles there); it cannot submit "
                "through targets.slurm.ssh", "run on the login node without targets.slurm.ssh, or use "
                "targets.slurm.submit: sbatch")


@rule("slurm-cpus", "warning", "targets.slurm.cpus_per_task", "a shared GPU node without a CPU count", SLURM)
def _slurm_cpus(r: Recipe, p: Plan):
    t = r.targets.slurm
    if r.resources.device().is_gpu and not t.exclusive and not (t.cpus_per_task or t.cpus_per_gpu):
        return ("not exclusive and no CPU count: SLURM gives the job one CPU per node by default, for "
                f"{p.gpus_per_node} ranks and their data loaders", "set targets.slurm.cpus_per_gpu (e.g. 8)")


@rule("slurm-time-short", "warning", "targets.slurm.signal_seconds", "the preemption signal leaves no time", SLURM)
def _slurm_signal(r: Recipe, p: Plan):
    t = r.targets.slurm
    need = grace_seconds(r, p)
    if t.signal_seconds < need:
        return (f"USR2 comes {t.signal_seconds} s before the time limit, but saving may take up to {need} s "
                f"(a checkpoint write is ~{math.ceil(p.checkpoint_write_seconds)} s)",
                f"set targets.slurm.signal_seconds to at least {need}")
