"""Can this machine run this plan? Checked once per node before torchrun starts any rank.

A broken environment (no torch, an old torch, no DeepSpeed for a ZeRO plan, a data file missing on this
node, a checkpoint directory the job cannot create) would otherwise crash every rank, and torchrun would
restart them, and the scheduler would requeue the job: the same error many times over, with the reason
buried in tracebacks. Here it is one line and exit code 2 (CONFIG), which nothing retries.
"""

from __future__ import annotations

import errno
import os
import re
import uuid
from pathlib import Path

from ..jobenv import CHECKPOINT_DIR, CODE_DIR, MIN_TORCH, RUN_ID
from ..strategies import Family
from ..version import __version__
from .checkpoint.disk import expand_dir, free_bytes
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


# nvidia-smi's health fields (one query; `[N/A]`/`[Not Supported]` where a GPU lacks one): errors that need the
# GPU reset or replaced fail the node, a hardware clock slowdown is named only (it can be a passing power brake).
HEALTH_FIELDS = (
    "index",
    "name",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.pending",
    "remapped_rows.failure",
    "clocks_throttle_reasons.hw_slowdown",
)
# Xid codes (the driver's error reports, in the kernel log) after which a GPU needs a reset or replacing: double-bit
# ECC (48), internal micro-controller faults (61, 62), row remapping (63, 64), NVLink (74), fallen off the bus
# (79), uncontained ECC (95), and the like (NVIDIA's Xid catalogue).
CRITICAL_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95})
XID = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+)")


def gpu_health(smi_csv: str, kernel_log: str = "") -> tuple[list[str], list[str]]:
    """(failures, notes) from `nvidia-smi --query-gpu=HEALTH_FIELDS --format=csv,noheader,nounits` and the kernel
    log's Xid lines. Pure: the node check runs the tools."""
    failures, notes = [], []
    for line in smi_csv.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(HEALTH_FIELDS):
            continue
        f = dict(zip(HEALTH_FIELDS, cells, strict=True))
        gpu = f"GPU {f['index']} ({f['name']})"
        ecc = f["ecc.errors.uncorrected.volatile.total"]
        if ecc.isdigit() and int(ecc) > 0:
            failures.append(f"{gpu}: {ecc} uncorrected ECC error(s) since the driver loaded")
        for key, what in (
            ("retired_pages.pending", "a page retirement pending (the GPU needs a reset)"),
            ("remapped_rows.pending", "a row remap pending (the GPU needs a reset)"),
            ("remapped_rows.failure", "a failed row remap (the GPU needs replacing)"),
        ):
            if f[key].lower() == "yes":
                failures.append(f"{gpu}: {what}")
        if f["clocks_throttle_reasons.hw_slowdown"].lower() == "active":
            notes.append(f"{gpu}: its clocks are slowed by the hardware (thermal or power brake)")
    xids = sorted({(pci, int(code)) for pci, code in XID.findall(kernel_log) if int(code) in CRITICAL_XIDS})
    for pci, code in xids:
        failures.append(f"Xid {code} on {pci} in the kernel log (the GPU needs a reset or replacing)")
    return failures, notes


def check_gpu_health() -> str:
    """This node's GPUs as nvidia-smi and the kernel log report them, where the tools exist (a site's prolog
    runs the same checks): PreflightError (44) on an error that needs a GPU reset or replacing."""
    import shutil
    import subprocess

    from .failures import PreflightError

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ""
    try:
        p = subprocess.run(
            [smi, f"--query-gpu={','.join(HEALTH_FIELDS)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PreflightError(f"nvidia-smi did not answer ({e})", fix="check the node's driver; exclude it") from None
    if p.returncode != 0:
        return f", nvidia-smi health not read ({(p.stderr or p.stdout).strip()[:200]})"
    try:  # the kernel log needs privileges on many sites: without it, the Xid check is skipped
        kernel = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        kernel = ""
    failures, notes = gpu_health(p.stdout, kernel)
    if failures:
        raise PreflightError("; ".join(failures), fix="exclude this node (the job script does) and report it")
    gpus = len(p.stdout.strip().splitlines())
    return f", nvidia-smi: {gpus} GPU(s) healthy" + "".join(f" (note: {n})" for n in notes)


def check_node(recipe, plan) -> str:
    """This node against the plan: a GPU plan needs CUDA and a GPU per local rank (PreflightError: the node is
    wrong, exit 44, so it can be excluded). Builds DeepSpeed's CPU Adam when the plan steps the optimizer on the
    host with it: a JIT compile of a minute or two, here once per node instead of inside every rank's start-up."""
    from ..plan.deepspeed import uses_cpu_adam
    from .dist import check_gpu_node

    _injected_bad_node()
    is_gpu = recipe.resources.device().is_gpu
    health = check_gpu_health() if is_gpu else ""
    found = check_gpu_node(is_gpu, plan.gpus_per_node) + health
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
