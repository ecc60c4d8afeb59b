"""The process group: who am I, who are the others, and how long we wait for each other.

Works under torchrun (RANK/WORLD_SIZE/...), under a bare `srun` (SLURM_PROCID/...), and under a SkyPilot
`run` without torchrun (SKYPILOT_NODE_RANK/...): a job can be started whichever way its target prefers.
Two timeouts: a generous one while the world assembles (slow nodes, image pulls), then the short
training one, so that a rank that stops answering turns into an error (exit code HANG) in bounded time.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import jobenv
from .failures import ConfigError

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ProcEnv:
    """Where this process sits in the world, read from whichever launcher started it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # torchrun | slurm | skypilot | single
    restart_count: int = 0


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    v = env.get(name)
    if v is None or v == "":
        if default is None:
            raise ConfigError(
                f"environment variable {name} is not set", fix="start the job with torchrun, srun or SkyPilot"
            )
        return default
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"environment variable {name}={v!r} is not a whole number") from None


def first_slurm_host(nodelist: str) -> str:
    """`node[1-3,7],gpu5` -> `node1`; the same head every rank derives, without calling scontrol."""
    m = re.match(r"^([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ConfigError(f"cannot read SLURM_JOB_NODELIST={nodelist!r}", fix="export MASTER_ADDR")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect(env: Mapping[str, str] = os.environ) -> ProcEnv:
    """Read the process's place in the world. Pure: takes the environment, returns a ProcEnv."""
    restart = _int(env, "TORCHELASTIC_RESTART_COUNT", 0)
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return ProcEnv(
            rank=_int(env, "RANK"),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", 29500),
            source="torchrun",
            restart_count=restart,
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", ""))
        # One port per job id so that two jobs sharing a node do not collide.
        port = _int(env, "MASTER_PORT", jobenv.job_port(_int(env, "SLURM_JOB_ID", 0)))
        return ProcEnv(
            rank=_int(env, "SLURM_PROCID"),
            world_size=_int(env, "SLURM_NTASKS"),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            local_world_size=_int(env, "SLURM_NTASKS_PER_NODE", 1)
            if env.get("SLURM_NTASKS_PER_NODE", "").isdigit()
            else 1,
            master_addr=addr,
            master_port=port,
            source="slurm",
            restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        )
    if "SKYPILOT_NODE_RANK" in env:
        ips = [ip.strip() for ip in env.get("SKYPILOT_NODE_IPS", "").splitlines() if ip.strip()]
        if not ips:
            raise ConfigError(
                "SKYPILOT_NODE_RANK is set but SKYPILOT_NODE_IPS is empty", fix="run under SkyPilot, or use torchrun"
            )
        # Without torchrun SkyPilot starts one process per node.
        return ProcEnv(
            rank=_int(env, "SKYPILOT_NODE_RANK"),
            world_size=_int(env, "SKYPILOT_NUM_NODES", len(ips)),
            local_rank=0,
            local_world_size=1,
            master_addr=env.get("MASTER_ADDR", ips[0]),
            master_port=_int(env, "MASTER_PORT", 29500),
            source="skypilot",
        )
    return ProcEnv(0, 1, 0, 1, "127.0.0.1", _int(env, "MASTER_PORT", 29500), "single", restart)


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def interface_of(addr: str) -> str | None:
    """The network interface that holds `addr` on this machine, if any."""
    try:
        import psutil
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            return name
    return None


def job_environment(
    network_env: Mapping[str, str],
    local_world_size: int,
    is_gpu: bool,
    env: Mapping[str, str] = os.environ,
    deterministic: bool = False,
) -> dict[str, str]:
    """Variables to set before the process group exists: the same ones the job scripts write (jobenv), for
    a process started without them; already-set variables always win (pure).

    gloo (the CPU backend, and the checkpoint group on GPUs too) announces the address its hostname resolves
    to, which on cloud images is 127.0.1.1: unreachable from other nodes. When the job script said which
    address is this node's (DTLAUNCH_NODE_ADDR), gloo is pinned to the interface that holds it.
    """
    want = jobenv.job_environment(
        dict(network_env),
        is_gpu=is_gpu,
        deterministic=deterministic,
        omp_threads=max(1, cpu_cores() // max(1, local_world_size)),
    )
    node_addr = env.get(jobenv.NODE_ADDR)
    if node_addr and "GLOO_SOCKET_IFNAME" not in env:
        iface = interface_of(node_addr)
        if iface:
            want["GLOO_SOCKET_IFNAME"] = iface
    return {k: v for k, v in want.items() if k not in env}


def backend_for(is_gpu: bool, host_collectives: bool) -> str:
    """The default process group's backend. NCCL reduces only CUDA tensors ("No backend type associated with device
    type cpu"): with FSDP2's CPU offload the gradients, the clipping norm and the fp16 scaler's found-inf live on
    the host, so their collectives need gloo beside NCCL (torchtitan's enable_cpu_backend)."""
    if not is_gpu:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_collectives else "nccl"


def host_collectives(plan) -> bool:
    """Does this plan reduce host tensors over the training groups? FSDP2 with CPU offload does (DeepSpeed's
    offload moves its reductions to the GPU itself)."""
    from ..strategies import Family

    return plan is not None and plan.layout.offload != "none" and plan.layout.spec.family is not Family.DEEPSPEED


def gpu_index(local_rank: int, local_world_size: int, device_count: int, visible: str | None) -> int:
    """The GPU this rank drives, or PreflightError when the node cannot give each local rank a GPU of its own.

    Each rank sees every GPU of the node (torchrun): its local rank. Each rank sees exactly one (srun
    --gpus-per-task, or CUDA_VISIBLE_DEVICES set per task): index 0 of its own view. Fewer GPUs than local
    ranks otherwise: two ranks would share a GPU (NCCL's "Duplicate GPU detected", or a silent slowdown)."""
    from .failures import PreflightError

    if device_count >= local_world_size:
        return local_rank
    if device_count == 1 and visible:
        return 0
    raise PreflightError(
        f"{local_world_size} ranks on this node but torch sees {device_count} GPU(s)"
        + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else ""),
        fix="start one rank per GPU (resources.accelerator's count per node), or make every GPU "
        "visible to the job; this node may also have lost a GPU (check nvidia-smi)",
    )


def check_gpu_node(want_gpu: bool, local_world_size: int) -> str:
    """The node against the recipe: a GPU recipe needs a CUDA build of torch that sees a GPU per local rank
    (PreflightError: the node, not the recipe, is wrong). Returns a short description of what was found."""
    import torch

    from .failures import PreflightError

    if not want_gpu:
        return "cpu"
    if torch.version.cuda is None:
        raise PreflightError(
            f"the recipe asks for GPUs, but torch {torch.__version__} here is a CPU-only build",
            fix="install a CUDA build of torch in the job's environment",
        )
    if not torch.cuda.is_available():
        raise PreflightError(
            f"the recipe asks for GPUs, but torch (CUDA {torch.version.cuda}) sees none on this "
            "node: no driver, a driver older than the CUDA runtime, or no GPU allocated",
            fix="check nvidia-smi on the node; exclude it if its GPUs are gone",
        )
    n = torch.cuda.device_count()
    gpu_index(0, local_world_size, n, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return f"{n} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"


def gpu_settings() -> None:
    """Process-wide GPU settings. SDPA's math kernel off: it keeps every b x heads x t x t score, so a silent
    fallback to it (a dtype or head size the fused kernels do not take) would run out of memory far from the
    plan; an error names the cause instead. fp32 matmuls on TF32 tensor cores ("high"), as is usual for fp32
    training on NVIDIA GPUs since Ampere (~8x the fp32 rate, 10-bit mantissa products, fp32 accumulation)."""
    import torch

    torch.backends.cuda.enable_math_sdp(False)
    torch.set_float32_matmul_precision("high")


@dataclass
class World:
    """The initialised world: ranks, device, and the groups the runtime uses."""

    proc: ProcEnv
    backend: str
    device: torch.device
    is_gpu: bool
    # A gloo group for checkpoint I/O (async saves must not share the training group).
    checkpoint_group: ProcessGroup | None = None
    # A gloo group for the per-step agreement (step, preemption flag) on host numbers: no GPU sync, and apart from
    # the checkpoint group, whose collectives an async save runs from its own thread.
    control_group: ProcessGroup | None = None
    env_set: dict[str, str] = field(default_factory=dict)
    timeout_s: float | None = None

    @property
    def rank(self) -> int:
        return self.proc.rank

    @property
    def world_size(self) -> int:
        return self.proc.world_size

    @property
    def is_main(self) -> bool:
        return self.proc.rank == 0

    @property
    def distributed(self) -> bool:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()


def _apply_threads() -> None:
    import torch

    n = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _device(proc: ProcEnv, is_gpu: bool, plan, env: MutableMapping[str, str]):
    """This rank's device, with the process settings that go with it."""
    import torch

    if not is_gpu:
        return torch.device("cpu")
    index = gpu_index(
        proc.local_rank, proc.local_world_size, torch.cuda.device_count(), env.get("CUDA_VISIBLE_DEVICES")
    )
    torch.cuda.set_device(index)
    gpu_settings()
    if index != proc.local_rank:
        # DeepSpeed (and other libraries) pick their GPU by LOCAL_RANK: under srun with one GPU per task that is
        # "invalid device ordinal". Tell them the index really used.
        env["LOCAL_RANK"] = str(index)
    if plan is not None and plan.layout.offload != "none":
        # The optimizer steps the offloaded states on the host: torchrun's OMP_NUM_THREADS=1 would leave it one
        # core per rank (seconds per step), where the node's cores shared by its ranks are what it needs.
        torch.set_num_threads(max(1, cpu_cores() // max(1, proc.local_world_size)))
    return torch.device("cuda", index)


def init_distributed(
    recipe=None,
    plan=None,
    *,
    init_timeout_s: float | None = None,
    timeout_s: float | None = None,
    env: MutableMapping[str, str] = os.environ,
    verbose: bool = True,
) -> World:
    """Create the process group (NCCL on GPU, gloo on CPU) and return the World.

    `recipe` supplies timeouts, the network profile and whether this is a GPU job (its accelerator, never
    whatever this process happens to see: a GPU node with a broken driver must not turn into a gloo rank of an
    NCCL world); a user's own script may pass none and get PyTorch's defaults for the timeouts, no fabric
    tuning, and the GPU when there is one. `plan` says whether the training groups reduce host tensors too.
    """
    import torch
    import torch.distributed as dist

    from .. import catalog

    proc = detect(env)
    is_gpu = recipe.resources.device().is_gpu if recipe is not None else torch.cuda.is_available()
    check_gpu_node(is_gpu, proc.local_world_size)
    net = catalog.NETWORKS.get(recipe.resources.network) if recipe is not None else None
    env_set = job_environment(
        net.nccl_env if net else {},
        proc.local_world_size,
        is_gpu,
        env,
        deterministic=bool(recipe is not None and recipe.training.deterministic),
    )
    if proc.source != "torchrun":
        # Libraries that read torchrun's variables (DeepSpeed needs LOCAL_RANK) see the same world.
        env_set.update(
            {
                k: v
                for k, v in {
                    "RANK": str(proc.rank),
                    "WORLD_SIZE": str(proc.world_size),
                    "LOCAL_RANK": str(proc.local_rank),
                    "LOCAL_WORLD_SIZE": str(proc.local_world_size),
                    "MASTER_ADDR": proc.master_addr,
                    "MASTER_PORT": str(proc.master_port),
                }.items()
                if k not in env
            }
        )
    env.update(env_set)
    _apply_threads()
    if recipe is not None:
        init_timeout_s = init_timeout_s or recipe.training.init_timeout_seconds
        timeout_s = timeout_s or recipe.training.timeout_seconds
    device = _device(proc, is_gpu, plan, env)
    backend = backend_for(is_gpu, host_collectives(plan))
    world = World(proc, backend, device, is_gpu, env_set=env_set)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if init_timeout_s:
            kwargs["timeout"] = datetime.timedelta(seconds=init_timeout_s)
        if proc.source in ("slurm", "skypilot"):
            kwargs.update(
                init_method=f"tcp://{proc.master_addr}:{proc.master_port}", rank=proc.rank, world_size=proc.world_size
            )
        elif proc.source == "single":
            # A plain `python -m launcher.runtime.train`: a world of one with an in-process store, so every
            # strategy (FSDP2, DeepSpeed) and DCP run unchanged, and no port is needed.
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        if is_gpu:
            kwargs["device_id"] = device
        try:
            dist.init_process_group(backend, **kwargs)
        except Exception as e:  # rendezvous failures are environment problems, not bugs
            from .failures import PreflightError, RuntimeFailure

            if "EADDRINUSE" in str(e):  # rank 0's store port, free when torchrun chose it, was taken since:
                # transient, not the node's fault (44 would exclude it); torchrun's restart chooses another
                raise RuntimeFailure(
                    f"rank {proc.rank} could not open the process group's store at {proc.master_addr}:"
                    f"{proc.master_port}: the port was taken after it was chosen ({e})",
                    fix="nothing: a restart of the workers chooses another port",
                ) from None
            raise PreflightError(
                f"rank {proc.rank} could not join the process group at "
                f"{proc.master_addr}:{proc.master_port} ({proc.source}): {e}",
                fix="check that MASTER_ADDR resolves to the head node from every node",
            ) from None
    # Checkpoint collectives get their own gloo group with the long timeout: a big save may
    # legitimately take minutes, and async saves must not interleave with training collectives.
    long = datetime.timedelta(seconds=init_timeout_s or 1800)
    # named: the flight recorder's dumps (and the diagnosis that reads them) tell the groups apart by it
    world.checkpoint_group = dist.new_group(backend="gloo", timeout=long, group_desc="checkpoint")
    world.control_group = dist.new_group(backend="gloo", timeout=long, group_desc="control")
    if verbose and proc.rank == 0:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(env_set.items())) or "nothing (all already set)"
        print(
            f"dtlaunch: world {proc.world_size} via {proc.source}, backend {backend}, "
            f"init timeout {init_timeout_s or 'default'}s, collective timeout {timeout_s or 'default'}s; "
            f"set env: {shown}",
            flush=True,
        )
    world.timeout_s = timeout_s
    return world


def node_names(world: World) -> list[str]:
    """Every rank's node name (jobenv.node_name), by rank; collective on the control group (host numbers only)."""
    from .. import jobenv

    here = jobenv.node_name()
    if not world.distributed or world.control_group is None:
        return [here]
    import torch.distributed as dist

    names: list = [None] * world.world_size
    dist.all_gather_object(names, here, group=world.control_group)
    return [str(n) for n in names]


def set_collective_timeout(world: World, seconds: float | None) -> None:
    """Shorten the timeout of every training group (the world, each mesh dimension's, FSDP2's and DeepSpeed's
    groups, the per-step agreement's) once the first step is done; only the checkpoint group keeps the long one.

    Not before: building the model, reading pretrained weights on rank 0 and the first step's lazy
    initialisation can legitimately take long on slow storage (torchtitan does the same after its first step).
    A barrier first, so that no rank shortens a timeout while another is still in that first step.
    `_set_pg_timeout` changes the existing gloo/NCCL backends' default; creating new groups would double the
    communicators on GPU.
    """
    if not seconds or not world.distributed:
        return
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    dist.barrier(group=world.control_group)
    td = datetime.timedelta(seconds=seconds)
    for pg in list(_world.pg_map):
        if pg is not world.checkpoint_group:
            _set_pg_timeout(td, pg)
    world.timeout_s = seconds


def shutdown(world: World | None = None) -> None:
    """Barrier, then destroy: destroying while a peer still sends aborted ~15% of runs here."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


__all__ = [
    "ProcEnv",
    "World",
    "backend_for",
    "check_gpu_node",
    "cpu_cores",
    "detect",
    "first_slurm_host",
    "gpu_index",
    "host_collectives",
    "init_distributed",
    "job_environment",
    "set_collective_timeout",
    "shutdown",
]


def enable_determinism() -> None:
    """Bit-reproducible kernels: a restarted run must end with the same weights as an uninterrupted one. The
    environment part (cuBLAS, NCCL) is jobenv's, set before the process group exists. Deterministic mode would
    also fill every new tensor's memory (a kernel per torch.empty); the runtime reads only memory it wrote."""
    for k, v in jobenv.DETERMINISTIC_ENV.items():
        os.environ.setdefault(k, v)
    import torch.utils.deterministic

    torch.use_deterministic_algorithms(True)
    # A property of the module's own class (torch swaps it in at import), which torch's types cannot show.
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    torch.backends.cudnn.benchmark = False
