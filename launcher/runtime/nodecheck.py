"""Can this machine run this plan? Checked once per node before torchrun starts any rank.

A broken environment (no torch, an old torch, no DeepSpeed for a ZeRO plan, a data file missing on this
node, a checkpoint directory the job cannot create) would otherwise crash every rank, and torchrun would
restart them, and the scheduler would requeue the job: the same error many times over, with the reason
buried in tracebacks. Here it is one line and exit code 2 (CONFIG), which nothing retries.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from ..jobenv import CHECKPOINT_DIR, CODE_DIR, MIN_TORCH, RUN_ID
from ..strategies import Family
from ..version import __version__
from .ckptdir import expand_dir, free_bytes
from .failures import ConfigError, StorageError


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def check_model(recipe) -> None:
    if recipe.model.shape() is None:
        raise ConfigError(
            "the runtime needs a model shape (a preset or layers/hidden/...), not only `params`",
            fix="set model.preset, e.g. tiny",
        )
    if recipe.model.architecture != "llama":
        raise ConfigError(
            f"the runtime trains the llama architecture, not {recipe.model.architecture!r} (the gpt "
            "layer is for planning only)",
            fix="set model.architecture: llama",
        )


def check_hf(recipe) -> str:
    """model.hf: transformers is importable here, and the weights (if any) are on this node."""
    m = recipe.model
    if m.hf_config is None:
        return ""
    try:
        import transformers
    except ImportError as e:
        raise ConfigError(
            f"model.hf needs transformers, which this environment cannot import ({e})",
            fix="pip install 'dtlaunch[hf]' in the job's environment",
        ) from None
    if m.hf_weights:
        w = Path(os.path.expanduser(m.hf_weights))
        if not w.is_dir() or not any(w.glob("*.safetensors")):
            raise ConfigError(
                f"model.hf_weights {w} has no *.safetensors on this node",
                fix="put the model directory on storage every node sees (same path), or set "
                "model.hf_weights to where the nodes have it",
            )
    return f", transformers {transformers.__version__}"


def _injected_bad_node() -> None:
    """Test-only: the `bad_node` fault (launcher.runtime.inject) fails this node's check as broken GPUs do: on the node
    it names (any without `node=`), in the allocation its `attempt` gives (SLURM's requeue count)."""
    from .failures import PreflightError
    from .inject import Faults

    # the check runs once per node, outside torchrun: the allocation's requeue count stands for the restart count
    if Faults(rank=0, restart_count=int(os.environ.get("SLURM_RESTART_COUNT") or 0)).hit("bad_node", 0):
        raise PreflightError(
            "CUDA error: uncorrectable ECC error encountered (injected)", fix="exclude this node and resubmit"
        )


def check_node(recipe, plan) -> str:
    """This node against the plan: a GPU plan needs CUDA and a GPU per local rank (PreflightError: the node is
    wrong, exit 44, so it can be excluded). Builds DeepSpeed's CPU Adam when the plan steps the optimizer on the
    host with it: a JIT compile of a minute or two, here once per node instead of inside every rank's start-up."""
    from ..plan.deepspeed import uses_cpu_adam
    from .dist import check_gpu_node

    _injected_bad_node()
    found = check_gpu_node(recipe.resources.device().is_gpu, plan.gpus_per_node)
    lay = plan.layout
    if lay.spec.family is Family.DEEPSPEED and uses_cpu_adam(recipe, lay.offload, recipe.resources.device().is_gpu):
        import time

        from deepspeed.ops.op_builder import CPUAdamBuilder

        t0 = time.monotonic()
        CPUAdamBuilder().load()
        found += f", DeepSpeed CPU Adam ready in {time.monotonic() - t0:.1f}s"
    return found


def check_libraries(plan, is_gpu: bool) -> str:
    import torch

    if _version_tuple(torch.__version__) < MIN_TORCH:
        raise ConfigError(
            f"torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH))}, whose torchrun the "
            "job scripts need (--signals-to-handle, --shutdown-timeout)",
            fix=f"install torch>={'.'.join(map(str, MIN_TORCH))} in the job's environment",
        )
    found = f"torch {torch.__version__}"
    if plan.layout.spec.family is Family.DEEPSPEED:
        from .engines.deepspeed import name_the_accelerator

        name_the_accelerator(is_gpu)
        try:
            import deepspeed
        except ImportError as e:
            raise ConfigError(
                f"strategy {plan.strategy} needs DeepSpeed, which this environment cannot import ({e})",
                fix="pip install deepspeed (built against the installed torch)",
            ) from None
        found += f", deepspeed {deepspeed.__version__}"
    return found


def check_data(recipe) -> None:
    d = recipe.training.data
    if d.source == "file" and not Path(os.path.expanduser(d.path)).is_file():
        raise ConfigError(
            f"data file {d.path} does not exist on this node",
            fix="put the token file on every node (a shared filesystem or the job's workdir)",
        )


def check_entrypoint(ep) -> str:
    """The user's script is in the shipped code directory, or the module is importable from it."""
    import importlib.util
    import sys

    code = Path(os.environ.get(CODE_DIR) or os.getcwd())
    if ep.script is not None:
        if not (code / ep.script).is_file():
            raise ConfigError(
                f"entrypoint script {ep.script} is not in {code}",
                fix="render again: the job ships entrypoint.workdir as code/ next to the job script",
            )
        return f"entrypoint {ep.script}"
    sys.path.insert(0, str(code))
    try:
        found = importlib.util.find_spec(ep.module)
    except (ImportError, ValueError) as e:
        found, why = None, f" ({e})"
    else:
        why = ""
    finally:
        sys.path.remove(str(code))
    if found is None:
        raise ConfigError(
            f"entrypoint module {ep.module} cannot be imported from {code} on this node{why}",
            fix="put it in entrypoint.workdir, or install its package in the job's environment",
        )
    return f"entrypoint -m {ep.module}"


def check_checkpoint_dir(recipe, run_dir: Path) -> Path:
    """Create the checkpoint root and write a probe file into it: what every saving rank will need. The probe
    is removed whatever happens; full or read-only storage is StorageError, naming the path and free space."""

    root = Path(os.environ.get(CHECKPOINT_DIR) or expand_dir(recipe.checkpoint.dir, run_dir, os.environ.get(RUN_ID)))
    root = Path(os.path.expanduser(str(root)))
    if root.is_symlink() and not root.exists():
        raise ConfigError(
            f"checkpoint dir {root} is a symbolic link to {os.readlink(root)}, which does not exist",
            fix="create the link's target, or point checkpoint.dir elsewhere",
        )
    probe = root / f".dtlaunch-probe-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
    except OSError as e:
        fix = (
            "point checkpoint.dir at storage every node can write (on SkyPilot, mount it with "
            "targets.sky.checkpoint_storage)"
        )
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            free = free_bytes(root)
            raise StorageError(
                f"cannot write checkpoints to {root}: {e.strerror} ({free / 1e9:.3f} GB free)",
                fix="free space there, or " + fix,
            ) from None
        raise ConfigError(f"cannot write checkpoints to {root}: {e.strerror}", fix=fix) from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    return root


def check(recipe, plan, run_dir: Path) -> str:
    """Raise ConfigError on the first problem; return a one-line summary otherwise."""
    found = check_libraries(plan, recipe.resources.device().is_gpu)
    found += f", {check_node(recipe, plan)}"
    plan.layout.for_world(plan.world_size)  # the world torchrun will start: a layout it cannot hold fails here, once
    if recipe.entrypoint is not None:  # the user's code brings its own model, data and training length
        what = check_entrypoint(recipe.entrypoint)
    else:
        if plan.steps is None:
            raise ConfigError("the recipe gives no training length", fix="set training.steps or training.tokens")
        check_model(recipe)
        found += check_hf(recipe)
        check_data(recipe)
        what = f"{plan.steps} steps"
    root = check_checkpoint_dir(recipe, run_dir)
    return (
        f"dtlaunch {__version__}, {found}; plan: {plan.strategy} on {plan.world_size} ranks, "
        f"{what}; checkpoints in {root}"
    )
