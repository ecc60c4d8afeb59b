"""The rendered SkyPilot task trains for real: 2 "nodes" on this machine, gloo, the tiny recipe.

The harness (sky_harness.py) plays SkyPilot: each node runs `setup` then `run` with bash in the
workdir and SkyPilot's per-node variables. The cloud (VMs, rsync, ssh) and `pip` (network) are the only
stand-ins; torchrun, c10d rendezvous, the training runtime and its checkpoints are real.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time

import pytest

from launcher.jobenv import ExitCode
from launcher.runtime import ckptdir

from sky_harness import Cluster, free_port
from sky_helpers import RECIPES, render_to

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("launcher.train") is None, reason="launcher/train.py not written yet"),
]
TINY = next(p for p in RECIPES if p.name == "tiny.yaml")
TASK_ID = "sky-managed-2026-11-21-10-00-00-123456_tiny_3-0"
STEPS = 20


def _overrides(tmp_path, steps=STEPS):
    # cpu:1 per node: 2 ranks in all on this 2-core machine (more ranks than cores made DDP 8x slower).
    return ["resources.nodes=2", "resources.accelerator=cpu:1", f"training.steps={steps}", "checkpoint.every=5",
            f"checkpoint.dir={tmp_path}/ckpt/{{run_id}}", "training.init_timeout_seconds=20",
            "training.timeout_seconds=20", "training.preflight=false"]


def _start(c: Cluster):
    return c.start({"DTLAUNCH_PORT": str(free_port())})


def test_two_nodes_train_to_completion(tmp_path, record_property):
    _, _, out = render_to(tmp_path, TINY, _overrides(tmp_path))
    c = Cluster(out, task_id=TASK_ID)
    assert all(r.returncode == 0 for r in c.setup())
    t0 = time.time()
    rcs = c.wait(_start(c), timeout=240)
    record_property("train_seconds", round(time.time() - t0, 1))
    assert rcs == [0, 0], c.log(0)[-3000:] + c.log(1)[-3000:]
    # {run_id} expanded to SkyPilot's task id: the directory a recovered managed job will find again.
    assert ckptdir.latest_complete(tmp_path / "ckpt" / TASK_ID) == STEPS


def test_killed_node_then_recovery_resumes_from_checkpoint(tmp_path, record_property):
    """A node dies (SIGKILL of its whole process tree, like a lost VM). torchrun on the survivor, with c10d
    and a fixed --nnodes=2, cannot re-form the world and exits non-zero (after join_timeout at most); the
    job has failed. SkyPilot's managed-job recovery relaunches every node with the same SKYPILOT_TASK_ID,
    so DTLAUNCH_RUN_ID and the checkpoint directory are the same, and training resumes."""
    steps = 40
    _, _, out = render_to(tmp_path, TINY, _overrides(tmp_path, steps))
    ckpt = tmp_path / "ckpt" / TASK_ID
    c = Cluster(out, task_id=TASK_ID)
    procs = _start(c)
    deadline = time.time() + 180
    while (ckptdir.latest_complete(ckpt) or 0) < 5 and time.time() < deadline and procs[0].poll() is None:
        time.sleep(0.2)
    saved = ckptdir.latest_complete(ckpt)
    assert saved and saved < steps, c.log(0)[-3000:]
    t_kill = time.time()
    c.kill([procs[1]])
    try:
        survivor_rc = procs[0].wait(timeout=90)
    finally:
        c.kill(procs)
    record_property("survivor_exit_seconds", round(time.time() - t_kill, 1))
    assert survivor_rc != 0, "the survivor must not report success for a job that lost a node"

    resume_from = ckptdir.latest_complete(ckpt)
    record_property("resume_step", resume_from)
    t0 = time.time()
    rcs = c.wait(_start(c), timeout=240)  # the managed-job recovery: same task id, fresh processes
    record_property("recovery_train_seconds", round(time.time() - t0, 1))
    assert rcs == [0, 0], c.log(0)[-3000:]
    assert ckptdir.latest_complete(ckpt) == steps
    events = [json.loads(line) for line in (c.workdir / "runs" / TASK_ID / "metrics.jsonl").read_text().splitlines()]
    resumes = [e for e in events if e.get("event") == "resume"]
    assert [e["step"] for e in resumes] == [resume_from], "the recovered job must resume, not start over"
    # c10d assigns ranks at rendezvous: after recovery rank 0 (which prints) may live on either node.
    out2 = c.log(0) + c.log(1)
    assert f"resumed from step {resume_from}" in out2 and f"step {resume_from + 1}/{steps}" in out2


def test_deepspeed_launcher_without_ssh_trains(tmp_path, record_property):
    """`parallelism.launcher: deepspeed` on the harness via the ssh-less path: every node runs
    `deepspeed --no_ssh --node_rank $SKYPILOT_NODE_RANK` against the same hostfile (the head-only
    variant needs SkyPilot's passwordless ssh between VMs, which only a cloud cluster has).
    The two "nodes" get distinct loopback addresses: DeepSpeed rejects a hostfile listing one host twice."""
    import deepspeed  # noqa: F401 - part of the test environment
    ov = _overrides(tmp_path, steps=10) + ["parallelism.strategy=zero2", "parallelism.launcher=deepspeed"]
    _, art, out = render_to(tmp_path, TINY, ov)
    c = Cluster(out, task_id=TASK_ID, ips=("127.0.0.1", "127.0.0.2"))
    assert all(r.returncode == 0 for r in c.setup())
    assert "install deepspeed>=0.15" in (c.root / "pip.log").read_text()
    sudo_log = c.root / "sudo.log"  # pdsh (for the head-only launch) is installed only where it is missing
    assert shutil.which("pdsh") or "apt-get install -y -q pdsh" in sudo_log.read_text()
    # DeepSpeed JIT-builds a comm op on first use (~30-100 s); keep it in the real cache, not the fake $HOME.
    cache = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions"))}
    t0 = time.time()
    rcs = c.wait(c.start({"DTLAUNCH_PORT": str(free_port()), "DTLAUNCH_DEEPSPEED_NO_SSH": "1", **cache}), timeout=300)
    record_property("deepspeed_train_seconds", round(time.time() - t0, 1))
    assert rcs == [0, 0], c.log(0)[-3000:] + c.log(1)[-3000:]
    assert "nnodes=2, num_local_procs=1, node_rank=1" in c.log(1)  # node 1 ran its own worker, no ssh
    assert ckptdir.latest_complete(tmp_path / "ckpt" / TASK_ID) == 10


def test_preempted_code_survives_torchrun_for_recover_on_exit_codes(tmp_path):
    """torchrun itself exits 1 for any failed worker; the rendered `run` must still end with the runtime's
    PREEMPTED (42), or SkyPilot's `recover_on_exit_codes: [42, 43]` could never match."""
    ov = _overrides(tmp_path, steps=40)
    ov = [o for o in ov if not o.startswith("resources.nodes")] + ["resources.nodes=1", "targets.sky.max_restarts=0"]
    _, _, out = render_to(tmp_path, TINY, ov)
    c = Cluster(out, nodes=1, task_id=TASK_ID)
    rcs = c.wait(c.start({"DTLAUNCH_PORT": str(free_port()), "DTLAUNCH_FAULT": "signal:rank=0:step=3:sig=USR2"}), timeout=120)
    assert rcs == [ExitCode.PREEMPTED], c.log(0)[-3000:]
    assert "ChildFailedError" in c.log(0)  # torchrun failed (its own exit status is 1) ...
    status = json.loads((c.workdir / "runs" / TASK_ID / "status" / "rank-00000.json").read_text())
    assert status["code"] == ExitCode.PREEMPTED  # ... and the run script took the rank's code instead
