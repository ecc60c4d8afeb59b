"""SLURM target: submit the rendered job.sbatch with `sbatch --parsable`, follow it, cancel it.

Runs the SLURM commands here, or on a login node over SSH (targets.slurm.ssh; see ssh.py). The
settings come from the plan.json shipped with the artifacts, so `up` needs no extra flags.
With `targets.slurm.submit: submitit` the request is submitted by submitit instead (submitit_job.py,
imported only then); the job is still a SLURM job with the same ledgers, so following and cancelling it
is the same, except that its log is submitit's.

Status: squeue (pending/running), then sacct (finished), then the job's own state files
(jobs/ID/state, exit_codes, attempts), which work even when accounting is disabled.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ...errors import BackendError
from ...jobenv import Excluded
from ...recipe.fields import RUN_ID
from .. import JobStatus, require_secrets
from ..registry import JobRecord
from .common import JOBS_DIR, RUNS_DIR
from .request import SLURM_SECRETS, SlurmHandle, SlurmRequest
from .ssh import SshTransport

if TYPE_CHECKING:
    from ...render.artifacts import Artifacts

TERMINAL = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "LOST",
)


def _sbatch_fix(said: str, submit_dir: str, req) -> str:
    """The fix line for a refused sbatch: what its message means when it is a known one, else the script."""
    if "configuration" in said.lower() and ("establish" in said.lower() or "slurm.conf" in said.lower()):
        # sbatch found no slurm.conf (no SLURM_CONF, no configless DNS record, nothing in /etc/slurm)
        return (
            "this shell has no SLURM configuration: set SLURM_CONF to the cluster's slurm.conf, or source the "
            "cluster's environment (its module or env script) first"
        )
    return f"read the script: {submit_dir}/{req.job_script}"


class LocalShell:
    """The SLURM client on this machine."""

    def run(self, argv: Sequence[str], cwd: str | None = None, timeout: float = 120) -> tuple[int, str, str]:
        if shutil.which(argv[0]) is None:
            raise BackendError(
                f"{argv[0]} not found on PATH: install the SLURM client (e.g. apt install slurm-client) "
                "or submit from a login node with targets.slurm.ssh"
            )
        try:
            p = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BackendError(
                f"`{' '.join(argv)}` did not answer within {timeout:.0f}s: the SLURM controller is slow or down",
                fix="try again; `sinfo` shows whether the cluster answers",
            ) from None
        return p.returncode, p.stdout, p.stderr

    def read(self, path: str, offset: int = 0) -> bytes | None:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read()
        except OSError:
            return None

    def close(self) -> None:
        pass


class SlurmBackend:
    name = "slurm"

    def __init__(self, poll_seconds: float = 2.0):
        self.poll_seconds = poll_seconds

    # ---------------------------------------------------------------- transport

    @staticmethod
    def _transport(handle: SlurmHandle):
        return SshTransport(handle.ssh) if handle.ssh else LocalShell()

    # ---------------------------------------------------------------- submit

    def submit(self, artifacts: Artifacts, out_dir: str) -> JobRecord:
        """Submit; raise BackendError (and record nothing) if sbatch is missing or rejects the script."""
        req = artifacts.request
        assert isinstance(req, SlurmRequest)
        if req.submit == "submitit":
            from .submitit_job import record, submit

            return record(submit(req, out_dir), artifacts.job_name, out_dir, dependency=req.settings.dependency)
        settings = req.settings
        ssh = msgspec.to_builtins(settings.ssh) if settings.ssh else None
        tr = SshTransport(ssh) if ssh else LocalShell()
        try:
            if isinstance(tr, SshTransport):
                name = f"{artifacts.job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
                submit_dir = tr.upload(
                    artifacts.files, artifacts.executable, tr.spec.remote_dir.rstrip("/") + "/" + name
                )
            else:
                submit_dir = str(Path(out_dir).resolve())
                require_secrets(req.secrets, SLURM_SECRETS)
            rc, out, err = tr.run(list(req.argv), cwd=submit_dir)
        finally:
            tr.close()
        if rc != 0:
            said = err.strip() or out.strip()
            raise BackendError(f"sbatch rejected the job (exit {rc}): {said}", fix=_sbatch_fix(said, submit_dir, req))
        job_id = out.strip().splitlines()[-1].split(";")[0] if out.strip() else ""
        if not job_id.isdigit():
            raise BackendError(f"sbatch printed no job id (stdout {out!r}, stderr {err!r})")
        handle = SlurmHandle(submit_dir, artifacts.job_name, req.array, ssh, dependency=settings.dependency)
        return JobRecord(artifacts.job_name, "slurm", job_id, submit_dir, handle)

    # ---------------------------------------------------------------- status

    def status(self, job: JobRecord) -> JobStatus:
        tr = self._transport(job.handle)
        try:
            return self._status(tr, job)
        finally:
            tr.close()

    def _status(self, tr, job: JobRecord) -> JobStatus:
        files = self._files(tr, job)
        rc, out, _ = tr.run(["squeue", "-h", "-j", job.job_id, "-o", "%T"])
        states = [s for s in out.split() if s]
        if rc == 0 and states:
            state = _merge(states)
            detail = None
            if state == "PENDING" and getattr(job.handle, "dependency", None):
                _, reason, _ = tr.run(["squeue", "-h", "-j", job.job_id, "-o", "%r"])
                detail = f"after {job.handle.dependency}" + (f" ({reason.split()[0]})" if reason.strip() else "")
            return JobStatus(state, None, detail, extra={"source": "squeue", **files})
        rc, out, _ = tr.run(["sacct", "-n", "-X", "-P", "-j", job.job_id, "-o", "State,ExitCode"])
        rows = [line.split("|") for line in out.splitlines() if "|" in line]
        if rc == 0 and rows:
            state = _merge([r[0].split()[0] for r in rows])
            code: int | None = max(int(r[1].split(":")[0]) for r in rows)
            if state in _UNFINISHED and files.get("job_state") not in (None, *_LIVE_FILE_STATES):
                # Gone from squeue, yet accounting says it still runs: slurmdbd records a job's end some seconds
                # after the job has left. The job script's own final state says how it ended.
                return JobStatus(
                    files["job_state"],
                    files.get("last_exit_code"),
                    "accounting has not recorded the end yet",
                    extra={"source": "job files", **files},
                )
            if state == "CANCELLED":
                # SLURM records the batch shell's 0:15; what the workers did (42: checkpointed) is in the job files.
                code = files.get("last_exit_code")
            return JobStatus(state, code, extra={"source": "sacct", **files})
        # No accounting (sacct fails or has no record): the job's own files.
        if files.get("job_state"):
            return JobStatus(files["job_state"], files.get("last_exit_code"), extra={"source": "job files", **files})
        return JobStatus(
            "UNKNOWN",
            None,
            "not in squeue, no accounting record, and no state file yet",
            extra={"source": "none", **files},
        )

    def _files(self, tr, job: JobRecord) -> dict:
        """The job script's own records: what survives without accounting."""
        if job.handle.array:
            return {}
        base = f"{job.run_dir}/{JOBS_DIR}/{job.job_id}"
        info: dict = {}
        state = tr.read(f"{base}/state")
        if state:
            info["job_state"] = state.decode().strip()
        attempts = tr.read(f"{base}/attempts")
        if attempts is not None:
            info["attempts"] = len(attempts.decode().splitlines())
        excluded = tr.read(f"{base}/excluded")
        if excluded:
            info["excluded"] = Excluded.ledger(excluded.decode(errors="replace"))
        codes = tr.read(f"{base}/exit_codes")
        if codes:
            last = codes.decode().splitlines()[-1].split()
            info["last_exit_code"] = int(last[1])
        return info

    def records_dir(self, job: JobRecord) -> str | None:
        """The run this job trains, runs/RUN_ID/ in its submit directory: the job script names it in jobs/ID/run_id
        when the job's first attempt starts (the job id, or the run it was told to resume); None before that (or
        once `up --fresh` set the job's files aside). An array (a run per task) and a job submitted over SSH (its
        files are on the login node, not here): the submit directory."""
        if job.handle.array or job.handle.ssh:
            return job.run_dir
        raw = LocalShell().read(f"{job.run_dir}/{JOBS_DIR}/{job.job_id}/run_id")
        run_id = raw.decode(errors="replace").strip() if raw else ""
        if not RUN_ID.match(run_id):  # a path component, never a way out of runs/
            return None
        return f"{job.run_dir}/{RUNS_DIR}/{run_id}"

    # ---------------------------------------------------------------- logs, wait, cancel

    def log_path(self, job: JobRecord) -> str:
        if job.handle.submitit_folder:  # submitit's log of its one task (stdout and stderr together)
            return f"{job.handle.submitit_folder}/{job.job_id}_0_log.out"
        return f"{job.run_dir}/{job.handle.job_name}-{job.job_id}.out"

    def logs(self, job: JobRecord, *, follow: bool) -> Iterator[str]:
        tr = self._transport(job.handle)
        offset = 0
        try:
            while True:
                data = tr.read(self.log_path(job), offset)
                if data:
                    offset += len(data)
                    yield data.decode(errors="replace")
                if not follow:
                    return
                st = self._status(tr, job).state
                if st in TERMINAL or (st == "UNKNOWN" and data is not None):
                    rest = tr.read(self.log_path(job), offset)
                    if rest:
                        yield rest.decode(errors="replace")
                    return
                time.sleep(self.poll_seconds)
        finally:
            tr.close()

    def wait(self, job: JobRecord, stream=None) -> int:
        """Stream the output until the job ends; return its exit code (1 if unknown)."""
        stream = stream or sys.stdout  # looked up now: the caller may have replaced sys.stdout
        for chunk in self.logs(job, follow=True):
            stream.write(chunk)
            stream.flush()
        st = self.status(job)
        return st.exit_code if isinstance(st.exit_code, int) else (0 if st.state == "COMPLETED" else 1)

    def cancel(self, job: JobRecord) -> str:
        """scancel: SLURM sends SIGTERM first, so the runtime checkpoints; the job script never requeues a cancel."""
        tr = self._transport(job.handle)
        try:
            st = self._status(tr, job)
            if st.state in TERMINAL:
                return f"{job.name} already ended ({st.state}); nothing to cancel"
            rc, out, err = tr.run(["scancel", job.job_id])
        finally:
            tr.close()
        if rc != 0:
            raise BackendError(f"scancel {job.job_id} failed: {err.strip() or out.strip()}")
        return f"cancelled {job.name} (slurm job {job.job_id}); its workers checkpoint on SIGTERM"


# squeue/sacct states of a job that has not ended, the least finished first; and what the job script writes to
# jobs/ID/state before its end
_UNFINISHED = ("RUNNING", "REQUEUED", "PENDING", "CONFIGURING", "COMPLETING", "SUSPENDED")
_LIVE_FILE_STATES = ("STARTING", "RUNNING", "REQUEUED")


def _merge(states: list[str]) -> str:
    """Array jobs have one state per task: report the least finished one."""
    for s in _UNFINISHED:
        if s in states:
            return s
    for s in states:
        if s != "COMPLETED":
            return s
    return states[0]
