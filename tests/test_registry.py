"""The job registry fails safe: a registry that cannot record a job stops `up` before anything starts; a
damaged database or row gives a clear error with the fix (or is skipped) instead of breaking every command."""

from __future__ import annotations

import json
import sqlite3
import time

from launcher.targets.local.request import LocalHandle
from launcher.targets.registry import JobRecord, Registry
from testpaths import RECIPES


def test_an_unwritable_registry_stops_up_before_anything_starts(run_cli, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("DTLAUNCH_HOME", str(blocker / "state"))
    out_dir = tmp_path / "run"
    code, out, err = run_cli("up", RECIPES / "tiny.yaml", "-o", out_dir, "--detach")
    assert code == 3 and "cannot be written" in err and "DTLAUNCH_HOME" in err, err
    assert "Traceback" not in err and "internal error" not in err
    assert not (out_dir / "logs").exists(), "nothing may be started when the job could not be followed"


def test_a_damaged_database_says_how_to_fix_it(run_cli, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("DTLAUNCH_HOME", str(home))
    (home / "registry.db").write_bytes(b"\x00not a database" * 200)
    for args in (("status",), ("logs", "x"), ("down", "x")):
        code, out, err = run_cli(*args)
        assert code == 3, (args, err)
        assert "registry" in err and "move it aside" in err and "internal error" not in err, err
    (home / "registry.db").unlink()
    (home / "registry.db").mkdir()  # a directory where the database should be
    code, _, err = run_cli("status")
    assert code == 3 and "cannot be opened" in err


def test_one_bad_row_is_skipped_not_fatal(run_cli, tmp_path):
    reg = Registry()
    good = LocalHandle(1, time.time(), "up-x", str(tmp_path / "log"), str(tmp_path / "exit"))
    (tmp_path / "exit").write_text("0")
    reg.add(JobRecord("good", "local", "1", str(tmp_path), good))
    with sqlite3.connect(reg.path) as db:
        db.execute("INSERT INTO jobs VALUES (?,?,?,?,?,?)", ("broken", "local", "2", "/x", "not json", time.time()))
        db.execute("INSERT INTO jobs VALUES (?,?,?,?,?,?)", ("empty", "local", "3", "/x", "{}", time.time()))
    code, out, err = run_cli("status", "--json")
    assert code == 0
    assert [r["name"] for r in json.loads(out)] == ["good"]
    assert "skipping a damaged registry row for job 'broken'" in err and "'empty'" in err
    code, out, err = run_cli("status", "good")
    assert code == 0 and "COMPLETED" in out


def test_unknown_jobs_are_named_not_ignored(run_cli):
    for args in (("logs", "nope"), ("down", "nope"), ("status", "nope")):
        code, _, err = run_cli(*args)
        assert code == 2 and "no job named 'nope'" in err, (args, err)
