"""The sbatch script's exclude_bad_nodes, run in bash with `scontrol` stubbed (the real one is exercised on the local
cluster by tests/slurm/test_bad_nodes.py): it requeues only when a node is new since its last exclusion, so a
failure that names no new node cannot requeue the job onto itself forever, and it stops at the cap."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli.diagnose import diagnose
from launcher.cli.jobs import progress
from launcher.jobenv import Excluded, ExitCode
from launcher.plan import make_plan
from launcher.recipe import load
from launcher.targets.slurm.sbatch import job_script
from testpaths import RECIPES


def script(overrides: tuple[str, ...] = ()) -> str:
    recipe = load(RECIPES / "tiny.yaml", list(overrides))
    return job_script(recipe, make_plan(recipe))


def run(
    tmp_path: Path,
    bad: list[str],
    excluded: list[str],
    why: str = Excluded.CHECK,
    partition: tuple[str, ...] = ("node1", "node2", "node3", "node4"),
    job_nodes: int = 1,
    exc_node_list: str = "(null)",
) -> tuple[int, list[str]]:
    """exclude_bad_nodes in bash, its return code and the scontrol calls it made (the `show` ones left out). The
    stubs answer as SLURM does: `scontrol show hostnames` expands a hostlist (node[2-3],node1), `show job` gives
    the job's ExcNodeList as scontrol prints it (compressed), sinfo lists `partition`'s nodes, once per
    partition a node is in (so a node may come twice)."""
    fn = re.search(r"^exclude_bad_nodes\(\) \{.*?^\}$", script(), re.S | re.M)
    assert fn, "the job script has no exclude_bad_nodes()"
    stub = tmp_path / "bin"
    stub.mkdir()
    calls = tmp_path / "calls"
    expand = (  # a hostlist such as node[2-3],node1, one name a line
        "import re, sys\n"
        "for pre, rng in re.findall(r'([^,\\[]+)(?:\\[([^\\]]*)\\])?', sys.argv[1]):\n"
        "    for part in rng.split(',') if rng else ['']:\n"
        "        a, _, b = part.partition('-')\n"
        "        for i in range(int(a), int(b or a) + 1) if a else [None]:\n"
        "            print(pre if i is None else f'{pre}{i}')\n"
    )
    (stub / "expand.py").write_text(expand)
    (stub / "scontrol").write_text(
        f'#!/bin/bash\necho "$*" >> {calls}\n'
        f'if [ "$1 $2" = "show hostnames" ]; then {sys.executable} {stub / "expand.py"} "$3"; '
        f'else echo "JobId=7 ExcNodeList={exc_node_list}"; fi\n'
    )
    (stub / "sinfo").write_text("#!/bin/bash\n" + "".join(f"echo {n}\n" for n in partition))
    for f in ("scontrol", "sinfo"):
        (stub / f).chmod(0o755)
    (tmp_path / "bad_nodes").write_text("".join(f"{n}\n" for n in bad))
    (tmp_path / "excluded").write_text("".join(f"{i} 1700000000 {e}\n" for i, e in enumerate(excluded)))
    body = 'fail() { echo "fail $*"; exit "$1"; }\n' + fn.group(0) + f"\nexclude_bad_nodes {why}\necho returned\n"
    env = {
        "PATH": f"{stub}:/usr/bin:/bin",
        "DTLAUNCH_BAD_NODES": str(tmp_path / "bad_nodes"),
        "JOB_DIR": str(tmp_path),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_PARTITION": "debug",
        "SLURM_JOB_NUM_NODES": str(job_nodes),
        "ATTEMPT": "1",
    }
    p = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, timeout=60)
    made = calls.read_text().splitlines() if calls.exists() else []
    return p.returncode, [c for c in made if not c.startswith("show ")]


def test_a_new_bad_node_is_excluded_and_the_job_requeued(tmp_path):
    rc, calls = run(tmp_path, ["node1"], [], Excluded.HANG)
    assert rc == ExitCode.PREFLIGHT
    assert calls == ["requeue 7", "update JobId=7 ExcNodeList=node1"], calls
    # the ledger line says why (the attempt, the time, the nodes, the reason), as status and --diagnose read it
    attempt, _, nodes, why = (tmp_path / "excluded").read_text().splitlines()[-1].split()
    assert (attempt, nodes, why) == ("1", "node1", "hang")


FOUR_TWICE = ("node1", "node2", "node3", "node4", "node1", "node2")  # two partitions sharing node1 and node2


@pytest.mark.parametrize(
    "partition, job_nodes, exc_node_list, requeued",
    [
        (("node1", "node2"), 2, "(null)", False),  # a 2-node job on a 2-node partition: one node out leaves too few
        (("node1", "node2", "node3"), 2, "(null)", True),
        ((), 2, "(null)", True),  # sinfo said nothing: unknown, so no refusal on that ground
        (FOUR_TWICE, 2, "node[2-3]", False),  # node4 alone is left once node1 joins the job's excluded nodes
        (FOUR_TWICE, 1, "node[2-3]", True),
    ],
)
def test_no_requeue_onto_a_partition_too_small_without_the_excluded_nodes(
    tmp_path, partition, job_nodes, exc_node_list, requeued
):
    rc, calls = run(tmp_path, ["node1"], [], partition=partition, job_nodes=job_nodes, exc_node_list=exc_node_list)
    if not requeued:
        assert rc == 0 and not calls, calls
    else:
        excluded = "node1" if exc_node_list == "(null)" else f"{exc_node_list},node1"
        assert rc == ExitCode.PREFLIGHT and calls == ["requeue 7", f"update JobId=7 ExcNodeList={excluded}"], calls


def test_every_exclusion_in_the_job_script_gives_a_reason_the_readers_know():
    """The job script's reasons (bash) and jobenv.Excluded's words (Python) against each other: each call of
    exclude_bad_nodes passes one reason, and each reason has its words."""
    reasons: set[str] = set()
    container = ("resources.image=nvcr.io/nvidia/pytorch:24.05-py3", "targets.slurm.container={runtime: pyxis}")
    for text in (script(), script(container)):  # the container's check runs in the batch shell: a call of its own
        calls = re.findall(r"(?:^|then|else|;)[ \t]*exclude_bad_nodes\b(?!\(\))[ \t]*([^ \t;\n]*)", text, re.M)
        assert calls and all(c in Excluded.WORDS for c in calls), calls
        reasons.update(calls)
    assert reasons == set(Excluded.WORDS), reasons


def test_status_and_diagnose_say_which_node_was_excluded_and_why(tmp_path):
    """A SLURM job's ledger of exclusions, read by `logs --diagnose` and the status table (an older script's
    line, without a reason, still reads)."""
    (tmp_path / "jobs" / "7").mkdir(parents=True)
    (tmp_path / "jobs" / "7" / "excluded").write_text("0 1700000000 node3\n1 1700000100 node3,node1 hang\n")
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"event": "end", "step": 6, "time": 1700000200}\n')
    said = diagnose(tmp_path)
    assert said[-2:] == [
        "job 7: excluded node3 after attempt 0 and requeued",
        "job 7: excluded node3,node1 after attempt 1 and requeued: a hang's likely culprit ran there",
    ], said
    row = {"name": "tiny", "target": "slurm", "job_id": "7", "run_dir": str(run), "created": 0.0}
    row |= {"state": "COMPLETED", "exit_code": 0}
    row["excluded"] = Excluded.ledger((tmp_path / "jobs" / "7" / "excluded").read_text())
    state = progress(row, now=1.0)["state"]
    assert state.endswith("excluded: node3,node1 (attempt 1: a hang's likely culprit ran there)"), state


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
