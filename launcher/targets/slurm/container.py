"""`targets.slurm.container`: the training steps run in a container image, with pyxis or Apptainer.

The two runtimes sit at different places in the job, and the job scripts follow them:

* pyxis is a SPANK plugin of srun: `srun --container-image=...` starts each step *inside* the container, so
  step.sh itself runs there, and its interpreter is the image's (resolved in step.sh, never the batch
  shell's: the batch shell runs on the host, outside any container).
* Apptainer (or Singularity, the same CLI) is a program: step.sh runs on the host, and torchrun runs under
  `apptainer exec [--nv] --bind ... IMAGE`. `--nv` (the host's NVIDIA driver) only for GPU recipes.

Either way the submit directory (step.sh, plan.json, code/, runs/, jobs/) is mounted at its own path, so every
path the scripts and the runtime pass around means the same inside and outside; so is the static part of an
absolute checkpoint.dir (created first: a bind mount needs its source). The interpreter check the batch
shell makes before any rank starts (`python -m launcher.runtime.train --check`, exit 2 once instead of a crash on
every node and every requeue) runs inside the container too: `step.sh --check`, through srun (pyxis) or
directly (Apptainer, on the first node, where the batch shell runs).

The image's environment: pyxis keeps an image's own value of a variable over the host's (unless named in
--container-env), and so does Apptainer (unless passed with --env, --env-file or APPTAINERENV_). An image that
sets PYTHONPATH (Megatron and NeMo images do) would drop the shipped wheel, and enroot's PyTorch hook writes
its own MASTER_PORT. So the batch shell writes the job's environment into a file per attempt
(`$DTLAUNCH_JOB_ENV`, NAME=VALUE lines in shell quoting): step.sh sources it inside the pyxis container, and
`apptainer exec --env-file` reads it. In the container the root filesystem is read-only and HOME is not
mounted (enroot's defaults), so the caches that JIT builds and downloads write (XDG, torch extensions,
Hugging Face, Triton) go under the submit directory, unless the recipe's env names them.

Starting the image: every node runs the check (`srun ... step.sh --check` on all nodes) before any rendezvous,
so pyxis imports the image on every node in parallel, outside torchrun's join window. Apptainer converts a
docker:// image once into a SIF in the submit directory (`apptainer pull`, shared by the nodes and the job's
requeues), instead of once per node into caches that cannot be shared. pyxis names the container after the job,
so the check's import is reused by training; the job removes it on every node when it ends for good
(`enroot remove`), or each job would leave an unpacked image (tens of GB) on every node.

Signals need nothing extra: slurmstepd signals every process of a step, and the processes in a pyxis
container or under `apptainer exec` (no PID namespace) are processes of the step.
"""

from __future__ import annotations

import hashlib

import msgspec

from ... import jobenv
from ...errors import DtlaunchError
from ...recipe import Recipe
from ...recipe.images import for_apptainer, for_enroot
from ...render.shell import ShellExpr, Word
from .spec import MOUNT_PATH

# The mount list the batch shell builds and exports (the submit directory is known only at run time).
MOUNTS_VAR = "CONTAINER_MOUNTS"
CHECK_ARG = "--check"  # step.sh's argument for the interpreter check only
DIAGNOSE_ARG = "--diagnose"  # step.sh's argument for a hang's culprit nodes, read in the image
JOB_ENV = "DTLAUNCH_JOB_ENV"  # the file of the job's environment, read inside the container
# Writable caches inside a container (read-only root filesystem, no HOME), relative to the submit directory.
CACHE_DIRS = {
    "XDG_CACHE_HOME": "cache",
    "TORCH_EXTENSIONS_DIR": "cache/torch_extensions",
    "HF_HOME": "cache/huggingface",
    "TRITON_CACHE_DIR": "cache/triton",
}
# What the batch shell exports for the job besides the recipe's env: the container must see the host's values.
JOB_VARS = (
    jobenv.RUN_ID,
    jobenv.RUN_DIR,
    jobenv.PLAN,
    jobenv.ATTEMPT,
    jobenv.STATUS,
    jobenv.CHECKPOINT_DIR,
    jobenv.CODE_DIR,
    jobenv.BAD_NODES,
    jobenv.ALLOCATION_START,
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "PYTHONPATH",
    "MASTER_ADDR",
    "MASTER_PORT",
)
CONTAINER_NAME = "dtlaunch-$SLURM_JOB_ID"


class Container(msgspec.Struct, frozen=True):
    runtime: str  # pyxis | apptainer | singularity
    image: str  # as the runtime spells it
    mounts: tuple[str, ...]  # SRC:DST[:FLAGS] besides the submit directory: the checkpoint root, the recipe's
    make_dirs: tuple[str, ...]  # mount sources dtlaunch creates before mounting (the checkpoint root)
    workdir: str | None  # the recipe's; None: the submit directory (pyxis) or the step's own cwd (apptainer)
    gpu: bool
    caches: tuple[tuple[str, str], ...] = ()  # (variable, directory under the submit directory)

    @property
    def pyxis(self) -> bool:
        return self.runtime == "pyxis"

    @property
    def sif(self) -> str | None:
        """Apptainer: the SIF file (in the submit directory) a registry image is pulled into once; None for a
        local image file, used as it is."""
        if self.pyxis or "://" not in self.image:
            return None
        return "image-" + hashlib.sha256(self.image.encode()).hexdigest()[:12] + ".sif"

    def job_vars(self, env_names) -> list[str]:
        """The variables the job environment file carries into the container."""
        return list(dict.fromkeys([*env_names, *JOB_VARS, *(name for name, _ in self.caches)]))


def image_for(recipe: Recipe) -> str | None:
    c = recipe.targets.slurm.container
    if c is None:
        return None
    if c.image:
        return c.image
    if recipe.resources.image is None:
        return None
    return for_enroot(recipe.resources.image) if c.runtime == "pyxis" else for_apptainer(recipe.resources.image)


def checkpoint_root(recipe: Recipe) -> str | None:
    """The part of an absolute checkpoint.dir before any {run_id}: mounted, so checkpoints land on the host."""
    d = recipe.checkpoint.dir
    if not d or not d.startswith("/"):
        return None  # relative: under the submit directory the step runs in, which is mounted
    parts = []
    for p in d.rstrip("/").split("/")[1:]:
        if "{" in p:
            break
        parts.append(p)
    return "/" + "/".join(parts)


def container(recipe: Recipe) -> Container | None:
    c = recipe.targets.slurm.container
    if c is None:
        return None
    image = image_for(recipe)
    if image is None:
        raise DtlaunchError(
            "targets.slurm.container has no image",
            fix="set resources.image (e.g. nvcr.io/nvidia/pytorch:24.05-py3) or targets.slurm.container.image",
        )
    root = checkpoint_root(recipe)
    mounts, make = [], []
    if root and root != "/":
        if not MOUNT_PATH.fullmatch(root):
            raise DtlaunchError(
                f"checkpoint.dir {recipe.checkpoint.dir!r} cannot be bind-mounted into the container "
                "(a mount path holds no ',', ':', spaces or quotes)",
                fix="use a plainer checkpoint.dir, or a relative one (under the submit directory)",
            )
        mounts.append(f"{root}:{root}")
        make.append(root)
    mounts += [m for m in c.mounts if m not in mounts]
    caches = tuple((k, v) for k, v in CACHE_DIRS.items() if k not in recipe.env)  # the recipe's own value wins
    return Container(c.runtime, image, tuple(mounts), tuple(make), c.workdir, recipe.resources.device().is_gpu, caches)


def srun_flags(c: Container) -> list[Word]:
    """pyxis's srun options. The container is named per job: the check step imports the image once on the
    first node, and the training step there reuses it instead of importing it again."""
    return [
        f"--container-image={c.image}",
        ShellExpr(f"--container-mounts=${MOUNTS_VAR}"),
        f"--container-workdir={c.workdir}" if c.workdir else ShellExpr("--container-workdir=$SUBMIT_DIR"),
        ShellExpr(f"--container-name={CONTAINER_NAME}"),
    ]


def exec_prefix(c: Container) -> list[Word]:
    """`apptainer exec` before the command it runs in the image."""
    words: list[Word] = [c.runtime, "exec"]
    if c.gpu:
        words.append("--nv")
    words += [
        "--bind",
        ShellExpr(f"${MOUNTS_VAR}"),
        "--env-file",
        ShellExpr(f"${JOB_ENV}"),
        "--pwd",
        c.workdir or ShellExpr("$PWD"),
        ShellExpr(f"$SUBMIT_DIR/{c.sif}") if c.sif else c.image,
    ]
    return words


def cleanup_command(c: Container | None) -> list[Word] | None:
    """pyxis (container_scope global, its default) keeps a named container until someone removes it: every
    node removes this job's when the job ends for good. None when there is nothing to remove."""
    if c is None or not c.pyxis:
        return None
    return [*EVERY_NODE, "enroot", "remove", "--force", ShellExpr(f"pyxis_{CONTAINER_NAME}")]


# One task on every node of the allocation: the node checks and the container's removal.
EVERY_NODE: list[Word] = [
    "srun",
    ShellExpr("--nodes=$SLURM_NNODES"),
    ShellExpr("--ntasks=$SLURM_NNODES"),
    "--ntasks-per-node=1",
]


def diagnose_command(c: Container, step_script: ShellExpr) -> list[Word]:
    """What the batch shell runs to name a hang's culprit nodes when the host may have no Python with dtlaunch:
    the diagnosis (launcher.cli.diagnose, which reads the run's records) in the image, one task on one node."""
    step = ["bash", step_script, DIAGNOSE_ARG]
    one = ["srun", "--nodes=1", "--ntasks=1"]
    return [*one, *srun_flags(c), *step] if c.pyxis else [*one, *step]


def check_command(c: Container, step_script: ShellExpr) -> list[Word]:
    """What the batch shell runs to check the image's interpreter and every node against the plan, before
    training: on every node, so each starts (pyxis: imports) the image before the rendezvous. No
    --kill-on-bad-exit: each node's own verdict counts (srun exits with the highest, 44 for a bad node)."""
    step = ["bash", step_script, CHECK_ARG]
    return [*EVERY_NODE, *srun_flags(c), *step] if c.pyxis else [*EVERY_NODE, *step]
