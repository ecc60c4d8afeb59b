"""The local target's whole lifecycle through the CLI, with real torchrun runs: up, status, logs, down, plot;
each `up` keeps its own log and exit code; a resumed longer run uses its own schedule's rate; one job per run
directory; a killed launcher takes its workers down (they checkpoint); `down` never signals a process that
is not the job's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher.runtime import ckptdir
from launcher.targets.local import job_processes
from launcher.targets.registry import JobRecord, LocalHandle, Registry
from testpaths import RECIPES

pytestmark = pytest.mark.slow
TINY = RECIPES / "tiny.yaml"


def status_rows(run_cli) -> list[dict]:
    code, out, _ = run_cli("status", "--json")
    assert code == 0
    return json.loads(out)


def wait_for(pred, timeout, what):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_up_status_logs_plot_and_history_per_attempt(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=6")
    assert code == 0, err
    assert "done: 6 steps" in out and "tiny: COMPLETED (exit code 0)" in out
    # A longer run in the same directory resumes; `up` streams only the new attempt's log.
    code, out, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=8")
    assert code == 0, err
    assert "resumed from step 6" in out and "done: 6 steps" not in out and "done: 8 steps" in out
    assert "resuming with a change" not in out  # only the length changed: the same run, continued
    step7 = next(m for m in metrics(run_dir) if m.get("step") == 7 and "loss" in m)
    # tiny: lr 3e-3, warmup 4, cosine over 8 steps: step 7 trains at progress (6-4)/(8-4) = 0.5, factor 0.5.
    assert step7["lr"] == pytest.approx(1.5e-3, rel=1e-6), "the resumed step must use this run's schedule"
    # A third attempt that fails keeps the earlier ones' history intact.
    code, out, err = run_cli(
        "up",
        TINY,
        "-o",
        run_dir,
        "--set",
        "training.steps=10",
        "--set",
        "targets.local.max_restarts=0",
        "--set",
        "env.DTLAUNCH_FAULT=exit:rank=1:step=9:code=3",
    )
    assert code == 1, out + err
    assert [(r["state"], r["exit_code"]) for r in status_rows(run_cli)] == [
        ("COMPLETED", 0),
        ("COMPLETED", 0),
        ("FAILED", 1),
    ]
    code, out, _ = run_cli("logs", status_rows(run_cli)[0]["job_id"])
    assert code == 0 and "done: 6 steps" in out and "done: 8 steps" not in out
    code, out, err = run_cli("plot", run_dir)
    assert code == 0, err
    assert (run_dir / "loss.png").stat().st_size > 10_000


def test_one_job_per_run_directory_and_down_checkpoints(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=2000", "--detach")
    assert code == 0, err
    wait_for(lambda: any(m.get("step", 0) >= 3 for m in metrics(run_dir)), 120, "step 3")
    code, out, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=2000", "--detach")
    assert code == 3 and "is in use by job tiny" in err and "dtlaunch down" in err
    code, out, err = run_cli("down", "tiny")
    assert code == 0 and "stopped tiny" in out, out + err
    (row,) = status_rows(run_cli)
    assert (row["state"], row["exit_code"]) == ("PREEMPTED", 42)
    pre = [m for m in metrics(run_dir) if m.get("event") == "preempt"]
    assert pre and pre[0]["step"] in ckptdir.complete_steps(run_dir / "checkpoints")
    code, out, _ = run_cli("down", "tiny")
    assert code == 0 and "already finished" in out


def test_a_killed_launcher_takes_its_workers_down(run_cli, tmp_path):
    """kill -9 of the launch script's process group: torchrun (its own session) and the workers (theirs)
    are not in it, yet nothing trains on unseen: torchrun dies with its parent's death signal, the workers
    with theirs, and they checkpoint on the way out."""
    run_dir = tmp_path / "run"
    code, _, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=2000", "--detach")
    assert code == 0, err
    wait_for(lambda: any(m.get("step", 0) >= 3 for m in metrics(run_dir)), 120, "step 3")
    rec = Registry().find("tiny")
    assert len(job_processes(rec.handle.attempt)) >= 4  # launch.sh, torchrun, two workers
    os.killpg(rec.handle.pid, signal.SIGKILL)
    wait_for(lambda: not job_processes(rec.handle.attempt), 90, "every process of the job to end")
    assert any(m.get("event") == "preempt" for m in metrics(run_dir))
    (row,) = status_rows(run_cli)
    assert row["state"] == "LOST"
    code, out, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=12")
    assert code == 0 and "resumed from step" in out, out + err


def test_down_never_signals_a_process_that_is_not_the_job(run_cli, tmp_path):
    """A recorded pid now held by another process (pid reuse): its start time differs, and it does not carry
    the job's DTLAUNCH_ATTEMPT, so `down` leaves it alone."""
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        handle = LocalHandle(
            other.pid,
            time.time() - 3600,
            "up-gone-attempt",
            str(tmp_path / "log"),
            str(tmp_path / "status" / "exit_code"),
        )
        Registry().add(JobRecord("ghost", "local", str(other.pid), str(tmp_path), handle))
        code, out, _ = run_cli("down", "ghost")
        assert code == 0 and "not running" in out
        time.sleep(0.5)
        assert other.poll() is None, "an unrelated process was signalled"
        (row,) = status_rows(run_cli)
        assert row["state"] == "LOST"
    finally:
        other.kill()
        other.wait()
