"""The local target's whole lifecycle through the CLI, with real torchrun runs: up, status, logs, down, plot;
each `up` keeps its own log and exit code; a resumed longer run uses its own schedule's rate; one job per run
directory; a killed launcher takes its workers down (they checkpoint); `down` never signals a process that
is not the job's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.runtime.checkpoint import disk
from launcher.targets.local.backend import job_processes
from launcher.targets.local.request import LocalHandle
from launcher.targets.registry import JobRecord, Registry
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
    # each step line shows progress, the attempt's elapsed time and an ETA at the current rate
    assert re.search(r"step 3/6 \(50%\) \| .* \| elapsed \d+s \| eta \d+s", out), out
    assert re.search(r"step 6/6 \(100%\) \| .* \| eta 0s", out), out
    assert [m["eta_s"] for m in metrics(run_dir) if m.get("step") == 6 and "loss" in m] == [0]
    # The same run again: it is complete, so nothing is submitted (it used to "resume", train 0 steps, COMPLETED).
    logs_before = sorted((run_dir / "logs").iterdir())
    code, out, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=6")
    assert code == 0, err
    assert "this run is complete (its newest checkpoint is step 6, the recipe trains 6 steps)" in out
    assert "nothing submitted" in out and "submitted tiny" not in out
    # its hints are this command again (its -o and --set), not the recipe's default run directory
    assert f"dtlaunch up {TINY} -o {run_dir} --set training.steps=6 --fresh\n" in out, out
    assert f"e.g. dtlaunch up {TINY} -o {run_dir} --set training.steps=12\n" in out, out
    assert sorted((run_dir / "logs").iterdir()) == logs_before and len(status_rows(run_cli)) == 1
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
    rows = status_rows(run_cli)
    assert [(r["state"], r["exit_code"]) for r in rows] == [("COMPLETED", 0), ("COMPLETED", 0), ("FAILED", 1)]
    # each job's progress is its own steps, though all three wrote to the same metrics.jsonl
    assert [r["last_step"]["step"] for r in rows[:2]] == [6, 8], rows
    assert [r["total_steps"] for r in rows] == [6, 8, 10], rows  # each its own length, not the newest plan's
    code, out, _ = run_cli("logs", status_rows(run_cli)[0]["job_id"])
    assert code == 0 and "done: 6 steps" in out and "done: 8 steps" not in out
    # every rank's lines carry its node and rank, here as on a cluster: one rank's are picked out
    failed = status_rows(run_cli)[2]["job_id"]
    code, out, _ = run_cli("logs", failed, "--rank", "1")
    assert code == 0 and "FAULT INJECTION rank 1: exit at step 9" in out and "resumed from" not in out, out
    code, out, _ = run_cli("logs", failed, "--rank", "0")
    assert code == 0 and "resumed from step 8" in out and "FAULT INJECTION" not in out, out
    assert list(run_dir.glob("logs/attempt-*/*/**/1/stderr.log")), "each rank's own log file"
    code, out, err = run_cli("plot", run_dir)
    assert code == 0, err
    assert (run_dir / "loss.png").stat().st_size > 10_000
    # --fresh starts over from step 0 and keeps everything of the previous run, set aside
    code, out, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=4", "--fresh")
    assert code == 0, err
    assert "resumed" not in out and "done: 4 steps" in out, out
    (aside,) = (run_dir / "previous").iterdir()
    assert disk.complete_steps(aside / "checkpoints")[-1] == 8  # the failed third attempt's last save
    assert {"checkpoints", "metrics.jsonl", "logs", "loss.png"} <= {p.name for p in aside.iterdir()}
    assert disk.complete_steps(run_dir / "checkpoints")[-1] == 4
    assert [m["step"] for m in metrics(run_dir) if "loss" in m][0] == 1


def test_one_job_per_run_directory_and_down_checkpoints(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=2000", "--detach")
    assert code == 0, err
    wait_for(lambda: any(m.get("step", 0) >= 3 for m in metrics(run_dir)), 120, "step 3")
    code, out, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=2000", "--detach")
    assert code == 3 and "is in use by job tiny" in err and "dtlaunch down" in err
    # the table: a header, the running job with its progress against the plan's 2,000 steps and an ETA
    code, out, _ = run_cli("status")
    header, row = out.splitlines()[:2]
    assert header.split() == [
        "name",
        "target",
        "state",
        "step",
        "loss",
        "tok/s",
        "MFU",
        "ETA",
        "age",
        "duration",
        "where",
    ]
    assert row.split()[0] == "tiny" and "RUNNING" in row and re.search(r" [\d,]+/2,000 ", row), out
    assert re.search(r" \d+(s|m|h\d\dm) ", row.split("2,000")[1]), "an ETA"
    # --watch: a fresh table each interval (plain, as here stdout is not a terminal), until Ctrl-C
    watch = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "status", "--watch", "--interval", "0.5"],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(4)
    watch.send_signal(signal.SIGINT)
    shown, _ = watch.communicate(timeout=30)
    assert watch.returncode == 0 and shown.count("-- ") >= 3, shown
    steps = [int(m.group(1).replace(",", "")) for m in re.finditer(r" ([\d,]+)/2,000 ", shown)]
    assert len(steps) >= 3 and steps[-1] > steps[0], shown
    code, out, err = run_cli("down", "--all", "--yes")
    assert code == 0 and "stopped tiny" in out, out + err
    (row,) = status_rows(run_cli)
    assert (row["state"], row["exit_code"]) == ("PREEMPTED", 42)
    pre = [m for m in metrics(run_dir) if m.get("event") == "preempt"]
    assert pre and pre[0]["step"] in disk.complete_steps(run_dir / "checkpoints")
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


def _up_in_a_terminal(run_dir: Path, fault: str = "", *sets: str) -> subprocess.Popen:
    """`dtlaunch up` as a user starts it: Ctrl-C reaches dtlaunch alone (the job runs in its own session)."""
    more = [a for item in sets for a in ("--set", item)]
    return subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "up", str(TINY), "-o", str(run_dir), "--set", "training.steps=2000"]
        + more,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **({"DTLAUNCH_FAULT": fault} if fault else {})},
    )


def test_ctrl_c_shows_the_stop_to_its_end_and_a_second_one_leaves_it_stopping(run_cli, tmp_path):
    """Ctrl-C during `up`: the job checkpoints and exits 42, and the log goes on to the checkpoint's commit line
    (streaming used to end at the Ctrl-C). A second Ctrl-C stops watching at once and says the job still stops."""
    once = _up_in_a_terminal(tmp_path / "once")
    wait_for(lambda: any("loss" in m for m in metrics(tmp_path / "once")), 120, "a first step")
    once.send_signal(signal.SIGINT)
    out, _ = once.communicate(timeout=120)
    saved = [m["step"] for m in metrics(tmp_path / "once") if m.get("event") == "preempt"]
    assert once.returncode == 42 and saved, out
    assert "dtlaunch: stopping tiny: its workers checkpoint, then exit" in out, out
    assert f"checkpoint step {saved[-1]} committed" in out.split("dtlaunch: stopping tiny")[1], out
    assert f"its workers checkpointed step {saved[-1]}" in out and "tiny: PREEMPTED (exit code 42)" in out, out

    # the stop's checkpoint (the first: none is due before) takes 5 s, so the second Ctrl-C surely comes while the
    # job is stopping (a quick stop could end before it)
    twice = _up_in_a_terminal(tmp_path / "twice", "slow_checkpoint:step=any:seconds=5", "checkpoint.every=100000")
    wait_for(lambda: any("loss" in m for m in metrics(tmp_path / "twice")), 120, "a first step")
    twice.send_signal(signal.SIGINT)
    time.sleep(1)
    twice.send_signal(signal.SIGINT)
    out, _ = twice.communicate(timeout=30)
    assert twice.returncode == 130 and "goes on stopping by itself" in out, out
    wait_for(
        lambda: [
            r
            for r in status_rows(run_cli)
            if Path(r["run_dir"]).name == "twice" and (r["state"], r["exit_code"]) == ("PREEMPTED", 42)
        ],
        120,
        "the job, left stopping, to end PREEMPTED",
    )
    assert any("slow_checkpoint at step" in f.read_text() for f in (tmp_path / "twice" / "logs").glob("up-*.log"))
