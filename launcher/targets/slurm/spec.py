"""The recipe's `targets.slurm` section (with its container and the ssh login it may submit through): what
sbatch accepts, checked where it is written rather than by sbatch after the queue.
"""

import re
from typing import Annotated, Literal

from msgspec import Meta

from ...recipe.fields import Doc, Int, Invalid, Line, Spec, Str, Text, checked


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
    max_excluded_nodes: Int(
        0, 10_000, "nodes that fail the pre-start check are excluded and the job requeued, up to this many (0: never)"
    ) = 2
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
        from .syntax import parse_dependency, parse_hostlist, parse_mail_types, parse_mem
        from .timelimit import parse_time

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
        from .syntax import parse_sbatch_option, submitit_value

        submitit = self.submit == "submitit"
        for i, entry in enumerate(self.extra_sbatch):
            checked(("extra_sbatch", i), lambda e: parse_sbatch_option(e, submitit=submitit), entry)
        if submitit:  # the free-text options (the others have a syntax of their own, without backslashes)
            for key in ("partition", "account", "qos", "constraint"):
                if getattr(self, key) is not None:
                    checked(key, submitit_value, getattr(self, key))
