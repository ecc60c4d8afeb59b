"""The registry as a person reads it: a headed table with progress and ETA, a name that resolves to one job or
asks which, `logs --tail`, and `forget`/`prune` that shrink the registry without touching any file."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from launcher.cli.jobs import COLUMNS
from launcher.jobenv import span as _ago
from launcher.targets.local.request import LocalHandle
from launcher.targets.registry import JobRecord, Registry


def _job(tmp_path: Path, name: str, run: str, job_id: str, *, age: float, exit_code: str = "0", step: int = 12):
    d = tmp_path / run
    (d / "logs").mkdir(parents=True, exist_ok=True)
    (d / "exit").write_text(exit_code)
    (d / "plan.json").write_text(json.dumps({"plan": {"steps": 40}}))
    rec = {"step": step, "loss": 4.5, "tokens_per_s": 4977.3, "mfu": 0.31, "step_time_s": 0.2, "time": time.time() - 30}
    (d / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    log = d / "logs" / "up.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    handle = LocalHandle(1, time.time() - age, "up-test", str(log), str(d / "exit"))
    Registry().add(JobRecord(name, "local", job_id, str(d), handle, time.time() - age))
    return d


def test_status_is_a_headed_table_with_progress(run_cli, tmp_path):
    _job(tmp_path, "tiny", "runs/tiny", "101", age=50)
    _job(tmp_path, "big", "runs/big", "102", age=2 * 3600 + 300, exit_code="1")
    code, out, err = run_cli("status")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == list(COLUMNS)
    tiny = next(ln for ln in lines if ln.startswith("tiny"))
    big = next(ln for ln in lines if ln.startswith("big"))
    assert "local:101" in tiny and "COMPLETED exit=0" in tiny and "12/40" in tiny and "4.5000" in tiny
    assert "5.0k" in tiny and "31.0%" in tiny and " 50s " in tiny
    assert "FAILED exit=1" in big and " 2h05m " in big
    # a finished job has no ETA
    assert tiny.split()[tiny.split().index("31.0%") + 1] == "-"


def test_spans_read_as_people_write_them():
    assert [_ago(s) for s in (5, 125, 3 * 3600 + 5 * 60, 2 * 86400 + 4 * 3600, None)] == [
        "5s",
        "2m",
        "3h05m",
        "2d04h",
        "-",
    ]


def test_a_name_in_two_run_directories_asks_which(run_cli, tmp_path):
    a = _job(tmp_path, "tiny", "one/runs/tiny", "201", age=100)
    _job(tmp_path, "tiny", "two/runs/tiny", "202", age=50)
    for cmd in (("status", "tiny"), ("logs", "tiny"), ("plot", "tiny"), ("forget", "tiny")):
        code, _, err = run_cli(*cmd)
        assert code == 2, (cmd, err)
        assert "'tiny' names jobs in 2 run directories" in err and "local:201" in err and "local:202" in err
        assert "name one by its id" in err
    assert len(Registry().all()) == 2  # forget dropped neither
    code, out, _ = run_cli("status", "local:201")
    assert code == 0 and "local:201" in out and "local:202" not in out
    code, out, _ = run_cli("status", a)  # by its run directory
    assert code == 0 and "local:201" in out and "local:202" not in out


def test_logs_tail_prints_the_last_lines(run_cli, tmp_path):
    _job(tmp_path, "tiny", "runs/tiny", "301", age=10)
    code, out, _ = run_cli("logs", "tiny", "--tail", "3")
    assert code == 0 and out == "line 97\nline 98\nline 99\n"
    code, _, err = run_cli("logs", "tiny", "--tail", "3", "-f")
    assert code == 2 and "use one" in err


def test_forget_and_prune_shrink_the_registry_and_touch_no_file(run_cli, tmp_path):
    a = _job(tmp_path, "a", "runs/a", "401", age=3 * 86400)
    b = _job(tmp_path, "b", "runs/b", "402", age=60)
    c = _job(tmp_path, "c", "runs/c", "403", age=30)
    before = sorted(p for p in tmp_path.rglob("*") if p.is_file() and "state" not in p.parts)
    code, out, _ = run_cli("forget", "c")
    assert code == 0 and "forgot 1 job record(s)" in out
    code, out, _ = run_cli("prune", "--older-than", "1")
    assert code == 0 and "pruned 1 finished job record(s)" in out
    assert [r.name for r in Registry().all()] == ["b"]
    code, out, _ = run_cli("prune")
    assert code == 0 and "pruned 1" in out and Registry().all() == []
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file() and "state" not in p.parts) == before
    assert all(d.is_dir() for d in (a, b, c))
    code, out, _ = run_cli("status")
    assert code == 0 and "no jobs recorded yet" in out


def test_down_all_with_nothing_running_and_its_usage(run_cli, tmp_path):
    _job(tmp_path, "a", "runs/a", "501", age=60)
    code, out, _ = run_cli("down", "--all", "--yes")
    assert code == 0 and "no running jobs" in out
    code, _, err = run_cli("down")
    assert code == 2 and "name one job, or pass --all" in err


def test_plot_of_a_missing_directory_says_so(run_cli, tmp_path):
    code, _, err = run_cli("plot", tmp_path / "runs" / "nope")
    assert code == 2 and "no such run directory or file" in err and "registry" not in err, err


def test_a_slurm_jobs_records_are_the_run_its_job_script_named(tmp_path):
    """jobs/ID/run_id (written by the job script's first attempt) names the job's run, runs/RUN_ID/; before it
    exists, or when it names no valid run id, the job has no records (not the newest run of another job)."""
    from launcher.targets.slurm.backend import SlurmBackend
    from launcher.targets.slurm.request import SlurmHandle

    rec = JobRecord("t", "slurm", "77", str(tmp_path), SlurmHandle(str(tmp_path), "t"))
    be = SlurmBackend()
    assert be.records_dir(rec) is None
    named = tmp_path / "jobs" / "77" / "run_id"
    named.parent.mkdir(parents=True)
    named.write_text("77-1700000000\n")
    assert be.records_dir(rec) == f"{tmp_path}/runs/77-1700000000"
    for bad in ("../../elsewhere\n", "\n", "a/b\n"):
        named.write_text(bad)
        assert be.records_dir(rec) is None, bad


@pytest.mark.parametrize("key", ["nope", "local:999"])
def test_forget_of_an_unknown_job_is_named(run_cli, key):
    code, _, err = run_cli("forget", key)
    assert code == 2 and f"no job named {key!r}" in err


class _LaggingAccounting:
    """Stands in for the SLURM commands at one moment that cannot be produced on demand here: the job has left
    squeue, and slurmdbd has not yet recorded its end (sacct still says RUNNING, exit 0:0)."""

    def __init__(self, job_dir: Path):
        self.job_dir = job_dir

    def run(self, argv, cwd=None, timeout=120):
        if argv[0] == "squeue":
            return 0, "", ""
        assert argv[0] == "sacct", argv
        return 0, "RUNNING|0:0\n", ""

    def read(self, path):
        p = Path(path)
        return p.read_bytes() if p.exists() else None

    def close(self):
        pass


@pytest.mark.parametrize(
    ("written", "codes", "shown"),
    [("COMPLETED", "0 0 none\n", ("COMPLETED", 0)), ("STOPPED", "0 42 TERM\n", ("STOPPED", 42)), ("RUNNING", "", None)],
)
def test_a_slurm_job_gone_from_squeue_ends_as_its_own_files_say_while_accounting_lags(tmp_path, written, codes, shown):
    """`dtlaunch status` right after a SLURM job ended once read `RUNNING exit=0`: accounting lags the job's end.
    The job script's final state (jobs/ID/state) answers then; a state it writes while the job lives does not."""
    from launcher.targets.slurm.backend import SlurmBackend
    from launcher.targets.slurm.request import SlurmHandle

    job_dir = tmp_path / "jobs" / "31"
    job_dir.mkdir(parents=True)
    (job_dir / "state").write_text(written + "\n")
    (job_dir / "exit_codes").write_text(codes)
    rec = JobRecord("tiny", "slurm", "31", str(tmp_path), SlurmHandle(str(tmp_path), "tiny"))
    st = SlurmBackend()._status(_LaggingAccounting(job_dir), rec).to_dict()
    if shown is None:
        assert (st["state"], st["source"]) == ("RUNNING", "sacct"), st
    else:
        assert (st["state"], st["exit_code"], st["source"]) == (*shown, "job files"), st
        assert st["detail"] == "accounting has not recorded the end yet"


def test_the_job_scripts_live_states_are_the_ones_status_waits_past():
    """What the SLURM job scripts write to jobs/ID/state before the job's end is what the backend treats as not
    final; every other state they write (COMPLETED, STOPPED, FAILED, the decision's) is an end."""
    import re

    from launcher.targets.slurm import backend

    templates = Path(backend.__file__).parent / "templates"
    written = set()
    for t in templates.glob("*.j2"):
        written |= set(re.findall(r'echo ([A-Z]+) > "\$JOB_DIR/state"', t.read_text()))
    ends = {"COMPLETED", "STOPPED", "FAILED"}
    assert written == set(backend._LIVE_FILE_STATES) | ends, written
