"""Facts that the rendered job scripts and the in-job runtime must agree on, written once.

Torch-free, so `render` (on a laptop) and the runtime (on the cluster) read the same table: the exit-code
contract, the environment variables dtlaunch sets for a job, the port formula, the metrics file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from enum import IntEnum
from pathlib import Path


class ExitCode(IntEnum):
    """How a job (or one rank) ended; what the wrappers do about each is OUTCOMES, below."""

    OK = 0
    FAILED = 1
    CONFIG = 2  # bad recipe, plan or flags: restarting will not help
    PREEMPTED = 42  # a checkpoint was written after SIGUSR2/SIGTERM: requeue and resume
    HANG = 43  # a collective timed out or ranks disagreed on the step: restart and resume
    PREFLIGHT = 44  # the environment is broken (rendezvous, bandwidth, disk): fix the nodes first
    DIVERGED = 45  # the loss stayed NaN/inf: restarting from the last good checkpoint would diverge again
    STORAGE = 46  # checkpoint storage is full, read-only or keeps failing reads: a person must free or fix it

    def __str__(self) -> str:  # "42", as on Python 3.11+, also on 3.10
        return str(int(self))

    @classmethod
    def name_of(cls, code: int) -> str:
        try:
            return cls(code).name
        except ValueError:
            return str(code)


# ----------------------------------------------------------------------------- what happens after an exit code

# The one outcome policy, which every submit path follows: the sbatch job script (its decision function is
# rendered from this table), the submitit job (targets/slurm_decisions.py) and the SkyPilot task (its
# recover_on_exit_codes and its terminal marker), and the README's exit-code table (a test compares them).
#   resume: a checkpoint was written; the job goes on from it (SLURM requeues up to max_requeues, SkyPilot
#           recovers), and a time limit with progress continues it in a new allocation without counting;
#   retry:  counted as a failure, retried from the last checkpoint up to max_failures (torchrun first restarts
#           the ranks up to the target's max_restarts);
#   final:  never retried on any path: the same recipe, data or loss would end the same way again.
# A code not in the table (a signal's 128+N, torchrun's own 1) is a failure: "retry".
OUTCOMES: dict[ExitCode, str] = {
    ExitCode.OK: "done",
    ExitCode.FAILED: "retry",
    ExitCode.CONFIG: "final",
    ExitCode.PREEMPTED: "resume",
    ExitCode.HANG: "retry",
    ExitCode.PREFLIGHT: "retry",
    ExitCode.DIVERGED: "final",
    # Retried reads already happened inside the attempt (runtime.checkpoint.disk); a full or read-only disk stays so.
    ExitCode.STORAGE: "final",
}


def outcome(code: int) -> str:
    """What happens after exit code `code`: done, resume, retry or final (OUTCOMES)."""
    try:
        return OUTCOMES[ExitCode(code)]
    except ValueError:
        return "retry"


def restarts_in_place(code: int) -> bool:
    """Whether torchrun may restart the workers on the same nodes after a worker's exit `code` (its max_restarts
    lasting): not after a final code, nor after PREFLIGHT, a node's fault (a GPU failing under the job, a
    straggler), which a restart on the same node meets again: the job ends, and the SLURM job script requeues it
    without that node."""
    return outcome(code) != "final" and code != ExitCode.PREFLIGHT


FINAL_CODES = tuple(int(c) for c, o in OUTCOMES.items() if o == "final")
RESUME_CODES = tuple(int(c) for c, o in OUTCOMES.items() if o == "resume")
# slurmctld sends the time-limit signal on its 30 s tick, up to 30 s early: a USR2 that comes within
# signal_seconds + this many seconds of the limit is the time limit, not a preemption.
TIME_LIMIT_SLACK_S = 90
# A SkyPilot managed job recovers on any code outside recover_on_exit_codes while max_restarts_on_errors lasts
# (there is no "never retry" for a code): a final code is written here, in checkpoint storage, with the task id,
# and the next launch of the same task reads it before anything else and ends at once with it.
FINAL_MARKER = ".dtlaunch-final"


def watchdog_seconds(timeout_seconds: float) -> float:
    """How long the runtime's watchdog lets a rank go without finishing a step before it ends it with HANG (a
    rank stuck outside any collective, which no collective timeout sees): twice the collective timeout and a
    minute. A step that legitimately takes longer would end every time: validate refuses such plans."""
    return 2 * timeout_seconds + 60


def save_watchdog_seconds(init_timeout_seconds: float, timeout_seconds: float, planned_write_seconds: float) -> float:
    """How long a checkpoint being written may go without a write before the watchdog ends its rank with HANG:
    as long as the step's limit under either timeout its collectives may have (the checkpoint group's
    init_timeout_seconds, the training groups' timeout_seconds), and at least four times the plan's write time
    (a save written by another library, DeepSpeed's, reports no writes: there it is the whole save's bound)."""
    return max(watchdog_seconds(max(init_timeout_seconds, timeout_seconds)), 4 * planned_write_seconds)


# The environment contract of a job's processes (ours, or the user's own entrypoint).
PLAN = "DTLAUNCH_PLAN"  # path of the resolved plan file (plan.json)
RUN_ID = "DTLAUNCH_RUN_ID"  # the logical run: stable across requeues, recoveries and resubmissions
RUN_DIR = "DTLAUNCH_RUN_DIR"  # where metrics, status and (by default) checkpoints go
CHECKPOINT_DIR = "DTLAUNCH_CHECKPOINT_DIR"  # the run's checkpoint root, {run_id} already expanded
ATTEMPT = "DTLAUNCH_ATTEMPT"  # one launch of the workers (a requeue, a recovery, a resubmission is a new one)
STATUS = "DTLAUNCH_STATUS"  # this attempt's status directory: each rank's exit code, flight-recorder dumps
CODE_DIR = "DTLAUNCH_CODE_DIR"  # the user's entrypoint code as shipped with the job (the ranks' working directory)
NODE_ADDR = "DTLAUNCH_NODE_ADDR"  # this node's address as the others reach it (its hostname may not say)
NODE_RANK = "DTLAUNCH_NODE_RANK"  # this node's rank as the scheduler numbers it (SLURM_NODEID, SKYPILOT_NODE_RANK)
TARGET = "DTLAUNCH_TARGET"
PORT = "DTLAUNCH_PORT"  # the local and SkyPilot job scripts read it: a rendezvous port instead of their own choice
FAULT = "DTLAUNCH_FAULT"  # test-only fault injection (launcher.runtime.inject)
# A file each node that fails the pre-start check with PREFLIGHT appends its name to (the SLURM job script's
# JOB_DIR/bad_nodes): the job is requeued with those nodes excluded.
BAD_NODES = "DTLAUNCH_BAD_NODES"


class Excluded:
    """Why the SLURM job script left nodes out: the last field of its ledger line (JOB_DIR/excluded: "ATTEMPT
    TIME NODES WHY"), which `status` and `logs --diagnose` say in words."""

    CHECK = "check"  # a node failed the check before training (no rank of it started)
    FAULT = "fault"  # a rank on it exited PREFLIGHT under the job: its GPU failed, or it was a persistent straggler
    HANG = "hang"  # a hang's likely culprit ran there (the flight-recorder dumps, or the ranks' records)
    WORDS = {
        CHECK: "failed the node check before training",
        FAULT: f"a rank on it exited {int(ExitCode.PREFLIGHT)} under the job: a GPU fault or a persistent straggler",
        HANG: "a hang's likely culprit ran there",
    }

    @classmethod
    def ledger(cls, text: str) -> list[dict]:
        """The ledger's exclusions, oldest first: {attempt, nodes, why (in words; None from an older script)}."""
        out = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 3:
                why = cls.WORDS.get(parts[3], parts[3]) if len(parts) > 3 else None
                out.append({"attempt": parts[0], "nodes": parts[2], "why": why})
        return out


TRACK_MEMORY = "DTLAUNCH_TRACK_MEMORY"  # a step whose tensors each rank counts (`dtlaunch rehearse`'s memory check)
MEMTRACK_DIR = "memtrack"  # RUN_DIR/memtrack/rank-N.json: what each rank counted
# When this allocation began (epoch seconds): every job script sets it as it starts (a SLURM batch start, each
# SkyPilot run, a local launch), torchrun's restarts in place keep it. The runtime copies it into each attempt's
# `start` record, so the goodput ledger can tell a restart within one allocation (allocated time) from a requeue's
# wait for the next one (queued, not allocated).
ALLOCATION_START = "DTLAUNCH_ALLOCATION_START"
# On SkyPilot the VMs are the task's (and billed) from before `setup`: setup writes its start to this file in the
# cloud user's home, and each `run` on those VMs takes its allocation start from it.
ALLOCATION_START_FILE = ".dtlaunch-allocation-start"

# Names a recipe's env must not give: the job scripts export the recipe's variables first, so one of
# these would win over what dtlaunch sets for the job (env.DTLAUNCH_ATTEMPT made a finished run read LOST) or
# contradict what torchrun sets for each rank. Every DTLAUNCH_ name is dtlaunch's, including ones added later,
# except the inputs below, which dtlaunch reads and never sets.
RESERVED_PREFIXES = {"DTLAUNCH_": "dtlaunch", "TORCHELASTIC_": "torchrun"}
# torchrun's per-rank variables; DeepSpeed's launcher sets the same, and CROSS_*/LOCAL_SIZE besides.
RESERVED_NAMES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CROSS_RANK",
        "CROSS_SIZE",
        "LOCAL_SIZE",
    }
)
ENV_INPUTS = frozenset({"DTLAUNCH_PYTHON", FAULT})  # the job's interpreter (read by the job scripts); fault drills


def env_owner(name: str) -> str | None:
    """Who sets `name` for a job's processes ("dtlaunch" or "torchrun"), or None if a recipe may set it."""
    if name in ENV_INPUTS:
        return None
    if name in RESERVED_NAMES:
        return "torchrun"
    return next((who for prefix, who in RESERVED_PREFIXES.items() if name.startswith(prefix)), None)


# One rendezvous port per SLURM job id, so two jobs sharing a node do not collide; kept below Linux's
# ephemeral range (32768+), where the kernel hands out ports to outgoing connections.
PORT_BASE = 10000
PORT_SPAN = 20000


# Every line a job's ranks write starts with this (torchrun's --tee with TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, set
# by every launch script: render/templates/_labels.sh.j2), so that `dtlaunch logs NAME --node N --rank R` can pick
# one node's or one rank's lines out of the job's interleaved log. LOG_LINE reads what log_line_prefix writes.
def log_line_prefix(node: str, rank: str | int) -> str:
    return f"[{node} rank {rank}] "


LOG_LINE = re.compile(r"^\[(?P<node>[^\s\]]+) rank (?P<rank>\d+)\] ")


def node_name(env=os.environ) -> str:
    """This node's name as the scheduler knows it (SLURM's, for ExcNodeList), else its hostname."""
    import socket

    return env.get("SLURMD_NODENAME") or socket.gethostname()


def job_port(job_id: int) -> int:
    return PORT_BASE + job_id % PORT_SPAN


# When torchrun's agent restarts its workers after one failed (or after another node's did), it sends the rest
# SIGTERM and SIGKILLs them after this many seconds (torchrun's own wait is 30 s). No survivor can do anything
# useful by then: a checkpoint is collective and a peer is gone; only a rank that cannot act on TERM (hung in
# a collective or a kernel, stopped) uses the wait, and every second of it is the whole job's. A hang's
# flight-recorder dumps do not need it: they are written when the collective times out, before the restart.
RESTART_GRACE_S = 5
# On SkyPilot a node whose ranks failed only because a peer's connection closed under them waits this long
# before it ends: the node that caused the failure (a GPU's 44, a crash) must end first, or SkyPilot, which ends
# every other node when one fails, records this node's generic failure and loses the code recovery goes by.
PEER_LOST_GRACE_S = 15

# The oldest torch whose torchrun has what the job scripts use: --signals-to-handle (forward USR2 to the
# workers and shut down without restarting them) and --shutdown-timeout (time to checkpoint after TERM).
MIN_TORCH = (2, 12)


FLIGHT_RECORDER_DUMP_WAIT_S = 60
# Each rank's flight-recorder dump in its attempt's status directory: this prefix and the rank (job scripts, runtime).
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"
# A gloo rank that ended on a lost peer writes its ring too, under another name: the job scripts read a dump of
# their prefix as a hang, and this one is only evidence for the diagnosis (when the rank reached the collective).
LOST_PEER_RECORDER_PREFIX = "lost_peer_trace_rank_"
# A node whose check before training failed records it in its attempt's status directory (no rank of it
# starts, so no rank record says why): this prefix and the node's name, .json (`logs --diagnose` reads it).
CHECK_RECORD_PREFIX = "check-"

# Failures must be loud and diagnosable: an NCCL timeout that says nothing costs hours.
LOUD_FAILURES = {
    # 2 = CleanUpOnly: on a timed-out collective the watchdog aborts the communicators and the error reaches
    # Python, which exits HANG (43). 3 (SkipCleanUp, torch's default) tears the process down from the
    # watchdog thread, before Python can say why; a rank that still dies that way leaves the flight
    # recorder's dump (below), which the job scripts also read as HANG.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # flight recorder dump on timeout (path set per attempt by the job script)
    # How long the watchdog waits for that dump before it aborts the communicators and the error reaches Python
    # (torch's default, 15 s, can cut a large dump short on slow storage); the rank then waits for its own dump
    # file before exiting (launcher.runtime.train), so the dump is not lost to the exit.
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": str(FLIGHT_RECORDER_DUMP_WAIT_S * 1000),
    "TORCH_FR_BUFFER_SIZE": "2000",
    "NCCL_DEBUG": "WARN",
    "PYTHONUNBUFFERED": "1",
    "PYTHONFAULTHANDLER": "1",
    # torchrun restarts must not reuse the previous attempt's gloo/NCCL addresses from torchrun's shared
    # store: restarted workers hung or failed with "Gloo connectFullMesh failed" in 6 of 24 runs here.
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}


# GPU jobs (as torchtitan's): the caching allocator grows a segment in place instead of reserving a new one for
# each odd-sized block, which keeps fragmentation within what the planner budgets (launcher.plan.memory).
GPU_ENV = {
    "PYTORCH_ALLOC_CONF": "expandable_segments:True",
    # The flight recorder's NCCL entries carry each collective's time on the device, from which every rank's wait
    # for the last rank to arrive is measured at log steps (launcher.runtime.stragglers.CollectiveClock).
    "TORCH_NCCL_ENABLE_TIMING": "1",
}

# training.deterministic: a restarted run must end with the same weights as an uninterrupted one. cuBLAS needs a
# fixed workspace for deterministic GEMMs; NCCL picks its algorithm and protocol by message size and topology and
# reduces in-switch (NVLS on H100 nodes) or in-network (CollNet), each summing in its own order: fixed to the ring
# and the simple protocol, which costs bandwidth (deterministic mode is for debugging and drills).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
DETERMINISTIC_NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_COLLNET_ENABLE": "0",
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
}


def job_environment(
    network_env: dict[str, str],
    *,
    is_gpu: bool,
    socket_ifname: str | None = None,
    omp_threads: int | None = None,
    deterministic: bool = False,
) -> dict[str, str]:
    """The variables a job sets for its processes (render writes them into scripts; the runtime sets the
    same ones when started without a script). NCCL settings only matter on GPUs; threads only on CPUs."""
    env = dict(LOUD_FAILURES)
    if deterministic:
        env.update(DETERMINISTIC_ENV)
    if is_gpu:
        env.update(GPU_ENV)
        env.update(network_env)
        if deterministic:
            env.update(DETERMINISTIC_NCCL_ENV)
    if socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = socket_ifname
        env["GLOO_SOCKET_IFNAME"] = socket_ifname
    if omp_threads:
        # One OMP pool per rank sized to its share of the cores: oversubscribed pools make every rank far slower.
        env["OMP_NUM_THREADS"] = str(omp_threads)
    return env


# ----------------------------------------------------------------------------- metrics

METRICS_FILE = "metrics.jsonl"


def metrics_path(run_dir_or_file: str | os.PathLike) -> Path:
    p = Path(run_dir_or_file)
    return p / METRICS_FILE if p.is_dir() else p


# The record a job script appends once the training step has exited (its exit code; the job's last seconds are
# its decision and requeue): the goodput ledger ends the attempt's allocated time there, not at the worker's last
# record. The SLURM job script writes it in bash; the submitit job calls exited_record.
EXITED_EVENT = "exited"


def exited_record(code: int, at: float) -> str:
    return json.dumps({"event": EXITED_EVENT, "code": int(code), "time": at}) + "\n"


def allocation_start(env: Mapping[str, str] = os.environ) -> float | None:
    """This allocation's start (ALLOCATION_START) when a job script set it, else None."""
    try:
        return float(env[ALLOCATION_START])
    except (KeyError, ValueError):
        return None


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All records of a metrics.jsonl (a run dir or the file itself); a torn last line is skipped."""
    return _records(metrics_path(path).read_text(errors="replace").splitlines())


def _records(lines: list[str]) -> list[dict]:
    """The JSON objects among metrics.jsonl lines; a torn or foreign line is skipped."""
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def tail_records(path: str | os.PathLike, tail_bytes: int = 1 << 16) -> list[dict]:
    """The records at the end of a metrics.jsonl (a run dir or the file), oldest first, read from the file's end
    only (a long run's file grows by a line per logged step; `status` must not read it all)."""
    try:
        with open(metrics_path(path), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return _records(lines)


def last_logged_step(
    path: str | os.PathLike, tail_bytes: int = 1 << 16, between: tuple[float, float | None] | None = None
) -> dict | None:
    """The newest logged step's record of a metrics.jsonl (logged `between` two times, the second open, if
    given); None if there is none."""
    lo, hi = between or (0.0, None)
    return next(
        (
            r
            for r in reversed(tail_records(path, tail_bytes))
            if "step" in r and "loss" in r and lo <= (r.get("time") or 0) and (hi is None or r["time"] < hi)
        ),
        None,
    )


# ----------------------------------------------------------------------------- formatting


def span(seconds: float | None) -> str:
    """A span as `status` and the step line show it: 45s, 12m, 3h05m, 2d04h."""
    if seconds is None or seconds < 0:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


GB = 1e9  # vendors quote GPU memory in GB of 1e9 bytes; so does every figure dtlaunch prints


def gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB"
