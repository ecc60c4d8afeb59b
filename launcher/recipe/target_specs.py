"""The recipe's `targets` sections (local, SLURM with its containers, SkyPilot with its checkpoint storage):
what each scheduler accepts, checked where it is written rather than by sbatch or sky after the queue.
"""

import re
from typing import Annotated, Literal

from msgspec import Meta

from .. import catalog
from .fields import BUCKET, Doc, Int, Invalid, Line, Spec, Str, Text, checked, suggest


class LocalTarget(Spec, kw_only=True):
    max_restarts: Int(0, 1000) = 3
    run_dir: Str = "runs"


class SshSpec(Spec, kw_only=True):
    host: Text(255)
    user: Text(255) | None = None
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


class SlurmContainer(Spec, kw_only=True):
    """The job's steps run in a container: pyxis (srun --container-image) or Apptainer/Singularity
    (apptainer exec). The submit directory is always mounted at its own path."""

    runtime: Doc(
        "pyxis: srun's --container-* options (enroot); apptainer/singularity: `apptainer exec` on each node",
        Literal["pyxis", "apptainer", "singularity"],
    )
    image: (
        Text(
            1024,
            "the image as this cluster's runtime spells it (e.g. /shared/images/train.sqsh or .sif); "
            "default: resources.image, converted for the runtime",
        )
        | None
    ) = None
    mounts: Annotated[
        list[Text(2048)],
        Meta(
            max_length=100, description="extra bind mounts SRC[:DST[:ro|rw]], absolute paths, e.g. /datasets:/data:ro"
        ),
    ] = []
    workdir: (
        Text(1024, "working directory inside the container (default: the submit directory)", rf"^{_MOUNT_PATH}\Z")
        | None
    ) = None

    def __post_init__(self) -> None:
        v = self.image
        if v is not None and not _SITE_IMAGE.fullmatch(v):
            raise Invalid(
                "image",
                f"{v[:80]!r}: an image path or URI of letters, digits and ._/:@#+=%~- only (no "
                "spaces, commas, quotes or $), not starting with '-'",
            )
        out = []
        for m in self.mounts:
            mm = _MOUNT.fullmatch(m)
            if not mm:
                raise Invalid(
                    "mounts",
                    f"{m[:80]!r}: a mount is SRC[:DST[:ro|rw]] with absolute paths of letters, "
                    "digits and ._/+@%=~- (no ',' or ':' inside a path), e.g. /datasets:/data:ro",
                )
            src, dst, flags = mm.groups()
            out.append(f"{src}:{dst or src}" + (f":{flags}" if flags else ""))  # pyxis needs DST; both read this
        self.mounts = out


class SlurmTarget(Spec, kw_only=True):
    partition: Line(256) | None = None
    account: Line(256) | None = None
    qos: Line(256) | None = None
    time: Doc("SLURM time limit, e.g. 24:00:00 or 2-00:00:00; a number is minutes", Text(32) | int) = "24:00:00"
    cpus_per_task: Int(1, 100000) | None = None
    mem: Doc("memory per node (--mem), e.g. 0 (all), 500G; a number is MB", Text(32) | int | None) = None
    mem_per_gpu: Doc("memory per allocated GPU (--mem-per-gpu), e.g. 80G; instead of mem", Text(32) | int | None) = None
    constraint: Line(1024) | None = None
    exclusive: bool = True
    signal_seconds: Int(1, 65535, "send USR2 this long before the time limit") = 120
    max_requeues: Int(0, 10_000) = 5
    max_failures: Int(0, 10_000) = 3
    max_restarts: Int(0, 1000, "torchrun restarts inside one allocation") = 2
    submit: Literal["sbatch", "submitit"] = "sbatch"
    array_parallelism: (
        Int(1, 100000, "sweeps: at most this many array tasks run at once (sbatch --array=0-N%P)") | None
    ) = None
    cpus_per_gpu: (
        Int(1, 10000, "CPUs per GPU (sbatch --cpus-per-gpu), instead of cpus_per_task; GPU recipes only") | None
    ) = None
    gpu_request: Doc(
        "how GPUs are asked for: --gpus-per-node (select/cons_tres), or --gres=gpu:N for clusters without cons_tres",
        Literal["gpus_per_node", "gres"],
    ) = "gpus_per_node"
    gpu_type: (
        Text(
            64,
            "the cluster's GPU type name (its GRES type), e.g. a100: --gpus-per-node=a100:8 or --gres=gpu:a100:8",
            r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z",
        )
        | None
    ) = None
    nodelist: Doc(
        "run on these nodes (--nodelist), e.g. gpu[01-04] or a list of names", Text(4096) | list[Text(255)] | None
    ) = None
    exclude: Doc("never run on these nodes (--exclude), e.g. gpu07,gpu[10-12]", Text(4096) | list[Text(255)] | None) = (
        None
    )
    reservation: (
        Text(256, "allocate from this reservation (--reservation)", r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*\Z") | None
    ) = None
    dependency: (
        Text(
            1024, "start after other jobs (--dependency), e.g. afterok:123 or singleton; `dtlaunch up --after` adds one"
        )
        | None
    ) = None
    mail_type: Doc(
        "mail on these events (--mail-type), e.g. [END, FAIL]",
        Text(256) | Annotated[list[Text(64)], Meta(max_length=20)] | None,
    ) = None
    mail_user: (
        Text(
            256,
            "who gets the mail (--mail-user; default: the submitting user)",
            r"^[A-Za-z0-9._%+-]+(@[A-Za-z0-9.-]+)?\Z",
        )
        | None
    ) = None
    container: Doc(
        "run the steps in a container: {runtime: pyxis|apptainer, image?, mounts?, workdir?}", SlurmContainer | None
    ) = None
    ssh: SshSpec | None = None
    extra_sbatch: Annotated[list[Line(1024)], Meta(max_length=100)] = []
    setup: Annotated[
        list[Str], Meta(max_length=1000, description="shell lines run before training, e.g. module load")
    ] = []

    def __post_init__(self) -> None:
        from .slurmsyntax import parse_dependency, parse_hostlist, parse_mail_types, parse_mem
        from .slurmtime import parse_time

        if isinstance(self.time, int):  # `time: 90` means 90 minutes
            self.time = str(self.time)
        checked("time", parse_time, self.time)  # raises with the accepted forms
        if isinstance(self.mem, int):  # `mem: 0`, `mem: 4096` (MB)
            self.mem = str(self.mem)
        if isinstance(self.mem_per_gpu, int):
            self.mem_per_gpu = str(self.mem_per_gpu)
        if self.mem is not None:
            self.mem = checked("mem", parse_mem, self.mem)
        if self.mem_per_gpu is not None:
            checked("mem_per_gpu", lambda v: parse_mem(v, zero=False), self.mem_per_gpu)
            if self.mem is not None:
                raise Invalid(
                    "mem_per_gpu",
                    "set only one of `mem` (per node) and `mem_per_gpu`: sbatch refuses both "
                    "(--mem and --mem-per-gpu are mutually exclusive)",
                )
        if self.cpus_per_gpu is not None and self.cpus_per_task is not None:
            raise Invalid(
                "cpus_per_gpu",
                "set only one of `cpus_per_task` and `cpus_per_gpu`: sbatch refuses both "
                "(--cpus-per-gpu is mutually exclusive with --cpus-per-task)",
            )
        if self.nodelist is not None:
            self.nodelist = checked("nodelist", parse_hostlist, self.nodelist)
        if self.exclude is not None:
            self.exclude = checked("exclude", parse_hostlist, self.exclude)
        if self.dependency is not None:
            self.dependency = checked("dependency", parse_dependency, self.dependency)
        if self.mail_type is not None:
            self.mail_type = checked("mail_type", parse_mail_types, self.mail_type)
        self._check_written_options()

    def _check_written_options(self) -> None:
        """What the job script (or submitit) would refuse at render time, refused here where it is located."""
        from .slurmsyntax import parse_sbatch_option, submitit_value

        submitit = self.submit == "submitit"
        for i, entry in enumerate(self.extra_sbatch):
            checked(("extra_sbatch", i), lambda e: parse_sbatch_option(e, submitit=submitit), entry)
        if submitit:  # the free-text options (the others have a syntax of their own, without backslashes)
            for key in ("partition", "account", "qos", "constraint"):
                if getattr(self, key) is not None:
                    checked(key, submitit_value, getattr(self, key))


class SkyStorage(Spec, kw_only=True):
    """Checkpoint storage every node (and every recovery) sees: a bucket or a SkyPilot volume, mounted."""

    bucket: Text(1024, "e.g. s3://my-bucket/ckpt, gs://..., r2://...") | None = None
    volume: (
        Text(256, "a SkyPilot volume (sky volumes apply), instead of a bucket", r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?\Z")
        | None
    ) = None
    mount: Text(1024, "where the nodes see it") = "/checkpoints"
    mode: Doc(
        "MOUNT_CACHED writes to local disk and uploads in the background (fast saves)", Literal["MOUNT_CACHED", "MOUNT"]
    ) = "MOUNT_CACHED"

    def __post_init__(self) -> None:
        if self.bucket is not None and not BUCKET.match(self.bucket):
            raise Invalid(
                "bucket",
                f"{self.bucket!r} is not a bucket URI: use s3://, gs://, r2://, cos://, oci://, nebius:// or https://",
            )
        v = self.mount
        if not (v.startswith("/") or v.startswith("~/")) or "{" in v or ".." in v.split("/"):
            raise Invalid("mount", f"{v!r}: the mount point must be an absolute path or start with ~/")
        self.mount = v.rstrip("/") or "/"
        if (self.bucket is None) == (self.volume is None):
            raise ValueError("give exactly one of `bucket` and `volume`")


class SkyDataMount(Spec, kw_only=True):
    """Weights or data every node reads: a bucket mounted (or copied) at `path`, or a local directory copied."""

    path: Text(1024, "where the nodes see it, e.g. /data")
    source: Text(1024, "a bucket URI (s3://..., gs://...) or a directory on the machine that launches")
    mode: Doc(
        "MOUNT streams from the bucket; COPY copies it onto each node's disk before setup (a local source "
        "is always copied)",
        Literal["MOUNT", "COPY"],
    ) = "MOUNT"

    def __post_init__(self) -> None:
        if not self.path.startswith("/") or "{" in self.path or ".." in self.path.split("/"):
            raise Invalid("path", f"{self.path!r}: the mount point must be an absolute path")
        self.path = self.path.rstrip("/") or "/"
        if self.mode == "MOUNT" and not BUCKET.match(self.source):
            raise Invalid(
                "mode", f"{self.source!r} is not a bucket: a local directory can only be copied", "set mode: COPY"
            )


class SkyTarget(Spec, kw_only=True):
    infra: Text(256, "e.g. aws, gcp/us-central1, k8s") | None = None
    cloud: Text(64) | None = None
    region: Text(128) | None = None
    zone: Text(128) | None = None
    spot: bool = False
    managed: bool = False
    disk_size: (
        Int(
            1,
            65536,
            "GB of disk per node (default: the cloud's, 256 on most); with MOUNT_CACHED checkpoint "
            "storage the checkpoints are cached there before they upload",
        )
        | None
    ) = None
    max_restarts_on_errors: Int(0, 1000) = 3
    max_restarts: Int(0, 1000, "torchrun restarts inside one launch") = 2
    setup: Annotated[list[Str], Meta(max_length=1000)] = []
    workdir: Str | None = None
    checkpoint_storage: Doc(
        "shared checkpoint storage; required for multi-node, managed and spot jobs", SkyStorage | None
    ) = None
    data_mounts: Annotated[
        list[SkyDataMount],
        Meta(
            max_length=32,
            description="weights and data files the nodes read (model.hf_weights, training.data.path "
            "must lie under one)",
        ),
    ] = []
    autostop_minutes: (
        Int(1, 100000, "`sky launch` clusters: stop after this many idle minutes (null: never)") | None
    ) = 10
    autodown: Doc("with autostop: tear the cluster down instead of stopping it", bool) = True
    deepspeed_ssh: Doc(
        "parallelism.launcher: deepspeed: the head starts every node's workers over ssh/pdsh "
        "(default: every node runs DeepSpeed's launcher itself, --no_ssh); pdsh passes values to "
        "every node's shell unescaped, so paths, env values and entrypoint args may not hold $ ` \" "
        "\\ or line breaks (validate and the job script refuse them)",
        bool,
    ) = False
    accelerators: Annotated[
        list[Text(64)],
        Meta(
            max_length=16,
            description="fallbacks after resources.accelerator, e.g. [A100-80GB:8]: each is planned on "
            "its own, those that cannot fit are dropped; same device count per node",
        ),
    ] = []
    fallback: Doc(
        "with accelerators: ordered = try the cheapest plan first (dtlaunch's cost estimate); any_of = let "
        "SkyPilot pick the cheapest available",
        Literal["ordered", "any_of"],
    ) = "ordered"
    instance_type: (
        Text(128, "a cloud instance type, e.g. p5.48xlarge, a3-highgpu-8g", r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z") | None
    ) = None
    cpus: Doc("vCPUs per node: N, or N+ for at least N", Text(16) | int | float | None) = None
    memory: Doc("memory per node in GB: N, or N+ for at least N", Text(16) | int | float | None) = None
    ports: Annotated[
        list[int | Text(16)],
        Meta(max_length=100, description="ports to open on the nodes: 8080 or ranges like 10000-10010"),
    ] = []
    disk_tier: Doc(
        "disk performance tier (SkyPilot's disk_tier)", Literal["low", "medium", "high", "ultra", "best"] | None
    ) = None

    def __post_init__(self) -> None:
        for a in self.accelerators:
            name, _ = checked("accelerators", catalog.parse_accelerator, a)
            if name not in catalog.ACCELERATORS:
                raise Invalid(
                    "accelerators",
                    f"unknown accelerator {name!r}{suggest(name, catalog.ACCELERATORS)}; "
                    f"known: {', '.join(catalog.ACCELERATORS)}",
                )
            if not catalog.ACCELERATORS[name].is_gpu:
                raise Invalid(
                    "accelerators",
                    f"{a!r}: SkyPilot has no cpu accelerator; a fallback is a GPU type, e.g. A100-80GB:8",
                )
        self.cpus = checked("cpus", _amount, self.cpus)
        self.memory = checked("memory", _amount, self.memory)
        self.ports = checked("ports", _ports, self.ports)


def _amount(v):
    if v is None:
        return v
    if isinstance(v, int):
        v = str(v) if 0 < v < 10**6 else "out of range"
    elif isinstance(v, float):
        v = format(v, "g")
    if re.fullmatch(r"\d{1,6}(\.\d{1,3})?\+?", v, flags=re.ASCII) and float(v.rstrip("+")) > 0:
        return v
    raise ValueError(f"{str(v)[:40]!r}: a positive number, optionally followed by + (at least), e.g. 8 or 32+")


def _ports(v: list) -> list[int | str]:
    out: list[int | str] = []
    for p in v:
        lo, hi = (p, p) if isinstance(p, int) else (None, None)
        if isinstance(p, str):
            m = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", p, flags=re.ASCII)
            if m:
                lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo is None or not 1 <= lo <= hi <= 65535:
            raise ValueError(f"{str(p)[:40]!r}: a port is a number 1-65535 or a range LOW-HIGH within it")
        out.append(lo if lo == hi else f"{lo}-{hi}")
    return out
