"""The registry and `up`/`status`/`down` under the reliability review's cases (round 2: R04, R05, R07, R14):
a refused `up` changes nothing; two `up` at once submit one job; `down NAME` stops the running job; a stepped
wall clock neither loses a job nor skips its SIGTERM; `status` stays fast with 1,000 recorded jobs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.jobenv import ATTEMPT
from launcher.runtime.checkpoint import disk
from launcher.targets.local import backend as local
from launcher.targets.local.request import LocalHandle
from launcher.targets.registry import JobRecord, Registry
from testpaths import RECIPES, ROOT

TINY = RECIPES / "tiny.yaml"


@pytest.fixture
def procs():
    """Processes a test starts; killed at its end whatever happened."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def start_job(procs, tmp_path: Path, attempt: str, on_term: str = "exit 0") -> tuple[subprocess.Popen, Path]:
    """A real process standing in for a job's launcher: it carries the attempt's marker, as launch.sh does, and
    writes `term` into a file when SIGTERM reaches it, then runs `on_term`."""
    seen = tmp_path / f"{attempt}.term"
    script = f"trap 'echo TERM >> {seen}; {on_term}' TERM; while :; do sleep 0.05; done"
    p = subprocess.Popen(["bash", "-c", script], env={**os.environ, ATTEMPT: attempt}, start_new_session=True)
    procs.append(p)
    time.sleep(0.2)  # the trap is set
    return p, seen


def record(
    name: str,
    p: subprocess.Popen | None,
    run_dir: Path,
    attempt: str,
    *,
    shift: float = 0.0,
    created: float | None = None,
) -> JobRecord:
    """Record a job the way `up` does (pid, start time, start id); `shift` moves the recorded wall-clock start
    time, as a clock step moves psutil's create_time. Without a process: a long-finished job (pid gone)."""
    pid = p.pid if p else 4_190_000
    handle = LocalHandle(
        pid,
        (local._start_time(pid) or time.time()) + shift,
        attempt,
        str(run_dir / "logs" / f"{attempt}.log"),
        str(run_dir / "status" / attempt / "exit_code"),
        local.launcher_identity(pid),
    )
    rec = JobRecord(name, "local", str(pid), str(run_dir.resolve()), handle, created or time.time())
    Registry().add(rec)
    return rec


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def states(run_cli) -> list[str]:
    code, out, err = run_cli("status", "--json")
    assert code == 0, err
    return [r["state"] for r in json.loads(out)]


# ---------------------------------------------------------------- R04


def test_a_refused_up_changes_nothing_in_the_run_directory(run_cli, tmp_path, procs):
    """R04: a job runs in the directory; `up` there with another length is refused, and plan.json/recipe.yaml
    (which the running job's torchrun restart would read) stay byte-identical, as does every other file."""
    run_dir = tmp_path / "run"
    code, _, err = run_cli("up", TINY, "-o", run_dir, "--dry-run", "--set", "training.steps=400")
    assert code == 0, err
    p, _ = start_job(procs, tmp_path, "up-r04")
    record("tiny", p, run_dir, "up-r04")
    before = snapshot(run_dir)
    for extra in (("--detach",), ("--dry-run",)):
        code, out, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=12", *extra)
        assert code == 3, (extra, out + err)
        assert snapshot(run_dir) == before, f"up {extra} rewrote the running job's files"
        assert "is in use by job tiny" in err and "nothing was changed" in err and "Traceback" not in err, err
    assert len(Registry().all()) == 1 and p.poll() is None


# ---------------------------------------------------------------- R07


def test_up_while_another_up_holds_the_directory_is_refused_and_leaves_no_trace(run_cli, tmp_path):
    """R07, step by step: while one `up` is between its busy check and recording its job, a second one is
    refused; it wrote nothing and recorded nothing."""
    run_dir = tmp_path / "run"
    with Registry().claim(str(run_dir.resolve())):
        code, out, err = run_cli("up", TINY, "-o", run_dir, "--detach")
    assert code == 3 and "another `dtlaunch up` is starting a job in" in err, out + err
    assert "Traceback" not in err
    assert not run_dir.exists() and Registry().all() == []


@pytest.mark.slow
def test_concurrent_ups_submit_one_job_and_down_stops_it(run_cli, tmp_path):
    """R07 with real processes: three `up --detach` into one directory at once. One submits; the others are
    refused cleanly, before starting anything: one log, one attempt's status, one registry row, one `start`
    event; `down tiny` stops the job that runs (it checkpoints)."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "up",
        str(TINY),
        "-o",
        str(run_dir),
        "--detach",
        "--set",
        "training.steps=2000",
    ]
    ups = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        results = [(*u.communicate(timeout=120), u.returncode) for u in ups]
        results = [(code, out, err) for out, err, code in results]
        winners = [r for r in results if r[0] == 0]
        assert len(winners) == 1 and "submitted tiny" in winners[0][1], results
        for code, out, err in results:
            if code:
                assert code == 3 and "Traceback" not in err, (code, out, err)
                assert "is in use by job tiny" in err or "another `dtlaunch up` is starting" in err, err
        (rec,) = Registry().all()
        assert [p.name for p in (run_dir / "logs").iterdir()] == [f"{rec.handle.attempt}.log"]
        assert [p.name for p in (run_dir / "status").iterdir()] == [rec.handle.attempt]
        t0 = time.time()
        while not any('"step": 3,' in ln for ln in _lines(run_dir / "metrics.jsonl")):
            assert time.time() - t0 < 120, "no step 3 within 120 s"
            time.sleep(0.3)
        assert sum('"event": "start"' in ln for ln in _lines(run_dir / "metrics.jsonl")) == 1
        code, out, err = run_cli("down", "tiny")
        assert code == 0 and re.search(r"stopped tiny: its workers checkpointed step \d+ and exited 42", out), out + err
        assert states(run_cli) == ["PREEMPTED"]
    finally:  # whatever failed, no job outlives the test
        for rec in Registry().all():
            local.LocalBackend().cancel(rec, grace=30)


def _lines(p: Path) -> list[str]:
    return p.read_text().splitlines() if p.exists() else []


def test_down_by_name_stops_the_running_job_not_a_newer_dead_one(run_cli, tmp_path, procs):
    """R07: two rows named tiny, the newer one dead (the loser of a race, or a run elsewhere that ended):
    `down tiny` sends SIGTERM to the one that runs. With two running, it asks which."""
    p, seen = start_job(procs, tmp_path, "up-live")
    record("tiny", p, tmp_path / "a", "up-live", created=time.time() - 10)
    record("tiny", None, tmp_path / "b", "up-dead")
    assert states(run_cli) == ["RUNNING", "LOST"]
    code, out, err = run_cli("down", "tiny")
    assert code == 0 and "stopped tiny" in out, out + err
    assert seen.read_text() == "TERM\n" and p.wait(5) == 0

    p1, seen1 = start_job(procs, tmp_path, "up-one")
    p2, seen2 = start_job(procs, tmp_path, "up-two")
    r1 = record("twice", p1, tmp_path / "c", "up-one")
    r2 = record("twice", p2, tmp_path / "d", "up-two")
    code, out, err = run_cli("down", "twice")
    assert code == 2 and "2 jobs named 'twice' are running" in err, out + err
    assert f"local:{r1.job_id}" in err and f"local:{r2.job_id}" in err and "dtlaunch down" in err
    time.sleep(0.3)
    assert p1.poll() is None and p2.poll() is None and not seen1.exists() and not seen2.exists()
    code, out, _ = run_cli("down", r2.job_id)  # by its id: that one only
    assert code == 0 and p2.wait(5) == 0 and p1.poll() is None


# ---------------------------------------------------------------- R05


def test_a_clock_step_neither_loses_the_job_nor_skips_sigterm(run_cli, tmp_path, procs):
    """R05: the recorded wall-clock start time 3 s off (what a clock step does to psutil >= 7's create_time):
    the job still reads RUNNING, and `down` sends SIGTERM first; only what is left after the grace period is
    killed (this launcher ignores the signal)."""
    p, seen = start_job(procs, tmp_path, "up-step", on_term=":")
    rec = record("tiny", p, tmp_path / "run", "up-step", shift=3.0)
    assert states(run_cli) == ["RUNNING"]
    msg = local.LocalBackend().cancel(rec, grace=1.0)
    assert seen.read_text().startswith("TERM"), "no SIGTERM before the kill"
    assert "did not stop within 1s and were killed" in msg, msg  # the launcher (and its sleep)
    assert p.wait(5) == -9


def test_down_terms_a_jobs_orphaned_processes_before_any_kill(tmp_path, procs):
    """R05: the launcher gone (or not recognised), its workers still running: they get SIGTERM, so they can
    checkpoint, instead of a silent wait and a kill."""
    p, seen = start_job(procs, tmp_path, "up-orphan")
    handle = LocalHandle(
        4_190_000, time.time(), "up-orphan", str(tmp_path / "log"), str(tmp_path / "exit_code"), "not-this-boot:1"
    )
    rec = JobRecord("tiny", "local", "4190000", str(tmp_path), handle)
    assert local.LocalBackend().status(rec).state == "STOPPING"
    t0 = time.monotonic()
    msg = local.LocalBackend().cancel(rec, grace=10.0)
    assert seen.read_text() == "TERM\n" and p.wait(5) == 0, msg
    assert msg.startswith("stopped tiny: ") and time.monotonic() - t0 < 5, msg


def test_rows_written_before_the_start_id_still_work(run_cli, tmp_path, procs):
    """Registry rows from before this change have no start_id: they decode, and their job is recognised by
    its wall-clock start time as before."""
    p, _ = start_job(procs, tmp_path, "up-old")
    old = {
        "pid": p.pid,
        "create_time": local._start_time(p.pid),
        "attempt": "up-old",
        "log": str(tmp_path / "log"),
        "exit_file": str(tmp_path / "exit_code"),
    }
    Registry().all()  # creates the table
    with sqlite3.connect(Registry().path) as db:
        db.execute(
            "INSERT INTO jobs VALUES (?,?,?,?,?,?)",
            ("old", "local", str(p.pid), str(tmp_path), json.dumps(old), time.time()),
        )
    (rec,) = Registry().all()
    assert rec.handle.start_id is None
    assert states(run_cli) == ["RUNNING"]
    (tmp_path / "exit_code").write_text("0")
    assert states(run_cli) == ["COMPLETED"]


# ---------------------------------------------------------------- R14


def test_status_of_1000_jobs_takes_well_under_a_second(run_cli, tmp_path, procs):
    """R14: 1,000 rows, nearly all long-finished jobs without an exit code (the slow case: each looked for its
    processes in every process's environment), a few running, some of the old kind without a start id."""
    live = [start_job(procs, tmp_path, f"up-live-{i}")[0] for i in range(5)]
    reg = Registry()
    reg.all()  # creates the table
    rows = []
    for i in range(1000):
        attempt = f"up-{i}"
        if i < len(live):
            pid, start_id = live[i].pid, local.launcher_identity(live[i].pid)
        else:  # gone, or its pid since reused by another process (this one)
            pid, start_id = (4_190_000 + i if i % 2 else os.getpid()), (None if i % 3 == 0 else "boot:1")
        created = local._start_time(pid) if i < len(live) else time.time() - 86400
        h = LocalHandle(
            pid,
            created,
            attempt,
            str(tmp_path / f"{i}.log"),
            str(tmp_path / "status" / attempt / "exit_code"),
            start_id,
        )
        rows.append(("job", "local", str(pid), str(tmp_path), json.dumps(dataclasses.asdict(h)), time.time() + i))
    with sqlite3.connect(reg.path) as db:
        db.executemany("INSERT INTO jobs VALUES (?,?,?,?,?,?)", rows)

    t0 = time.perf_counter()
    code, out, err = run_cli("status", "--json")
    cli_s = time.perf_counter() - t0
    assert code == 0, err
    got = [r["state"] for r in json.loads(out)]
    assert got[:5] == ["RUNNING"] * 5 and set(got[5:]) == {"LOST"} and len(got) == 1000
    print(f"status of 1,000 jobs, CLI in-process: {cli_s:.3f} s")
    assert cli_s < 1.0, cli_s
    from launcher.cli.jobs import status_rows

    t0 = time.perf_counter()
    assert len(status_rows(reg.all())) == 1000
    fn_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "launcher", "status", "--json"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL
    )
    proc_s = time.perf_counter() - t0
    print(f"status of 1,000 jobs: {fn_s:.3f} s (rows), {proc_s:.3f} s (a `dtlaunch status` subprocess)")
    assert fn_s < 1.0, fn_s
    assert proc_s < 5.0, proc_s  # the interpreter's start included; ~20 s before the fix


def test_down_in_a_jobs_first_second_is_a_stop_not_a_lost_job(run_cli, tmp_path):
    """`down` while the job is still starting (before torchrun's workers and their traps): the launch script's
    early trap, or the torchrun agent's (launcher.runtime.elastic, which checks the plan, importing torch),
    records the stop, so status reads PREEMPTED (nothing trained, nothing lost), never LOST, and
    `down` says what happened rather than claiming a checkpoint; `up` then starts it."""
    run_dir = tmp_path / "early"
    code, out, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=4", "--detach")
    assert code == 0, err
    time.sleep(0.5)  # the agent imports torch and checks the plan: seconds
    code, out, err = run_cli("down", "tiny")
    assert code == 0 and "stopped tiny: stopped before training began (nothing to checkpoint)" in out, out + err
    assert states(run_cli) == ["PREEMPTED"]
    assert not (run_dir / "checkpoints").exists() or not disk.complete_steps(run_dir / "checkpoints")
    code, out, err = run_cli("up", TINY, "-o", run_dir, "--set", "training.steps=4")
    assert code == 0 and "done: 4 steps" in out, out + err
