"""Test-only fault injection, so that crash, hang and divergence paths are exercised by real runs.

Set DTLAUNCH_FAULT to one or more `;`-separated faults, each `KIND:key=value:key=value`:

    exit:rank=1:step=7[:code=3]        rank 1 exits with `code` (default 1) at the start of step 7
    sigkill:rank=1:step=7              rank 1 SIGKILLs itself at the start of step 7 (no cleanup at all)
    hang:rank=1:step=5                 rank 1 sleeps forever at the start of step 5 (peers time out)
    skip_collective:rank=1:step=5      rank 1 skips the per-step agreement collective once (collectives pair off by one)
    desync_step:rank=1:step=5          rank 1's step counter jumps by one (an off-by-one divergence)
    kill_in_checkpoint:rank=0:step=10  SIGKILL after the checkpoint's files are written, before it is committed
    slow_checkpoint:step=10:seconds=40 the checkpoint of step 10 takes 40 s more (a large model on slow storage)

`step=any` fires at the first occasion (e.g. the first checkpoint, whatever its step).
    signal:rank=0:step=6[:sig=USR2]    the rank sends itself a signal at the start of the step (preemption tests)
    nan_loss:step=7                    the loss of step 7 is NaN (a diverging run)
    drop_grads:rank=1:step=2           rank 1's gradients (its shard) are zeroed before step 2's update: a layout
                                       that loses a shard (what `dtlaunch rehearse` must catch)
    collective_abort:rank=1:step=5     what NCCL's watchdog does after a collective timeout (no GPU here to time
                                       one out) under TORCH_NCCL_ASYNC_ERROR_HANDLING=3: write the flight-recorder
                                       dump, then abort the process
    comm_abort:rank=1:step=5[:delay=2] the same under =2 (what the job sets): the watchdog aborts the communicators
                                       and the rank's next NCCL call raises "NCCL communicator was aborted", while
                                       the dump is still being written (it lands `delay` seconds later)
    oom:rank=1:step=5                  a CUDA out-of-memory error at the start of the step
    gpu_fault:rank=1:step=5            a CUDA error of failing hardware (an uncorrectable ECC error)
    slow:step=3:node=node2:seconds=0.2 from step 3 on, every forward on node2's ranks takes 0.2 s more (a throttled
                                       GPU or an overloaded host: a straggler)
    slow_link:step=0:node=n2:seconds=0.05
                                       preflight's pairwise test: each exchange of n2's ranks takes 0.05 s more
                                       (a slow cable or NIC on n2)
    bad_node:step=0:node=node1         node1 fails the pre-start check (the agent's --check-plan, or train
                                       --check) with PREFLIGHT; without node=, any node; attempt= counts SLURM's
                                       requeues here

`rank` defaults to every rank; `attempt` (default 0) restricts the fault to that torchrun restart count,
so a restarted job does not crash again at the same step; `node` (default: every node) to the ranks on that
node (jobenv.node_name), so a job requeued without it does not meet the fault again. Each fault fires once per process.
Never set this in production; it exists for tests and drills.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field

from ..jobenv import FAULT
from .failures import ConfigError

KINDS = (
    "exit",
    "sigkill",
    "hang",
    "skip_collective",
    "desync_step",
    "kill_in_checkpoint",
    "slow_checkpoint",
    "signal",
    "nan_loss",
    "drop_grads",
    "collective_abort",
    "comm_abort",
    "oom",
    "gpu_fault",
    "bad_node",
    "slow",
    "slow_link",
)
ANY = -1


@dataclass
class Fault:
    kind: str
    step: int
    rank: int | None = None
    attempt: int = 0
    params: dict = field(default_factory=dict)
    fired: bool = False


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        kind, *kvs = item.split(":")
        if kind not in KINDS:
            raise ConfigError(f"{FAULT}: unknown fault {kind!r}", fix=f"one of: {', '.join(KINDS)}")
        opts = {}
        for kv in kvs:
            k, sep, v = kv.partition("=")
            if not sep:
                raise ConfigError(f"{FAULT}: expected key=value, got {kv!r} in {item!r}")
            opts[k.strip()] = v.strip()
        if "step" not in opts:
            raise ConfigError(f"{FAULT}: fault {item!r} needs step=N")
        try:
            raw_step = opts.pop("step")
            step = ANY if raw_step == "any" else int(raw_step)
            rank = int(opts.pop("rank")) if "rank" in opts else None
            attempt = int(opts.pop("attempt", "0"))
        except ValueError:
            raise ConfigError(f"{FAULT}: step, rank and attempt must be whole numbers in {item!r}") from None
        faults.append(Fault(kind, step, rank, attempt, opts))
    return faults


class Faults:
    """The faults active for this process; `hit(kind, step)` says whether to misbehave now."""

    def __init__(self, rank: int, restart_count: int, text: str | None = None):
        self.rank = rank
        self.restart_count = restart_count
        raw = os.environ.get(FAULT, "") if text is None else text
        from ..jobenv import node_name

        here = node_name()
        self.faults = [
            f
            for f in parse(raw)
            if (f.rank is None or f.rank == rank) and f.attempt == restart_count and f.params.get("node", here) == here
        ]

    def __bool__(self) -> bool:
        return bool(self.faults)

    def hit(self, kind: str, step: int) -> Fault | None:
        for f in self.faults:
            if f.kind == kind and f.step in (step, ANY) and not f.fired:
                f.fired = True
                print(
                    f"dtlaunch: FAULT INJECTION rank {self.rank}: {kind} at step {step} (t={time.time():.3f})",
                    file=sys.stderr,
                    flush=True,
                )
                return f
        return None

    def at_step_start(self, step: int) -> None:
        """The crash-type faults, applied at the start of a step."""
        if (f := self.hit("exit", step)) is not None:
            os._exit(int(f.params.get("code", 1)))
        if self.hit("sigkill", step) is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.hit("hang", step) is not None:
            while True:
                time.sleep(3600)
        if self.hit("collective_abort", step) is not None:
            dump = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
            if dump:
                with open(f"{dump}{self.rank}", "wb") as out:
                    out.write(b"flight recorder dump (injected)")
            os.abort()
        if (f := self.hit("comm_abort", step)) is not None:
            import threading

            import torch.distributed as dist

            threading.Thread(target=self._dump_later, args=(float(f.params.get("delay", 2)),), daemon=True).start()
            raise dist.DistBackendError(f"NCCL communicator was aborted on rank {self.rank}.")
        if self.hit("oom", step) is not None:
            import torch

            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                "of 79.19 GiB of which 1.06 GiB is free. (injected)"
            )
        if self.hit("gpu_fault", step) is not None:
            raise RuntimeError("CUDA error: uncorrectable ECC error encountered (injected)")
        if (f := self.hit("signal", step)) is not None:
            name = f.params.get("sig", "USR2").upper()
            os.kill(os.getpid(), getattr(signal, name if name.startswith("SIG") else "SIG" + name))

    def slow_seconds(self, step: int) -> float:
        """The seconds a forward of `step` takes more (the `slow` fault: every step from its step on)."""
        return sum(
            float(f.params.get("seconds", 0.2)) for f in self.faults if f.kind == "slow" and step >= max(f.step, 0)
        )

    def fired(self, kind: str) -> bool:
        return any(f.kind == kind and f.fired for f in self.faults)

    def _dump_later(self, delay: float) -> None:
        time.sleep(delay)
        dump = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
        if dump:
            with open(f"{dump}{self.rank}", "wb") as out:
                out.write(b"flight recorder dump (injected, written late)")

    def in_checkpoint(self, step: int) -> None:
        if self.hit("kill_in_checkpoint", step) is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        if (f := self.hit("slow_checkpoint", step)) is not None:
            time.sleep(float(f.params.get("seconds", 40)))
