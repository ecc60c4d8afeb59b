"""Local target: run the rendered launch.sh (torchrun) on this machine, detached, logging to a file.

The job owns its whole process tree, and only it: torchrun runs in a session of its own and its workers
in theirs, so a process group is not enough to find them. Every process of an `up` carries that up's
DTLAUNCH_ATTEMPT in its environment, which is how `down` finds all of them (and never anything else), and
the launcher's recorded start (in clock ticks since boot, which a clock step does not move) guards against a
pid reused by an unrelated process. Each `up` is an attempt with its own log and exit code, so the history of
a run directory is never rewritten.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import BackendError, DtlaunchError
from ...jobenv import ATTEMPT, ExitCode, tail_records
from .. import LIVE, JobStatus, backend, require_secrets
from ..registry import JobRecord, Registry
from .request import LocalHandle, LocalRequest

if TYPE_CHECKING:
    from ...render.artifacts import Artifacts

# Keyed by int, as the exit codes read back are: ExitCode is an IntEnum, so its members find the same entries.
STATES: dict[int, str] = {
    ExitCode.OK: "COMPLETED",
    ExitCode.PREEMPTED: "PREEMPTED",
    ExitCode.HANG: "FAILED (hang)",
    ExitCode.PREFLIGHT: "FAILED (preflight)",
    ExitCode.CONFIG: "FAILED (config)",
}
STOP_GRACE = 60.0  # seconds `down` waits for the workers to checkpoint before it kills what is left


def _psutil():
    try:
        import psutil
    except ImportError:
        raise BackendError(
            "the local target needs psutil to follow its processes", fix="pip install 'dtlaunch[train]'"
        ) from None
    return psutil


def _start_time(pid: int) -> float | None:
    psutil = _psutil()
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


@functools.lru_cache(maxsize=1)
def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def launcher_identity(pid: int) -> str | None:
    """ "<boot id>:<start ticks>" of a live process (Linux), None if there is none (or no /proc).

    The start in clock ticks since boot (/proc/PID/stat field 22) is what the kernel keeps; psutil >= 7 adds it
    to a boot time derived from the current wall clock, so its create_time moves when the clock is stepped."""
    try:
        with open(f"/proc/{pid}/stat") as f:  # open(), not pathlib: `status` calls this once per recorded job
            stat = f.read()
        boot = _boot_id()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces and ")"
    if len(fields) < 20 or fields[0] in ("Z", "X"):  # a zombie has ended
        return None
    return f"{boot}:{fields[19]}"


def process_table() -> dict[str, list]:
    """attempt -> its live processes, from one pass over the process table (ours only: same user)."""
    psutil = _psutil()
    me = os.getpid()
    prefix = f"{ATTEMPT}="
    out: dict[str, list] = {}
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        attempts = {env.get(ATTEMPT)} | {k[len(prefix) :] for k in env if k.startswith(prefix)}
        for a in attempts - {None}:
            out.setdefault(a, []).append(p)
    return out


def job_processes(attempt: str) -> list:
    """Every live process whose environment says it belongs to this attempt."""
    return process_table().get(attempt, [])


def refuse_if_active(run_dir: str, registry: Registry) -> None:
    """Refuse a run directory a job still uses: a local job writes its checkpoints there, and a SLURM job's next
    attempt (a requeue) starts from the plan and scripts there, which a new `up` would rewrite under it. A
    SkyPilot job took its files at launch; a job whose state cannot be read now (no squeue here) is not known
    to be live."""
    if not registry.path.exists():  # nothing recorded yet (and a dry run creates no registry)
        return
    for rec in registry.of_run_dir(run_dir):
        if rec.target == "sky":
            continue
        try:
            state = backend(rec.target).status(rec).state
        except DtlaunchError:
            continue
        if state in LIVE:
            raise BackendError(
                f"{run_dir} is in use by job {rec.name} ({rec.target} {rec.job_id}, {state}, submitted "
                f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(rec.created))}): a second job would rewrite the "
                "plan it runs and write the same run's checkpoints; nothing was changed",
                fix=f"wait for it, stop it with `dtlaunch down {rec.target}:{rec.job_id}`, or use -o for another "
                "run directory",
            )


@contextmanager
def claim_run_dir(out: str | os.PathLike, registry: Registry, *, lock: bool = True) -> Iterator[None]:
    """Before anything is written into `out`: refuse it if a job still uses it (refuse_if_active); with `lock`, hold its lock until
    the block ends (after the new job is recorded), so the check and the record are one step."""
    run_dir = str(Path(out).resolve())
    if not lock:
        refuse_if_active(run_dir, registry)
        yield
        return
    with registry.claim(run_dir):
        refuse_if_active(run_dir, registry)
        yield


class LocalBackend:
    name = "local"

    def __init__(self, cwd: str | None = None):
        self.cwd = cwd or os.getcwd()
        self._proc: subprocess.Popen | None = None
        self._table: tuple[float, dict[str, list]] | None = None  # (monotonic time, process_table())

    def _processes(self, attempt: str) -> list:
        """job_processes(), from one process table scan a second: `status` of 1,000 jobs scans once, not 1,000 times."""
        now = time.monotonic()
        if self._table is None or now - self._table[0] > 1.0:
            self._table = (now, process_table())
        return self._table[1].get(attempt, [])

    # ---------------------------------------------------------------- submit

    def submit(self, artifacts: Artifacts, out_dir: str, env: Mapping[str, str] | None = None) -> JobRecord:
        """Start the job; the caller holds claim_run_dir(out_dir) around this and recording it. `env`: the job's
        environment instead of this process's (`dtlaunch rehearse` sets a fault or a memory count per run)."""
        req = artifacts.request
        assert isinstance(req, LocalRequest)
        require_secrets(req.secrets, "the job reads them from the environment it is started in")
        run_dir = Path(out_dir).resolve()
        attempt = f"up-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        log_path = run_dir / "logs" / f"{attempt}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**(os.environ if env is None else env), ATTEMPT: attempt}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                ["bash", str(run_dir / req.script)],
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        self._proc = proc
        created = _start_time(proc.pid) or time.time()
        handle = LocalHandle(
            proc.pid,
            created,
            attempt,
            str(log_path),
            str(run_dir / "status" / attempt / "exit_code"),
            launcher_identity(proc.pid),
        )
        return JobRecord(artifacts.job_name, "local", str(proc.pid), str(run_dir), handle)

    # ---------------------------------------------------------------- follow

    @staticmethod
    def _exit_code(h: LocalHandle) -> int | None:
        try:
            with open(h.exit_file) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _launcher_alive(h: LocalHandle) -> bool:
        if h.start_id is not None:
            return launcher_identity(h.pid) == h.start_id
        # A row without start_id (written before it, or not on Linux): the wall-clock start time, within 1 s.
        psutil = _psutil()
        t = _start_time(h.pid)
        try:
            return t is not None and abs(t - h.create_time) < 1.0 and psutil.Process(h.pid).status() != "zombie"
        except psutil.NoSuchProcess:
            return False

    def status(self, job: JobRecord) -> JobStatus:
        h = job.handle
        assert isinstance(h, LocalHandle)
        rc = self._exit_code(h)
        if rc is not None:
            return JobStatus(STATES.get(rc, "FAILED"), rc)
        if self._launcher_alive(h):
            return JobStatus("RUNNING")
        if self._processes(h.attempt):
            return JobStatus("STOPPING", detail="the launcher is gone; its workers are checkpointing and stopping")
        return JobStatus("LOST", detail="the launcher is gone without an exit code (killed?)")

    def records_dir(self, job: JobRecord) -> str:
        return job.run_dir

    def logs(self, job: JobRecord, *, follow: bool, skip: int = 0) -> Iterator[str]:
        """The job's log, from its `skip`-th character on; with `follow`, until the job ends."""
        h = job.handle
        assert isinstance(h, LocalHandle)
        path = Path(h.log)
        if not path.exists():
            raise BackendError(f"no log for {job.name} at {path}", fix="the run directory may have been removed")
        with open(path, errors="replace") as f:
            f.read(skip)
            while True:
                line = f.readline()
                if line:
                    yield line
                    continue
                if not follow or self.status(job).state not in ("RUNNING", "STOPPING"):
                    rest = f.read()
                    if rest:
                        yield rest
                    return
                time.sleep(0.2)

    def wait(self, job: JobRecord, stream=None) -> int:
        """Stream the log until the job ends. Ctrl-C asks the job to checkpoint and stop, and the log goes on to
        the end (the checkpoint's commit line included); a second Ctrl-C stops watching, not the stop."""
        stream = stream or sys.stdout  # looked up now: the caller may have replaced sys.stdout
        shown, stopping, said = 0, None, []
        while True:
            try:
                for line in self.logs(job, follow=True, skip=shown):
                    stream.write(line)
                    stream.flush()
                    shown += len(line)
                break
            except KeyboardInterrupt:
                if stopping is not None:
                    print(
                        f"dtlaunch: no longer watching; {job.name} goes on stopping by itself "
                        f"(`dtlaunch status {job.name}` shows when it has)",
                        file=sys.stderr,
                    )
                    return 130  # interrupted: the job's own exit code is not known yet
                print(
                    f"dtlaunch: stopping {job.name}: its workers checkpoint, then exit "
                    "(Ctrl-C again stops watching; the job still stops)",
                    file=sys.stderr,
                )
                # the stop (TERM, the grace period, a KILL for what outlives it) runs beside the log, which shows
                # the workers checkpointing; a daemon thread, so a second Ctrl-C can leave at once
                stopping = threading.Thread(target=lambda: said.append(self.cancel(job)), daemon=True)
                stopping.start()
        if stopping is not None:
            stopping.join()
            print(said[0] if said else f"stopped {job.name}", file=sys.stderr)
        if self._proc is not None:
            self._proc.wait()
        rc = self._exit_code(job.handle)
        return rc if rc is not None else ExitCode.FAILED

    # ---------------------------------------------------------------- stop

    def _what_happened(self, job: JobRecord) -> str:
        """What a stop did, from the job's own records: the step its workers checkpointed, or that it stopped
        before training began (the launch script's early trap), or the exit code it ended with."""
        rc = self._exit_code(job.handle)
        if rc is None:
            return "its processes are gone, and no exit code was recorded"
        if rc != ExitCode.PREEMPTED:
            return f"it ended with exit code {rc} ({STATES.get(rc, 'FAILED')})"
        saved = None
        for rec in tail_records(job.run_dir):
            if rec.get("event") == "preempt" and rec.get("time", 0) >= job.created:
                saved = rec.get("step")
        if saved is None:
            return "stopped before training began (nothing to checkpoint); `dtlaunch up` starts it again"
        return f"its workers checkpointed step {saved} and exited {rc}; `dtlaunch up` resumes from there"

    def cancel(self, job: JobRecord, grace: float = STOP_GRACE) -> str:
        h = job.handle
        assert isinstance(h, LocalHandle)
        rc = self._exit_code(h)
        if rc is not None:
            return f"{job.name} already finished ({STATES.get(rc, 'FAILED')}, exit code {rc}); nothing to stop"
        psutil = _psutil()
        if self._launcher_alive(h):
            os.kill(h.pid, signal.SIGTERM)  # launch.sh passes it to torchrun, which passes it to the workers
        else:
            procs = job_processes(h.attempt)
            if not procs:
                return f"{job.name} is not running (its processes are gone); nothing to stop"
            # The launcher is gone (or not recognised): TERM the tops of what is left of the job's tree (torchrun,
            # or orphaned workers); each passes it on as launch.sh would, so the workers checkpoint.
            pids = {p.pid for p in procs}
            for p in procs:
                try:
                    if p.ppid() not in pids:
                        p.send_signal(signal.SIGTERM)
                except psutil.NoSuchProcess:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not job_processes(h.attempt) and not self._launcher_alive(h):
                return f"stopped {job.name}: {self._what_happened(job)}"
            time.sleep(0.3)
        left = job_processes(h.attempt)  # only what outlived SIGTERM and the grace period is killed
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return f"stopped {job.name}: {len(left)} process(es) did not stop within {grace:.0f}s and were killed"
