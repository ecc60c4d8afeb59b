"""The sbatch script's exclude_bad_nodes, run in bash with `scontrol` stubbed (the real one is exercised on the local
cluster by tests/slurm/test_bad_nodes.py): it requeues only when a node is new since its last exclusion, so a
failure that names no new node cannot requeue the job onto itself forever, and it stops at the cap."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from launcher.jobenv import ExitCode
from launcher.plan import make_plan
from launcher.recipe import load
from launcher.targets.slurm.sbatch import job_script
from testpaths import RECIPES


def run(tmp_path: Path, bad: list[str], excluded: list[str]) -> tuple[int, list[str]]:
    recipe = load(RECIPES / "tiny.yaml")
    script = job_script(recipe, make_plan(recipe))
    fn = re.search(r"^exclude_bad_nodes\(\) \{.*?^\}$", script, re.S | re.M)
    assert fn, "the job script has no exclude_bad_nodes()"
    stub = tmp_path / "bin"
    stub.mkdir()
    calls = tmp_path / "calls"
    (stub / "scontrol").write_text(f'#!/bin/bash\necho "$*" >> {calls}\necho "JobId=7 ExcNodeList=(null)"\n')
    (stub / "scontrol").chmod(0o755)
    (tmp_path / "bad_nodes").write_text("".join(f"{n}\n" for n in bad))
    (tmp_path / "excluded").write_text("".join(f"{i} 1700000000 {e}\n" for i, e in enumerate(excluded)))
    body = 'fail() { echo "fail $*"; exit "$1"; }\n' + fn.group(0) + "\nexclude_bad_nodes\necho returned\n"
    env = {
        "PATH": f"{stub}:/usr/bin:/bin",
        "DTLAUNCH_BAD_NODES": str(tmp_path / "bad_nodes"),
        "JOB_DIR": str(tmp_path),
        "SLURM_JOB_ID": "7",
        "ATTEMPT": "1",
    }
    p = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, timeout=60)
    return p.returncode, calls.read_text().splitlines() if calls.exists() else []


def test_a_new_bad_node_is_excluded_and_the_job_requeued(tmp_path):
    rc, calls = run(tmp_path, ["node1"], [])
    assert rc == ExitCode.PREFLIGHT
    assert calls[1:] == ["requeue 7", "update JobId=7 ExcNodeList=node1"], calls


@pytest.mark.parametrize(
    "bad, excluded, why",
    [
        (["node1"], ["node1"], "no node new since the last exclusion"),
        (["node1", "node2", "node3"], ["node1,node2"], "past the cap of 2"),
    ],
)
def test_no_requeue_without_a_new_node_or_past_the_cap(tmp_path, bad, excluded, why):
    rc, calls = run(tmp_path, bad, excluded)
    assert rc == 0 and not any(c.startswith("requeue") for c in calls), (why, calls)
