"""Local target: run the rendered launch.sh (torchrun) on this machine, detached, logging to a file."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from .. import exitcodes
from ..render.artifacts import Artifacts
from .registry import JobRecord

STATES = {exitcodes.OK: "COMPLETED", exitcodes.PREEMPTED: "PREEMPTED", exitcodes.HANG: "FAILED (hang)",
          exitcodes.PREFLIGHT: "FAILED (preflight)", exitcodes.CONFIG: "FAILED (config)"}


class LocalBackend:
    name = "local"

    def __init__(self, cwd: str | None = None):
        self.cwd = cwd or os.getcwd()

    def submit(self, artifacts: Artifacts, out_dir: str, *, wait: bool) -> JobRecord:
        run_dir = Path(out_dir).resolve()
        (run_dir / "exit_code").unlink(missing_ok=True)
        log = open(run_dir / "train.log", "ab")
        proc = subprocess.Popen(["bash", str(run_dir / artifacts.entrypoint)], cwd=self.cwd, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        rec = JobRecord(artifacts.job_name, "local", str(proc.pid), str(run_dir), {"pid": proc.pid, "pgid": proc.pid})
        self._proc = proc
        return rec

    def wait(self, job: JobRecord, stream=sys.stdout) -> int:
        """Stream the log until the job ends; Ctrl-C asks the job to checkpoint and stop (SIGTERM)."""
        proc = getattr(self, "_proc", None)
        try:
            for line in self.logs(job, follow=True):
                stream.write(line)
                stream.flush()
        except KeyboardInterrupt:
            self.cancel(job)
        if proc is not None:
            return proc.wait()
        return self._exit_code(job) if self._exit_code(job) is not None else exitcodes.FAILED

    @staticmethod
    def _exit_code(job: JobRecord) -> int | None:
        p = Path(job.run_dir) / "exit_code"
        try:
            return int(p.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a zombie child of ours counts as gone
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ", 1)[1][0] != "Z"
        except OSError:
            return True

    def status(self, job: JobRecord) -> dict:
        rc = self._exit_code(job)
        if rc is not None:
            return {"state": STATES.get(rc, "FAILED"), "exit_code": rc}
        if self._alive(job.handle["pid"]):
            return {"state": "RUNNING", "exit_code": None}
        return {"state": "LOST", "exit_code": None, "detail": "the launcher process is gone without an exit code"}

    def logs(self, job: JobRecord, *, follow: bool) -> Iterator[str]:
        path = Path(job.run_dir) / "train.log"
        while follow and not path.exists() and self.status(job)["state"] == "RUNNING":
            time.sleep(0.1)
        if not path.exists():
            return
        with open(path, errors="replace") as f:
            while True:
                line = f.readline()
                if line:
                    yield line
                    continue
                if not follow or self.status(job)["state"] != "RUNNING":
                    rest = f.read()
                    if rest:
                        yield rest
                    return
                time.sleep(0.2)

    def cancel(self, job: JobRecord, grace: float = 30.0) -> None:
        pgid = job.handle.get("pgid", job.handle["pid"])
        try:
            os.killpg(pgid, signal.SIGTERM)  # the runtime checkpoints on SIGTERM, then exits
        except ProcessLookupError:
            return
        deadline = time.time() + grace
        while time.time() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
