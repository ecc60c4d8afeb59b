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
shell makes before any rank starts (`python -m launcher.train --check`, exit 2 once instead of a crash on
every node and every requeue) runs inside the container too: `step.sh --check`, through srun (pyxis) or
directly (Apptainer, on the first node, where the batch shell runs).

Signals need nothing extra: slurmstepd signals every process of a step, and the processes in a pyxis
container or under `apptainer exec` (no PID namespace) are processes of the step.
"""
from __future__ import annotations

import msgspec

from ..errors import DtlaunchError
from ..recipe import Recipe
from ..recipe.images import for_apptainer, for_enroot
from ..recipe.target_specs import MOUNT_PATH
from .shell import ShellExpr, Word

# The mount list the batch shell builds and exports (the submit directory is known only at run time).
MOUNTS_VAR = "CONTAINER_MOUNTS"
CHECK_ARG = "--check"  # step.sh's argument for the interpreter check only


class Container(msgspec.Struct, frozen=True):
    runtime: str  # pyxis | apptainer | singularity
    image: str  # as the runtime spells it
    mounts: tuple[str, ...]  # SRC:DST[:FLAGS] besides the submit directory: the checkpoint root, the recipe's
    make_dirs: tuple[str, ...]  # mount sources dtlaunch creates before mounting (the checkpoint root)
    workdir: str | None  # the recipe's; None: the submit directory (pyxis) or the step's own cwd (apptainer)
    gpu: bool

    @property
    def pyxis(self) -> bool:
        return self.runtime == "pyxis"


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
        raise DtlaunchError("targets.slurm.container has no image",
                            fix="set resources.image (e.g. nvcr.io/nvidia/pytorch:24.05-py3) or "
                                "targets.slurm.container.image")
    root = checkpoint_root(recipe)
    mounts, make = [], []
    if root and root != "/":
        if not MOUNT_PATH.fullmatch(root):
            raise DtlaunchError(f"checkpoint.dir {recipe.checkpoint.dir!r} cannot be bind-mounted into the container "
                                "(a mount path holds no ',', ':', spaces or quotes)",
                                fix="use a plainer checkpoint.dir, or a relative one (under the submit directory)")
        mounts.append(f"{root}:{root}")
        make.append(root)
    mounts += [m for m in c.mounts if m not in mounts]
    return Container(c.runtime, image, tuple(mounts), tuple(make), c.workdir, recipe.resources.device().is_gpu)


def srun_flags(c: Container) -> list[Word]:
    """pyxis's srun options. The container is named per job: the check step imports the image once on the
    first node, and the training step there reuses it instead of importing it again."""
    return [f"--container-image={c.image}", ShellExpr(f"--container-mounts=${MOUNTS_VAR}"),
            f"--container-workdir={c.workdir}" if c.workdir else ShellExpr("--container-workdir=$SUBMIT_DIR"),
            ShellExpr("--container-name=dtlaunch-$SLURM_JOB_ID")]


def exec_prefix(c: Container) -> list[Word]:
    """`apptainer exec` before the command it runs in the image."""
    words: list[Word] = [c.runtime, "exec"]
    if c.gpu:
        words.append("--nv")
    words += ["--bind", ShellExpr(f"${MOUNTS_VAR}"), "--pwd", c.workdir or ShellExpr("$PWD"), c.image]
    return words


def check_command(c: Container, step_script: ShellExpr) -> list[Word]:
    """What the batch shell runs to check the image's interpreter against the plan, before training."""
    step = ["bash", step_script, CHECK_ARG]
    if c.pyxis:
        return ["srun", "--nodes=1", "--ntasks=1", "--kill-on-bad-exit=1", *srun_flags(c), *step]
    return step
