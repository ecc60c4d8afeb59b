"""examples/plain-pytorch on simulated SkyPilot VMs (sky_nodes.py: private disks, a non-root user, an image
with torch but not dtlaunch, no package index): the user's script travels in the task's workdir, setup
installs dtlaunch from the shipped wheel, the script checkpoints to the mounted bucket through the library,
and a managed-job recovery on fresh VMs after the first set is lost resumes it with the losses of an
uninterrupted run. Only the cloud (VMs, rsync, the bucket service) is simulated."""

from __future__ import annotations

import json
import time

import pytest

from launcher.jobenv import read_metrics
from launcher.runtime.checkpoint import disk
from launcher.runtime.goodput import ledger
from sky_helpers import ROOT, render_to
from sky_nodes import WORKDIR

pytestmark = pytest.mark.slow
EXAMPLE = ROOT / "examples" / "plain-pytorch" / "recipe.yaml"
TASK_ID = "sky-managed-2026-11-23-09-00-00-000001_plain-pytorch_1-0"
BUCKET_URL = "s3://dtlaunch-sim/example"
STEPS = 30


def overrides() -> list[str]:
    return [
        "resources.nodes=2",
        "resources.accelerator=cpu:1",
        f"training.steps={STEPS}",
        "training.log_every=1",
        "checkpoint.every=10",
        "checkpoint.dir=null",
        f"targets.sky.checkpoint_storage={{bucket: '{BUCKET_URL}'}}",
        "targets.sky.managed=true",
        "training.init_timeout_seconds=60",
        "training.timeout_seconds=60",
    ]


def losses(nodes, task_id: str = TASK_ID) -> dict[int, float]:
    out = {}
    for rank in range(nodes.nodes):
        p = nodes.node_path(rank, f"{WORKDIR}/runs/{task_id}/metrics.jsonl")
        if p.exists():
            out.update({r["step"]: r["loss"] for r in map(json.loads, p.read_text().splitlines()) if "loss" in r})
    return out


def setup_ok(nodes) -> None:
    for r in nodes.setup():
        assert r.returncode == 0, r.stdout[-3000:]


def test_user_script_recovers_on_fresh_vms_with_nothing_lost(tmp_path, sky_nodes):
    _, _, out = render_to(tmp_path, EXAMPLE, overrides())
    assert (out / "code" / "train.py").is_file()
    ref = sky_nodes(out, nodes=2, task_id="reference-run")
    ref.provision()
    setup_ok(ref)
    rcs = ref.wait(ref.start(), timeout=240)
    assert rcs == [0, 0], ref.log(0)[-3000:] + ref.log(1)[-3000:]
    reference = losses(ref, "reference-run")
    assert sorted(reference) == list(range(1, STEPS + 1)), ref.log(0)[-2000:]
    ref.destroy()

    bucket = ref.bucket(BUCKET_URL) / TASK_ID
    first = sky_nodes(out, nodes=2, task_id=TASK_ID)
    first.provision()
    setup_ok(first)
    procs = first.start()
    deadline = time.time() + 180
    while not disk.complete_steps(bucket) and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    saved = disk.complete_steps(bucket)
    assert saved and saved[-1] < STEPS, first.log(0)[-3000:]
    first.destroy()  # the VMs are gone: processes and disks; the bucket stays
    destroyed = time.time()
    resume_from = disk.complete_steps(bucket)[-1]

    fresh = sky_nodes(out, nodes=2, task_id=TASK_ID)
    fresh.provision()
    setup_ok(fresh)
    rcs = fresh.wait(fresh.start(), timeout=240)
    assert rcs == [0, 0], fresh.log(0)[-3000:] + fresh.log(1)[-3000:]
    assert f"resumed from step {resume_from}" in fresh.log(0) + fresh.log(1)
    got = losses(fresh)
    # the new VMs' disks start from the records kept in the bucket with the checkpoints: the whole run's steps
    assert sorted(got) == list(range(1, STEPS + 1))
    assert (bucket / "metrics.jsonl").read_text().count('"event": "start"') == 2  # both launches, on the bucket
    # each launch's allocation began with its VMs' setup (SkyPilot bills them from then), the second after the
    # first set was gone; the lost VMs' end went unrecorded, so the time between counts as allocated (recovery)
    starts = [r for r in read_metrics(bucket) if r.get("event") == "start"]
    assert starts[0]["allocation_start"] < starts[0]["time"] < destroyed < starts[1]["allocation_start"]
    assert starts[1]["allocation_start"] < starts[1]["time"]
    led = ledger(read_metrics(bucket))
    assert (
        led["queue"] == 0
        and led["allocated"] == led["elapsed"] == read_metrics(bucket)[-1]["time"] - starts[0]["allocation_start"]
    )
    for step, loss in got.items():
        assert loss == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step
    assert disk.complete_steps(bucket)[-1] == STEPS
