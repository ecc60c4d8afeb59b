"""Issue 35 on the real local SLURM cluster: a node that fails the pre-start check is named, excluded from the job
(its ExcNodeList, set once the requeue has made the job pending again), and the requeued job trains on another
node to the end; a cap on exclusions (targets.slurm.max_excluded_nodes) ends a job that would exclude its way to
nothing instead. The failing check is the test-only `bad_node` fault: broken GPUs cannot exist here."""

from __future__ import annotations

import time

import pytest

from launcher.jobenv import ExitCode
from slurmkit import Job, overrides, release_after_requeue, render_to, sh, wait_for

pytestmark = pytest.mark.slow


def one_node(partition: str, extra=()) -> list[str]:
    return [*overrides(partition), "resources.nodes=1", "training.steps=6", "checkpoint.every=3", *extra]


def test_a_node_that_fails_its_check_is_excluded_and_the_job_finishes_elsewhere(tmp_path, partition):
    render_to(tmp_path, "tiny", one_node(partition))
    job = Job(tmp_path, fault="bad_node:step=0:attempt=0")  # whichever node the first allocation gets
    wait_for(lambda: job.ledger("excluded"), 120, "the bad node's exclusion", explain=job.explain)
    requeued_at = time.time()
    (line,) = job.ledger("excluded")
    bad = line.split()[-1]
    assert bad in ("node1", "node2"), line
    wait_for(lambda: "PENDING" in sh("squeue", "-h", "-j", job.id, "-o", "%T", check=False).stdout, 30, "pending")
    shown = sh("scontrol", "show", "job", "-o", job.id).stdout
    assert f"ExcNodeList={bad}" in shown, shown
    release_after_requeue(job.id, requeued_at)
    job.done(240)
    assert job.ledger("state") == ["COMPLETED"], job.explain()
    first, second = (a.split() for a in job.ledger("attempts"))
    assert first[2] == bad and second[2] != bad, job.ledger("attempts")
    out = (tmp_path / f"tiny-{job.id}.out").read_text()
    assert f"node {bad} cannot run the plan: CUDA error: uncorrectable ECC error encountered (injected)" in out
    assert f"node(s) {bad} failed the pre-start check: requeueing job {job.id} without them" in out
    assert [e["step"] for e in job.events("end")] == [6]


def test_exclusions_stop_at_the_cap(tmp_path, partition):
    render_to(tmp_path, "tiny", one_node(partition, ["targets.slurm.max_excluded_nodes=0"]))
    job = Job(tmp_path, fault="bad_node:step=0")
    job.done(120)
    assert job.ledger("state") == ["FAILED"] and job.ledger("excluded") == [], job.explain()
    assert len(job.ledger("attempts")) == 1
    out = (tmp_path / f"tiny-{job.id}.out").read_text()
    assert "more than targets.slurm.max_excluded_nodes=0" in out and "exclude it and resubmit" in out, out
    rows = sh("sacct", "-n", "-X", "-P", "-j", job.id, "-o", "ExitCode", check=False).stdout.split()
    assert rows and rows[0].startswith(f"{ExitCode.PREFLIGHT}:"), rows
