"""How a rank's ending is recorded, for dtlaunch's trainer and for the user's own code alike.

torchrun exits 1 whenever any worker fails, which says nothing about whether to requeue; so each rank writes
its own exit code (and how far it got) where the job scripts read it with nothing but `read`. Torch-free.
"""

from __future__ import annotations

import glob
import json
import os
import time
from pathlib import Path
from typing import NamedTuple

from .. import jobenv
from ..errors import DtlaunchError
from ..jobenv import ExitCode


def rank_from_env() -> int:
    for k in ("RANK", "SLURM_PROCID", "SKYPILOT_NODE_RANK"):
        if os.environ.get(k, "").isdigit():
            return int(os.environ[k])
    return 0


def status_dir(run_dir: Path) -> Path:
    """Where this attempt's ranks report how they ended: $DTLAUNCH_STATUS, set per attempt by the job scripts."""
    return Path(os.environ.get(jobenv.STATUS) or run_dir / "status" / "manual")


def write_status(
    run_dir: Path,
    rank: int,
    code: int,
    message: str,
    step: int | None,
    start_step: int | None = None,
    code_file: bool = True,
) -> None:
    """Two records per rank: a JSON one for people (run_dir/status/rank-N.json, the latest), and a one-line
    "CODE STEP START_STEP CAUSE NODE" file in this attempt's status directory (CAUSE: "peer" for a FAILED rank
    that only lost a peer's connection, else "own"; NODE: jobenv.node_name, one word) for the job scripts, which pick the job's
    exit code (and whether a time-limited allocation made progress) from it with nothing but `read`.
    code_file=False writes the first only (torchrun's report of a rank that died without its own record)."""
    try:
        d = run_dir / "status"
        d.mkdir(parents=True, exist_ok=True)
        rec = {
            "rank": rank,
            "code": code,
            "name": ExitCode.name_of(code),
            "message": message,
            "step": step,
            "start_step": start_step,
            "time": time.time(),
            "attempt": os.environ.get(jobenv.ATTEMPT),
            "node": (node := jobenv.node_name()),
            # the world it ran in, so that a diagnosis can place a rank that left no record (torchrun's variables)
            "world_size": int(os.environ.get("WORLD_SIZE", "0") or 0) or None,
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or None,
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        }
        _replace(d / f"rank-{rank:05d}.json", json.dumps(rec, indent=2) + "\n")
        if not code_file:
            return
        a = status_dir(run_dir)
        a.mkdir(parents=True, exist_ok=True)
        cause = "peer" if code == ExitCode.FAILED and message.startswith(PEER_LOST) else "own"
        _replace(a / f"rank-{rank:05d}.code", _code_line(code, step, start_step, cause, node))
    except OSError:
        pass  # the exit code still tells the story


def _replace(path: Path, text: str) -> None:
    """Write `path` whole or not at all (a reader never sees half a record)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _code_line(code: int, step: int | None, start_step: int | None, cause: str, node: str) -> str:
    """The job scripts' one-line record: "CODE STEP START_STEP CAUSE NODE" (read with nothing but `read`)."""
    return f"{int(code)} {int(step or 0)} {int(start_step or 0)} {cause} {node}\n"


def write_check_record(run_dir: Path, node: str, code: int, message: str) -> None:
    """A node's check before training, in this attempt's status directory (jobenv.CHECK_RECORD_PREFIX + node +
    .json): a failed one's message (no rank of the node starts, so no rank record says why: `logs --diagnose`
    reads it), a passed one's summary (preflight puts each node's in the run's records)."""
    rec = {"node": node, "code": int(code), "message": message, "time": time.time()}
    rec["attempt"] = os.environ.get(jobenv.ATTEMPT)
    # the node's place in the job (its torchrun's ranks follow it): a diagnosis places a rank that left no record
    rank = os.environ.get(jobenv.NODE_RANK, "")
    rec["node_rank"] = int(rank) if rank.isdigit() else None
    try:
        d = status_dir(run_dir)
        d.mkdir(parents=True, exist_ok=True)
        _replace(d / f"{jobenv.CHECK_RECORD_PREFIX}{node}.json", json.dumps(rec, indent=2) + "\n")
        if code:  # and a failure's line for the job scripts, as a rank's (write_status): its node's task ends at
            # once, srun terminates the others (143, the highest code), and each of them reads this one instead
            _replace(d / f"{jobenv.CHECK_RECORD_PREFIX}{node}.code", _code_line(code, 0, 0, "own", node))
    except OSError:
        pass  # the message is in the node's log too


def check_records(directory: Path, node: str | None = None) -> list[dict]:
    """The check records (write_check_record) of `node` (every node's by default) in an attempt's status
    directory; unreadable ones skipped."""
    out = []
    name = "*" if node is None else glob.escape(node)  # a node's name is data, not a pattern
    for p in sorted(directory.glob(f"{jobenv.CHECK_RECORD_PREFIX}{name}.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


# A GPU's hardware failing under the job: the node must be excluded, so these are PREFLIGHT (a node fault), not an
# ordinary retry on the same node. Xid is the driver's error report; the others are how CUDA surfaces it.
NODE_FAULT_MARKERS = (
    "uncorrectable ECC error",
    "ECC error encountered",
    "unspecified launch failure",
    "GPU has fallen off the bus",
    "GPU is lost",
    "Xid",
)
# How NCCL's communicators look after the watchdog aborted them (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) because a
# collective timed out: the next NCCL call on this rank raises this, without the timeout's own text.
ABORTED_MARKERS = ("communicator was aborted", "NCCL communicator was aborted", "Communicator was aborted")


# The record torchrun's report gives a rank that exited without writing its own (elastic._record_unreported).
UNREPORTED = "before writing its own status (torchrun's report)"
# A rank that failed only because a peer's connection closed under it (the peer crashed, or timed out first and
# left): not a cause of its own. Its code file says so ("peer"), and the job scripts' dtl_outcome lets another
# rank's hang (43) stand: with gloo, the ranks that time out first close the connections the others wait on.
PEER_LOST = "communication with a peer failed"


def is_oom(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(exc)


# In the message of every HANG a collective's timeout caused (NCCL's abort after one too), not of ranks that
# disagreed on the step: the diagnosis takes the moment such a rank gave up from its record.
TIMED_OUT = "a collective timed out"


class Timeouts(NamedTuple):
    """What a rank's message says of a collective that timed out (Job.timeout())."""

    where: str | None  # where the rank was, when the step does not say it (writing a checkpoint)
    timed_out: str  # the recipe fields whose timeouts its collectives had
    aborted: str  # the one behind NCCL's abort (its training groups': the checkpoint group is gloo)


def classify(
    exc: BaseException,
    step: int | None,
    timeouts: Timeouts | None = None,
    memory_note: str | None = None,
) -> tuple[int, str]:
    """(exit code, message) for an exception that escaped the training loop. `memory_note`: this rank's memory
    at the time and the plan's figure, for a CUDA out-of-memory error (computed by the caller, which has torch)."""
    from .failures import is_comm_error, is_timeout

    where = f"during step {step}" if step else "before the first step"
    timed_out = aborted = ""
    if timeouts is not None:
        where = timeouts.where or where
        timed_out, aborted = f" ({timeouts.timed_out})", f" ({timeouts.aborted})"
    if isinstance(exc, DtlaunchError):
        return exc.exit_code, str(exc)
    text = str(exc)
    first = text.splitlines()[0][:300] if text else type(exc).__name__
    if is_oom(exc):
        # The same step needs the same memory: retrying on the same layout fails again, every time.
        return ExitCode.CONFIG, (
            f"CUDA out of memory {where}: {first}"
            + (f"\n{memory_note}" if memory_note else "")
            + "\nfix: lower training.micro_batch, raise parallelism.activation_checkpointing "
            "(selective, full), shard more (fsdp, zero3) or offload; `dtlaunch plan` shows "
            "what fits"
        )
    if any(m in text for m in NODE_FAULT_MARKERS):
        return ExitCode.PREFLIGHT, (
            f"the GPU failed {where} (a hardware fault of this node, not the job): {first}"
            "\nfix: exclude this node (targets.slurm.exclude) and resubmit"
        )
    if any(m in text for m in ABORTED_MARKERS):
        return ExitCode.HANG, (f"NCCL's watchdog aborted the communicators {where} after {TIMED_OUT}{aborted}: {first}")
    if is_timeout(exc):
        return ExitCode.HANG, (
            f"{TIMED_OUT} {where}{timed_out}: another rank stopped responding or diverged. "
            f"Underlying error: {str(exc).splitlines()[0][:300]}"
        )
    if is_comm_error(exc):
        text = str(exc)
        mismatch = any(m in text for m in ("preamble", "mismatch", "EnforceNotMet"))
        code = ExitCode.HANG if mismatch else ExitCode.FAILED
        what = "ranks issued mismatched collectives (divergence)" if mismatch else PEER_LOST
        return code, f"{what} {where}: {text.splitlines()[0][:300]}"
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.FAILED, f"interrupted {where}"
    return ExitCode.FAILED, f"training failed {where}: {type(exc).__name__}: {exc}"


# How far this rank's run got in this process: (the step it resumed from, the last step it reached). The
# trainer and the library record it; a time-limited SLURM allocation is continued only if it made progress.
_PROGRESS: list[int | None] = [None, None]


def record_progress(*, start: int | None = None, step: int | None = None) -> None:
    if start is not None:
        _PROGRESS[0] = start
    if step is not None:
        _PROGRESS[1] = step


def progress() -> tuple[int | None, int | None]:
    return _PROGRESS[0], _PROGRESS[1]
