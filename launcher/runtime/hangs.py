"""What a hung rank leaves behind for `dtlaunch logs --diagnose`, and how it is read back.

- The flight recorder: torch keeps each rank's last collectives in a ring (TORCH_FR_BUFFER_SIZE, set by jobenv)
  for gloo as for NCCL. NCCL's watchdog writes the ring to TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank> when a
  collective times out (TORCH_NCCL_DUMP_ON_TIMEOUT); gloo records the same entries but writes nothing, so a gloo
  rank that ends with HANG writes its own (`dump`). Read back (`read`, `verdict`), the dumps say which rank never
  entered which collective: the others' rings end in a collective whose sequence number the culprit's never
  reached (or the culprit left no dump at all).
- Stacks: where py-spy is installed (dtlaunch[train] brings it), the first rank of a node to end with HANG writes
  the Python stacks of every worker on its node (`stacks`), so a rank stuck outside any collective shows where.
- The watchdog (`Watchdog`, dtlaunch's own loop): a rank with no step for too long, or that cannot act on a
  signal, ends with HANG after leaving the above.

Reading imports no torch (the CLI's `logs --diagnose` runs where there may be none).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .. import jobenv
from ..jobenv import ExitCode

if TYPE_CHECKING:
    from .signals import PreemptionFlag

DUMP_PREFIX = jobenv.FLIGHT_RECORDER_PREFIX
LOST_PEER_PREFIX = jobenv.LOST_PEER_RECORDER_PREFIX
STACKS_PREFIX = "stacks-"
STACKS_TIMEOUT_S = 20


def dump_path(rank: int, env=os.environ) -> Path | None:
    prefix = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    return Path(f"{prefix}{rank}") if prefix else None


def wait_for_nccl_dump(rank: int, limit_s: float = jobenv.FLIGHT_RECORDER_DUMP_WAIT_S) -> None:
    """A rank ending with HANG on NCCL: give NCCL's watchdog the time to finish writing this rank's dump (an
    immediate exit kills the thread writing it). Returns as soon as the file exists and stops growing."""
    path = dump_path(rank)
    if path is None or os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT") != "1":
        return
    deadline = time.monotonic() + limit_s
    size = -1
    while time.monotonic() < deadline:
        now = path.stat().st_size if path.exists() else -1
        if now >= 0 and now == size:
            return
        size = now
        time.sleep(0.5)


def dump(rank: int, *, lost_peer: bool = False) -> Path | None:
    """Write this rank's flight-recorder ring where the job scripts point NCCL's (a gloo rank's own dump; with
    `lost_peer`, under LOST_PEER_PREFIX); the path, or None when there is nowhere to write, no torch or nothing
    recorded. Never raises: it runs on the way out of a failed rank."""
    path = dump_path(rank)
    if path is not None and lost_peer:
        path = path.with_name(f"{LOST_PEER_PREFIX}{rank}")
    if path is None or path.exists():  # NCCL's watchdog (or an earlier call) wrote it already
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]  # private, no stub

        data = _dump_fr_trace()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return path
    except Exception:  # noqa: BLE001 - a diagnosis aid must not change how the rank ends
        return None


def _workers() -> list[tuple[int, int]]:
    """(pid, rank) of every worker on this node: this process's siblings under torchrun's agent, and itself."""
    try:
        import psutil

        here = psutil.Process()
        parent = here.parent()
        procs = parent.children() if parent is not None and "RANK" in os.environ else [here]
    except Exception:  # noqa: BLE001 - no psutil, or the parent is gone
        return [(os.getpid(), int(os.environ.get("RANK", "0") or 0))]
    out = []
    for p in procs:
        try:
            rank = p.environ().get("RANK")
        except Exception:  # noqa: BLE001 - not ours to read, or gone
            continue
        if rank is not None:
            out.append((p.pid, int(rank)))
    return sorted(out, key=lambda pr: pr[1])


def stacks(status_dir: Path | None = None, node: str | None = None, include_self: bool = True) -> Path | None:
    """The Python stacks of every worker on this node (py-spy dump), written once per node and attempt to
    STATUS/stacks-NODE.txt; None when py-spy is missing, there is no status directory or another rank of this
    node wrote them first. Never raises."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    status_dir = status_dir or (Path(os.environ[jobenv.STATUS]) if os.environ.get(jobenv.STATUS) else None)
    if spy is None or status_dir is None:
        return None
    node = node or jobenv.node_name()
    path = status_dir / f"{STACKS_PREFIX}{node}.txt"
    try:
        status_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return None
    with os.fdopen(fd, "w") as out:
        for pid, rank in _workers():
            out.write(f"=== rank {rank} (pid {pid}) on {node}\n")
            if pid == os.getpid() and not include_self:
                out.write("(the rank taking these stacks, after its collective timed out)\n")
                continue
            try:
                p = subprocess.run(
                    [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=STACKS_TIMEOUT_S
                )
                out.write(p.stdout if p.returncode == 0 else f"py-spy failed: {p.stderr.strip()}\n")
            except (OSError, subprocess.TimeoutExpired) as e:
                out.write(f"py-spy failed: {e}\n")
            out.flush()
    return path


def on_nccl() -> bool:
    """Does this process's default group run on NCCL (whose watchdog writes the dump)?"""
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist and dist.is_initialized() and "nccl" in str(dist.get_backend()))
    except Exception:  # noqa: BLE001 - a torn-down group
        return False


def on_hang(rank: int, *, nccl: bool | None = None, watchdog: bool = False) -> None:
    """A rank ending with HANG: its flight-recorder dump (NCCL's, waited for; else its own) and its node's stacks.
    `watchdog`: called from the no-progress watchdog's thread while the main thread is stuck (its stack is the
    point; NCCL's watchdog writes no dump for a rank stuck outside a collective, so none is waited for); else
    from the main thread on its way out (its own stack says only that)."""
    if on_nccl() if nccl is None else nccl:
        if not watchdog:
            wait_for_nccl_dump(rank)
    else:
        dump(rank)
    stacks(include_self=watchdog)


class _PlainValues(pickle.Unpickler):
    """torch's dumps hold dicts, lists, tuples, strings and numbers: nothing that needs a class, so none is
    loaded (a dump is a file on shared storage, not code to run)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a flight-recorder dump names {module}.{name}: not a plain value")


def read(path: Path) -> dict | None:
    try:
        d = _PlainValues(io.BytesIO(path.read_bytes())).load()
    except Exception:  # noqa: BLE001 - NCCL's drill stand-ins, a cut-short dump: no entries to read
        return None
    return d if isinstance(d, dict) and isinstance(d.get("entries"), list) else None


def read_dumps(status_dir: Path) -> dict[int, dict]:
    """rank -> its dump, for the dumps in one attempt's status directory that can be read (a rank's hang dump
    before the one it wrote on losing a peer)."""
    out: dict[int, dict] = {}
    for prefix in (DUMP_PREFIX, LOST_PEER_PREFIX):
        for p in status_dir.glob(f"{prefix}*"):
            tail = p.name[len(prefix) :]
            if tail.isdigit() and int(tail) not in out and (d := read(p)) is not None:
                out[int(tail)] = d
    return out


def _last(d: dict) -> dict[str, tuple[int, str, float | None]]:
    """Process group -> (the last collective sequence number this rank entered, that collective's name, when it
    entered it: seconds since the epoch, None when the dump does not say). A group is known by its description
    (default_pg, checkpoint, ...), and by its unique name where it has none ("undefined": groups made without one
    would otherwise share their numbers)."""
    out: dict[str, tuple[int, str, float | None]] = {}
    for e in d["entries"]:
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue
        pg = e.get("process_group")
        if isinstance(pg, (list, tuple)) and len(pg) > 1:
            name = str(pg[1]) if pg[1] not in (None, "", "undefined") else f"group {pg[0]}"
        else:
            name = str(pg)
        seq = int(e.get("collective_seq_id") or 0)
        if seq >= out.get(name, (0, "", None))[0]:
            created = e.get("time_created_ns")
            out[name] = (seq, str(e.get("profiling_name") or "?"), created / 1e9 if isinstance(created, int) else None)
    return out


CLOCK_SLACK_S = 1.0  # nodes' clocks (NTP) agree to within this: an entry this close to a rank's timeout is not late


def verdict(dumps: dict[int, dict], world: int, gave_up: float | None = None) -> tuple[list[int], str] | None:
    """(culprit ranks, why) from one attempt's dumps: in the first process group (the default group first) where
    ranks stopped at different collectives, the ranks whose last collective is behind the furthest one, or that
    left no dump; where they all reached the same one, those that entered it only after `gave_up` (when the first
    rank's collective timed out: a rank stuck elsewhere got there after, and its dump was written as the lost peer
    ended it). None: no dumps, or the dumps cannot tell."""
    if not dumps:
        return None
    last = {rank: _last(d) for rank, d in dumps.items()}
    groups = sorted({g for lr in last.values() for g in lr}, key=lambda g: (g != "default_pg", g))
    for g in groups:
        seqs = {rank: lr.get(g, (0, "", None))[0] for rank, lr in last.items()}
        top = max(seqs.values())
        name = next(lr[g][1] for lr in last.values() if lr.get(g, (0, "", None))[0] == top)
        ahead = sorted(r for r, s in seqs.items() if s == top)
        if g == "default_pg":
            missing = [r for r in range(world) if r not in dumps]
        else:
            missing = []
        behind = sorted(r for r, s in seqs.items() if s < top)
        culprits = sorted(behind + missing)
        parts = []
        if not culprits and gave_up is not None:
            entered = {r: last[r].get(g, (0, "", None))[2] for r in ahead}
            late = [r for r, t in entered.items() if t is not None and t > gave_up + CLOCK_SLACK_S]
            if late and len(late) < len(ahead):
                ahead = [r for r in ahead if r not in late]
                culprits = late
                parts.append(f"{'it' if len(late) == 1 else 'they'} entered it only after a rank had timed out there")
        if not culprits:
            continue
        if behind:
            shown = ", ".join(f"rank {r} at #{seqs[r]}" for r in behind)
            parts.append(f"its flight recorder ends before it ({shown})")
        if missing:
            parts.append(f"{'rank' if len(missing) == 1 else 'ranks'} {', '.join(map(str, missing))} left no dump")
        waiting = ("rank " if len(ahead) == 1 else "ranks ") + ", ".join(map(str, ahead))
        how = "was late to" if not behind and not missing else "never entered"
        return culprits, f"{how} {name} #{top} in {g}, where {waiting} waited; " + "; ".join(parts)
    return None


class Watchdog:
    """Backstop for what no collective timeout catches: a rank stuck outside communication.

    Exits with HANG when no step finishes within `limit` seconds, or when a signal (SIGTERM from
    torchrun tearing the world down after a peer failed, or a preemption) was received and no step
    boundary follows within `grace` seconds: a stuck rank would otherwise ignore torchrun's SIGTERM
    (the handler only sets a flag) and delay the restart until torchrun's SIGKILL 30 s later. While a
    checkpoint is written (`saving`) the rules are the save's own.
    """

    def __init__(self, limit: float, grace: float, rank: int, flag: PreemptionFlag | None = None):
        self.limit, self.grace, self.rank, self.flag = limit, grace, rank, flag
        self.step = 0
        self.armed = False
        self._save: tuple[float, Callable[[], float]] | None = None  # (limit, last write) while saving
        self.last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="dtlaunch-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        self.step, self.last, self.armed = step, time.monotonic(), True

    def pause(self) -> None:
        self.armed = False

    @contextmanager
    def saving(self, limit: float, written: Callable[[], float] = lambda: 0.0) -> Iterator[None]:
        """While a checkpoint is written: it may outlast many steps, and a preemption signal must let it finish,
        so the signal's grace does not apply; a save that writes nothing for `limit` seconds (`written()`: the
        monotonic time of its latest write) ends the rank: a rank stuck in storage, which no collective timeout
        sees when every rank is stuck there, or in a world of one. Then the watchdog is as it was, its clock
        restarted (a save is progress)."""
        armed = self.armed
        # the clock first: the thread must never see the save mode's end with the save's start as its clock
        self.last = time.monotonic()
        self._save, self.armed = (limit, written), True
        try:
            yield
        finally:
            self.last = time.monotonic()
            self._save, self.armed = None, armed

    def _exit(self, why: str) -> None:
        print(
            f"dtlaunch: rank {self.rank}: {why} (last completed step {self.step}): exiting with HANG ({ExitCode.HANG})",
            file=sys.stderr,
            flush=True,
        )
        on_hang(self.rank, watchdog=True)  # where this rank was stuck, for the diagnosis
        os._exit(ExitCode.HANG)

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            if not self.armed:
                continue
            now = time.monotonic()
            if (save := self._save) is not None:
                limit, written = save
                if now - max(self.last, written()) > limit:
                    self._exit(f"a checkpoint being written made no progress for {limit:.0f}s")
                continue
            if now - self.last > self.limit:
                self._exit(f"no progress for {self.limit:.0f}s")
            flag = self.flag
            sig_at = flag.received_at if flag is not None else None
            if flag is not None and sig_at is not None and now - max(sig_at, self.last) > self.grace:
                self._exit(f"received {flag.received} but reached no step boundary within {self.grace:.0f}s")
