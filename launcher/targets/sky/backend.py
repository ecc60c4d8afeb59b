"""SkyPilot target: hand the rendered task.yaml to SkyPilot, then follow the cluster job or managed job.

SkyPilot's Python SDK changed its arguments between releases (users pinned old versions), so every SDK
call lives in `_Sdk` below and nothing else here knows SkyPilot's signatures. `sky` is imported only
inside methods: importing it costs ~2 s and ~160 MB, and the CLI imports this module for every target.
Any SkyPilot failure becomes a BackendError with SkyPilot's own reason and what to do, never a traceback.

SkyPilot 0.14's SDK starts a local API server on its first call when none answers, and leaves it running.
`_ServerGuard` does that start itself instead: it says so on stderr first, and stops the server again when the
dtlaunch command ends, but only one this process started (never one that was already running, or one another
process won the race to start).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ...errors import BackendError
from .. import JobStatus, require_secrets
from ..registry import JobRecord
from .request import SkyHandle, SkyRequest

if TYPE_CHECKING:
    from ...render.artifacts import Artifacts

CHECK_HINT = "run `sky check` to see which clouds SkyPilot can use and how to add credentials"


@contextlib.contextmanager
def _cwd(path: Path):
    """contextlib.chdir exists only from Python 3.11; dtlaunch supports 3.10."""
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextlib.contextmanager
def _sky_errors(action: str):
    """Turn whatever SkyPilot raises (it has many exception types, and they move) into one BackendError."""
    try:
        yield
    except BackendError:
        raise
    except ImportError as e:
        raise BackendError(f"SkyPilot is not installed ({e}); pip install 'dtlaunch[sky]'") from None
    except Exception as e:  # noqa: BLE001 - SkyPilot raises anything from ValueError to its own errors
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BackendError(f"SkyPilot could not {action}: {type(e).__name__}: {reason}", fix=CHECK_HINT) from None


def _field(record: Any, key: str) -> Any:
    """A field of a job queue's record: a dict or an object, depending on SkyPilot's version."""
    return record.get(key) if isinstance(record, dict) else getattr(record, key, None)


STARTING = (
    "dtlaunch: no SkyPilot API server is running; starting a local one for this command "
    "(dtlaunch stops it when the command ends)"
)


class _ApiServer:
    """SkyPilot's local API server, probed, started and stopped with SkyPilot 0.14's own functions."""

    def __init__(self):
        from sky.client import sdk
        from sky.server import common

        self.sdk, self.common = sdk, common

    def would_start(self) -> bool:
        """What the SDK's first call decides (check_server_healthy_or_start): the endpoint is local and no
        healthy server answers there. A remote endpoint, or a server that answers at all (even one asking for
        a login or of another version), is left to the SDK's own handling."""
        c = self.common
        return bool(c.is_api_server_local()) and c.get_api_server_status().status == c.ApiServerStatus.UNHEALTHY

    def check_allowed(self) -> None:
        """SkyPilot's own error when SKYPILOT_DISABLE_LOCAL_API_SERVER=1 forbids starting one here (a check the
        oldest SkyPilot dtlaunch supports, 0.11.2, does not have)."""
        check = getattr(self.common, "check_local_api_server_enabled_or_raise", None)
        if check is not None:
            check()

    def start(self) -> bool:
        """Start it the way the SDK would (under SkyPilot's creation lock); True when this process started it.
        A server this process spawned is its child; when another process won the race to start one, there is
        none, and that server is not ours to stop."""
        import psutil  # a SkyPilot dependency

        self.common.check_server_healthy_or_start_fn()
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.Error):  # a child that exited meanwhile
                if self.common.API_SERVER_CMD in " ".join(child.cmdline()):
                    return True
        return False

    def runs_job_controllers(self) -> bool:
        """In jobs-controller consolidation mode the managed jobs' controllers run inside this server, and
        `sky api stop` kills them with it: a server that does is never stopped."""
        from sky.jobs import utils as jobs_utils

        return bool(jobs_utils.is_consolidation_mode())

    def stop(self) -> None:
        from sky import sky_logging

        with sky_logging.silent():  # its "API server stopped" would land on stdout
            self.sdk.api_stop()


class _ServerGuard:
    """Starts SkyPilot's local API server where the SDK's first call would, saying so on stderr first, and
    stops it when the process ends (atexit) if, and only if, this process started it. The record that it did
    lives in this object, for this process only: no file another command could read."""

    def __init__(self, server):
        self.server = server
        self.started = False

    def open(self) -> None:
        if not self.server.would_start():
            return
        self.server.check_allowed()
        print(STARTING, file=sys.stderr, flush=True)
        self.started = self.server.start()
        if self.started:
            atexit.register(self.close)

    def close(self) -> None:
        """Stop the server this process started (once); never raises: the command's own outcome stands."""
        if not self.started:
            return
        self.started = False
        atexit.unregister(self.close)
        try:
            if self.server.runs_job_controllers():
                print(
                    "dtlaunch: left SkyPilot's API server running: the managed jobs' controllers run in it "
                    "(jobs consolidation mode); `sky api stop` stops it",
                    file=sys.stderr,
                    flush=True,
                )
                return
            self.server.stop()
        except Exception as e:  # noqa: BLE001 - at exit, a failed stop is a note, not a traceback
            print(
                f"dtlaunch: could not stop the SkyPilot API server it started ({type(e).__name__}: {e}); "
                "`sky api stop` stops it",
                file=sys.stderr,
                flush=True,
            )


class _Sdk:
    """The only place that calls SkyPilot's SDK (written against skypilot 0.14's client/server SDK)."""

    def __init__(self, server=None):
        import sky  # noqa: F401 - heavy; only when a sky job is actually submitted or followed
        from sky.client import sdk

        self.sky, self.sdk = sky, sdk
        # Before the first SDK call, which would start a local API server silently and leave it running.
        self.server = _ServerGuard(server if server is not None else _ApiServer())
        self.server.open()

    def close(self) -> None:
        """Stop the local API server if this process started it (atexit does it otherwise)."""
        self.server.close()

    def enabled_clouds(self) -> list[str]:
        return [str(c) for c in self.sdk.get(self.sdk.enabled_clouds())]

    def task(self, task_yaml: Path, secrets: dict[str, str]):
        config = yaml.safe_load(task_yaml.read_text())
        with _cwd(task_yaml.parent):  # workdir '.' and file_mounts are relative to the rendered dir
            task = self.sky.Task.from_yaml_config(config, secrets_overrides=list(secrets.items()) or None)
            task.expand_and_validate_workdir()
        return task

    def launch(self, task, name: str, managed: bool) -> str:
        if managed:
            job_ids, _ = self.sdk.stream_and_get(self.sky.jobs.launch(task, name=name))
            return str(job_ids[0] if isinstance(job_ids, (list, tuple)) else job_ids)
        job_id, _ = self.sdk.stream_and_get(self.sdk.launch(task, cluster_name=name))
        return str(job_id)

    def status(self, name: str, job_id: int, managed: bool) -> JobStatus:
        if managed:
            recs = self.sdk.get(self.sky.jobs.queue(refresh=False, job_ids=[job_id]))
            recs = recs[0] if isinstance(recs, tuple) else recs
        else:
            recs = self.sdk.get(self.sdk.queue(name))
        for r in recs:
            if int(_field(r, "job_id")) == job_id:
                st = _field(r, "status")
                return JobStatus(getattr(st, "value", str(st)))
        return JobStatus("UNKNOWN", detail=f"job {job_id} not found on {name}")

    def logs(self, name: str, job_id: int, managed: bool, follow: bool) -> Iterator[str]:
        if managed:
            self.sky.jobs.tail_logs(name=None, job_id=job_id, follow=follow)  # streams to stdout itself
            return iter(())
        return (line for line in self.sdk.tail_logs(name, job_id, follow, preload_content=False) if line)

    def cancel(self, name: str, job_id: int, managed: bool) -> None:
        if managed:
            self.sdk.get(self.sky.jobs.cancel(job_ids=[job_id]))
        else:
            self.sdk.get(self.sdk.cancel(name, job_ids=[job_id]))


class SkyBackend:
    name = "sky"

    def __init__(self, sdk: _Sdk | None = None):
        self._sdk = sdk

    def _api(self) -> _Sdk:
        if self._sdk is None:
            with _sky_errors("start"):
                self._sdk = _Sdk()
        return self._sdk

    def submit(self, artifacts: Artifacts, out_dir: str) -> JobRecord:
        req = artifacts.request
        assert isinstance(req, SkyRequest)
        secrets = require_secrets(req.secrets, "dtlaunch passes secrets by name, SkyPilot reads the values here")
        api = self._api()
        with _sky_errors("check credentials"):
            clouds = api.enabled_clouds()
        if not clouds:
            raise BackendError(
                "SkyPilot has no cloud or Kubernetes enabled: it found no usable credentials", fix=CHECK_HINT
            )
        with _sky_errors("read the task"):
            task = api.task(Path(out_dir) / req.task_file, secrets)
        with _sky_errors("launch the task"):
            job_id = api.launch(task, req.cluster, req.managed)
        return JobRecord(
            artifacts.job_name,
            "sky",
            job_id,
            str(Path(out_dir).resolve()),
            SkyHandle(req.cluster, req.managed, int(job_id)),
        )

    def wait(self, job: JobRecord) -> int:
        raise BackendError(
            "`up -t sky` does not wait for the job: SkyPilot runs it (and recovers it) on its own",
            fix=f"follow it with `dtlaunch logs -f {job.name}`, `dtlaunch status {job.name}`",
        )

    def status(self, job: JobRecord) -> JobStatus:
        h = job.handle
        with _sky_errors("get the job's status"):
            return self._api().status(h.cluster, h.job_id, h.managed)

    def records_dir(self, job: JobRecord) -> str:
        return job.run_dir  # the records are on the nodes and in the bucket; here only what `up` wrote

    def logs(self, job: JobRecord, *, follow: bool) -> Iterator[str]:
        h = job.handle
        with _sky_errors("fetch logs"):
            yield from self._api().logs(h.cluster, h.job_id, h.managed, follow)

    def cancel(self, job: JobRecord) -> str:
        h = job.handle
        with _sky_errors("cancel the job"):
            self._api().cancel(h.cluster, h.job_id, h.managed)
        return f"cancelled {job.name} (sky {'managed job' if h.managed else 'job'} {h.job_id})"
