"""SkyBackend's submit/status/logs/cancel through its SDK seam.

A cloud account cannot exist here, so `FakeSdk` stands in for the part of SkyPilot that talks to one (the
API server and the clouds behind it); it records calls and keeps jobs in memory. What can run here runs for
real: the task file is parsed by SkyPilot's own `Task.from_yaml_config` through the backend's real `_Sdk.task`,
and no API server is started just to check an error string.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.errors import BackendError
from launcher.targets import JobStatus
from launcher.targets.sky.backend import SkyBackend, _Sdk
from launcher.targets.sky.request import SkyHandle
from sky_helpers import RECIPES, render_to

TINY = next(p for p in RECIPES if p.name == "tiny.yaml")
BUCKET = "targets.sky.checkpoint_storage={bucket: 's3://b/ckpt'}"


class FakeSdk:
    """Stands in for SkyPilot's client/server SDK (the cloud side); parses tasks with the real library."""

    def __init__(self, clouds=("aws",)):
        self.clouds = list(clouds)
        self.calls: list[tuple] = []
        self.jobs: dict[int, str] = {}

    def enabled_clouds(self):
        return self.clouds

    def task(self, task_yaml, secrets):
        self.calls.append(("task", task_yaml.name, dict(secrets)))
        real = _Sdk.__new__(_Sdk)  # the real parsing, without the server connection __init__ does not make
        import sky

        real.sky = sky
        return real.task(task_yaml, secrets)

    def launch(self, task, name, managed):
        job_id = len(self.jobs) + 1
        self.jobs[job_id] = "RUNNING"
        self.calls.append(("launch", name, managed, task.num_nodes))
        return str(job_id)

    def status(self, name, job_id, managed):
        return JobStatus(self.jobs.get(job_id, "UNKNOWN"))

    def logs(self, name, job_id, managed, follow):
        yield f"log of {name}/{job_id}\n"

    def cancel(self, name, job_id, managed):
        self.jobs[job_id] = "CANCELLED"
        self.calls.append(("cancel", name, job_id, managed))


def test_submit_status_logs_cancel_through_the_sdk_seam(tmp_path, monkeypatch, sky_lib):
    monkeypatch.setenv("HF_TOKEN", "hf_value")
    rec, art, out = render_to(
        tmp_path, TINY, ["resources.nodes=2", BUCKET, "targets.sky.managed=true", "secrets=[HF_TOKEN]"]
    )
    sdk = FakeSdk()
    be = SkyBackend(sdk=sdk)
    job = be.submit(art, str(out))
    assert job.handle == SkyHandle(rec.job_name, True, 1) and job.run_dir == str(out.resolve())
    assert ("task", "task.yaml", {"HF_TOKEN": "hf_value"}) in sdk.calls  # the value goes to SkyPilot, not a file
    assert ("launch", rec.job_name, True, 2) in sdk.calls
    assert be.status(job).state == "RUNNING"
    assert list(be.logs(job, follow=False)) == [f"log of {rec.job_name}/1\n"]
    assert "cancelled" in be.cancel(job) and be.status(job).state == "CANCELLED"
    with pytest.raises(BackendError, match="dtlaunch logs -f"):  # sky runs the job; `up --wait` says how to follow
        be.wait(job)


def test_no_cloud_is_a_clear_error_naming_sky_check(tmp_path):
    _, art, out = render_to(tmp_path, TINY, [])
    with pytest.raises(BackendError) as ei:
        SkyBackend(sdk=FakeSdk(clouds=())).submit(art, str(out))
    assert "sky check" in str(ei.value) and ei.value.exit_code == 3


def test_sdk_failures_become_backend_errors(tmp_path):
    class Broken(FakeSdk):
        def launch(self, task, name, managed):
            raise RuntimeError("quota exceeded in us-east-1\nmore lines")

    _, art, out = render_to(tmp_path, TINY, [])
    with pytest.raises(BackendError) as ei:
        SkyBackend(sdk=Broken()).submit(art, str(out))
    assert "could not launch the task: RuntimeError: quota exceeded in us-east-1" in str(ei.value)
    assert "more lines" not in str(ei.value)


def test_missing_secret_is_named_before_skypilot_is_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("DTLAUNCH_TEST_TOKEN", raising=False)
    _, art, out = render_to(tmp_path, TINY, ["secrets=[DTLAUNCH_TEST_TOKEN]"])
    sdk = FakeSdk()
    with pytest.raises(BackendError, match="DTLAUNCH_TEST_TOKEN not set"):
        SkyBackend(sdk=sdk).submit(art, str(out))
    assert sdk.calls == []


def test_cli_path_never_imports_sky():
    """Importing the backend and rendering must not pull in SkyPilot (~2 s, ~160 MB)."""
    code = "import sys; import launcher.cli, launcher.targets.sky.backend, launcher.targets.sky.render; print('sky' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )
