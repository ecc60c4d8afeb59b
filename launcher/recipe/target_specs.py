"""The recipe's `targets` sections (local, SLURM with its containers, SkyPilot with its checkpoint storage):
what each scheduler accepts, checked where it is written rather than by sbatch or sky after the queue.
"""
from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .. import catalog
from .fields import BUCKET, Int, Line, Str, _Strict, suggest


class LocalTarget(_Strict):
    max_restarts: Int(0, 1000) = 3
    run_dir: Str = "runs"


class SshSpec(_Strict):
    host: str = Field(max_length=255)
    user: str | None = Field(None, max_length=255)
    port: Int(1, 65535) = 22
    key_file: Str | None = None
    known_hosts: Str | None = None
    accept_unknown_host: bool = False
    remote_dir: Str = "~/.dtlaunch/jobs"


# Paths that go into a bind-mount list (pyxis --container-mounts, apptainer --bind): ',' separates mounts and
# ':' source, destination and flags, so neither may appear in a path; nor may anything a shell would expand.
_MOUNT_PATH = r"/[A-Za-z0-9._/+@%=~-]*"
_MOUNT = re.compile(rf"({_MOUNT_PATH})(?::({_MOUNT_PATH}))?(?::(ro|rw))?", re.ASCII)
MOUNT_PATH = re.compile(_MOUNT_PATH, re.ASCII)
# A runtime-specific image as the site spells it: a file on shared storage (.sqsh, .sif), an enroot URI
# (nvcr.io#nvidia/pytorch:24.05-py3) or an Apptainer URI (docker://..., oras://...). No shell or list syntax.
_SITE_IMAGE = re.compile(r"[A-Za-z0-9_./~][A-Za-z0-9._/:@#+=%~-]*", re.ASCII)


class SlurmContainer(_Strict):
    """The job's steps run in a container: pyxis (srun --container-image) or Apptainer/Singularity
    (apptainer exec). The submit directory is always mounted at its own path."""

    runtime: Literal["pyxis", "apptainer", "singularity"] = Field(
        description="pyxis: srun's --container-* options (enroot); apptainer/singularity: `apptainer exec` on "
                    "each node")
    image: str | None = Field(
        None, max_length=1024,
        description="the image as this cluster's runtime spells it (e.g. /shared/images/train.sqsh or .sif); "
                    "default: resources.image, converted for the runtime")
    mounts: list[Annotated[str, Field(max_length=2048)]] = Field(
        default_factory=list, max_length=100,
        description="extra bind mounts SRC[:DST[:ro|rw]], absolute paths, e.g. /datasets:/data:ro")
    workdir: str | None = Field(
        None, max_length=1024, pattern=rf"^{_MOUNT_PATH}$",
        description="working directory inside the container (default: the submit directory)")

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and not _SITE_IMAGE.fullmatch(v):
            raise ValueError(f"{v[:80]!r}: an image path or URI of letters, digits and ._/:@#+=%~- only (no spaces, "
                             "commas, quotes or $), not starting with '-'")
        return v

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        out = []
        for m in v:
            mm = _MOUNT.fullmatch(m)
            if not mm:
                raise ValueError(f"{m[:80]!r}: a mount is SRC[:DST[:ro|rw]] with absolute paths of letters, digits and "
                                 "._/+@%=~- (no ',' or ':' inside a path), e.g. /datasets:/data:ro")
            src, dst, flags = mm.groups()
            out.append(f"{src}:{dst or src}" + (f":{flags}" if flags else ""))  # pyxis needs DST; both read this
        return out


class SlurmTarget(_Strict):
    partition: Line(256) | None = None
    account: Line(256) | None = None
    qos: Line(256) | None = None
    time: str = Field("24:00:00", max_length=32, description="SLURM time limit, e.g. 24:00:00 or 2-00:00:00")
    cpus_per_task: Int(1, 100000) | None = None
    mem: str | None = Field(None, max_length=32, description="memory per node (--mem), e.g. 0 (all), 500G")
    mem_per_gpu: str | None = Field(None, max_length=32,
                                       description="memory per allocated GPU (--mem-per-gpu), e.g. 80G; instead of mem")
    constraint: Line(1024) | None = None
    exclusive: bool = True
    signal_seconds: Int(1, 65535, "send USR2 this long before the time limit") = 120
    max_requeues: Int(0, 10_000) = 5
    max_failures: Int(0, 10_000) = 3
    max_restarts: Int(0, 1000, "torchrun restarts inside one allocation") = 2
    submit: Literal["sbatch", "submitit"] = "sbatch"
    array_parallelism: Int(1, 100000) | None = Field(
        None, description="sweeps: at most this many array tasks run at once (sbatch --array=0-N%P)")
    cpus_per_gpu: Int(1, 10000) | None = Field(
        None, description="CPUs per GPU (sbatch --cpus-per-gpu), instead of cpus_per_task; GPU recipes only")
    gpu_request: Literal["gpus_per_node", "gres"] = Field(
        "gpus_per_node", description="how GPUs are asked for: --gpus-per-node (select/cons_tres), or --gres=gpu:N "
                                     "for clusters without cons_tres")
    gpu_type: str | None = Field(
        None, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="the cluster's GPU type name (its GRES type), e.g. a100: --gpus-per-node=a100:8 or "
                    "--gres=gpu:a100:8")
    nodelist: str | None = Field(None, max_length=4096,
                                    description="run on these nodes (--nodelist), e.g. gpu[01-04] or a list of names")
    exclude: str | None = Field(None, max_length=4096,
                                   description="never run on these nodes (--exclude), e.g. gpu07,gpu[10-12]")
    reservation: str | None = Field(None, max_length=256, pattern=r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$",
                                       description="allocate from this reservation (--reservation)")
    dependency: str | None = Field(
        None, max_length=1024,
        description="start after other jobs (--dependency), e.g. afterok:123 or singleton; `dtlaunch up --after` "
                    "adds one")
    mail_type: list[str] | None = Field(None, max_length=20,
                                           description="mail on these events (--mail-type), e.g. [END, FAIL]")
    mail_user: str | None = Field(None, max_length=256, pattern=r"^[A-Za-z0-9._%+-]+(@[A-Za-z0-9.-]+)?$",
                                     description="who gets the mail (--mail-user; default: the submitting user)")
    container: SlurmContainer | None = Field(
        None, description="run the steps in a container: {runtime: pyxis|apptainer, image?, mounts?, workdir?}")
    ssh: SshSpec | None = None
    extra_sbatch: list[Line(1024)] = Field(default_factory=list, max_length=100)
    setup: list[Str] = Field(default_factory=list, max_length=1000,
                             description="shell lines run before training, e.g. module load")

    @field_validator("time", mode="before")
    @classmethod
    def _minutes(cls, v):
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v  # `time: 90` means 90 minutes

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        from .slurmtime import parse_time

        parse_time(v)  # raises ValueError with the accepted forms
        return v

    @field_validator("mem", "mem_per_gpu", mode="before")
    @classmethod
    def _mem_number(cls, v):
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v  # `mem: 0`, `mem: 4096` (MB)

    @field_validator("mem")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        from .slurmsyntax import parse_mem

        return None if v is None else parse_mem(v)

    @field_validator("mem_per_gpu")
    @classmethod
    def _mem_per_gpu(cls, v: str | None, info: ValidationInfo) -> str | None:
        from .slurmsyntax import parse_mem

        if v is None:
            return v
        parse_mem(v, zero=False)
        if info.data.get("mem") is not None:
            raise ValueError("set only one of `mem` (per node) and `mem_per_gpu`: sbatch refuses both "
                             "(--mem and --mem-per-gpu are mutually exclusive)")
        return v

    @field_validator("cpus_per_gpu")
    @classmethod
    def _cpus_per_gpu(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("cpus_per_task") is not None:
            raise ValueError("set only one of `cpus_per_task` and `cpus_per_gpu`: sbatch refuses both "
                             "(--cpus-per-gpu is mutually exclusive with --cpus-per-task)")
        return v

    @field_validator("nodelist", "exclude", mode="before")
    @classmethod
    def _hosts(cls, v):
        from .slurmsyntax import parse_hostlist

        return None if v is None else parse_hostlist(v)

    @field_validator("dependency")
    @classmethod
    def _dependency(cls, v: str | None) -> str | None:
        from .slurmsyntax import parse_dependency

        return None if v is None else parse_dependency(v)

    @field_validator("mail_type", mode="before")
    @classmethod
    def _mail_type(cls, v):
        from .slurmsyntax import parse_mail_types

        return None if v is None else parse_mail_types(v)


class SkyStorage(_Strict):
    """Checkpoint storage every node (and every recovery) sees: a bucket or a SkyPilot volume, mounted."""

    bucket: str | None = Field(None, max_length=1024, description="e.g. s3://my-bucket/ckpt, gs://..., r2://...")
    volume: str | None = Field(None, max_length=256, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$",
                                  description="a SkyPilot volume (sky volumes apply), instead of a bucket")
    mount: str = Field("/checkpoints", max_length=1024, description="where the nodes see it")
    mode: Literal["MOUNT_CACHED", "MOUNT"] = Field(
        "MOUNT_CACHED", description="MOUNT_CACHED writes to local disk and uploads in the background (fast saves)")

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, v: str | None) -> str | None:
        if v is not None and not BUCKET.match(v):
            raise ValueError(f"{v!r} is not a bucket URI: use s3://, gs://, r2://, cos://, oci://, nebius:// or https://")
        return v

    @field_validator("mount")
    @classmethod
    def _mount(cls, v: str) -> str:
        if not (v.startswith("/") or v.startswith("~/")) or "{" in v or ".." in v.split("/"):
            raise ValueError(f"{v!r}: the mount point must be an absolute path or start with ~/")
        return v.rstrip("/") or "/"

    @model_validator(mode="after")
    def _one_source(self) -> SkyStorage:
        if (self.bucket is None) == (self.volume is None):
            raise ValueError("give exactly one of `bucket` and `volume`")
        return self


class SkyTarget(_Strict):
    infra: str | None = Field(None, max_length=256, description="e.g. aws, gcp/us-central1, k8s")
    cloud: str | None = Field(None, max_length=64)
    region: str | None = Field(None, max_length=128)
    zone: str | None = Field(None, max_length=128)
    spot: bool = False
    managed: bool = False
    disk_size: Int(1, 65536) = 512
    max_restarts_on_errors: Int(0, 1000) = 3
    max_restarts: Int(0, 1000, "torchrun restarts inside one launch") = 2
    setup: list[Str] = Field(default_factory=list, max_length=1000)
    workdir: Str | None = None
    checkpoint_storage: SkyStorage | None = Field(
        None, description="shared checkpoint storage; required for multi-node, managed and spot jobs")
    autostop_minutes: Int(1, 100000) | None = Field(
        10, description="`sky launch` clusters: stop after this many idle minutes (null: never)")
    autodown: bool = Field(True, description="with autostop: tear the cluster down instead of stopping it")
    deepspeed_ssh: bool = Field(
        False, description="parallelism.launcher: deepspeed: the head starts every node's workers over ssh/pdsh "
                           "(default: every node runs DeepSpeed's launcher itself, --no_ssh)")
    accelerators: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list, max_length=16,
        description="fallbacks after resources.accelerator, e.g. [A100-80GB:8]: each is planned on its own, those "
                    "that cannot fit are dropped; same device count per node")
    fallback: Literal["ordered", "any_of"] = Field(
        "ordered", description="with accelerators: ordered = try the cheapest plan first (dtlaunch's cost estimate); "
                               "any_of = let SkyPilot pick the cheapest available")
    instance_type: str | None = Field(None, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                         description="a cloud instance type, e.g. p5.48xlarge, a3-highgpu-8g")
    cpus: str | None = Field(None, max_length=16, description="vCPUs per node: N, or N+ for at least N")
    memory: str | None = Field(None, max_length=16, description="memory per node in GB: N, or N+ for at least N")
    ports: list[int | str] = Field(default_factory=list, max_length=100,
                                         description="ports to open on the nodes: 8080 or ranges like 10000-10010")
    disk_tier: Literal["low", "medium", "high", "ultra", "best"] | None = Field(
        None, description="disk performance tier (SkyPilot's disk_tier)")

    @field_validator("accelerators")
    @classmethod
    def _fallbacks(cls, v: list[str]) -> list[str]:
        for a in v:
            name, _ = catalog.parse_accelerator(a)
            if name not in catalog.ACCELERATORS:
                raise ValueError(f"unknown accelerator {name!r}{suggest(name, catalog.ACCELERATORS)}; "
                                 f"known: {', '.join(catalog.ACCELERATORS)}")
            if not catalog.ACCELERATORS[name].is_gpu:
                raise ValueError(f"{a!r}: SkyPilot has no cpu accelerator; a fallback is a GPU type, e.g. A100-80GB:8")
        return v

    @field_validator("cpus", "memory", mode="before")
    @classmethod
    def _amount(cls, v):
        if v is None:
            return v
        if isinstance(v, bool):
            raise ValueError("expected a number such as 8 or 8+, not true/false")
        if isinstance(v, int):
            v = str(v) if 0 < v < 10**6 else "out of range"
        elif isinstance(v, float):
            v = format(v, "g")
        if isinstance(v, str) and re.fullmatch(r"\d{1,6}(\.\d{1,3})?\+?", v, flags=re.ASCII) \
                and float(v.rstrip("+")) > 0:
            return v
        raise ValueError(f"{str(v)[:40]!r}: a positive number, optionally followed by + (at least), e.g. 8 or 32+")

    @field_validator("ports", mode="before")
    @classmethod
    def _ports(cls, v):
        if not isinstance(v, list):
            raise ValueError("ports is a list, e.g. [8080, 10000-10010]")
        out: list[int | str] = []
        for p in v:
            if isinstance(p, bool):
                raise ValueError("a port is a number 1-65535 or a range like 10000-10010, not true/false")
            lo, hi = (p, p) if isinstance(p, int) else (None, None)
            if isinstance(p, str):
                m = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", p, flags=re.ASCII)
                if m:
                    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            if lo is None or not 1 <= lo <= hi <= 65535:
                raise ValueError(f"{str(p)[:40]!r}: a port is a number 1-65535 or a range LOW-HIGH within it")
            out.append(lo if lo == hi else f"{lo}-{hi}")
        return out
