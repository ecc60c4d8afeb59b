"""Issue 35 on the real local SLURM cluster: a node that fails the pre-start check is named, excluded from the job
(its ExcNodeList, set once the requeue has made the job pending again), and the requeued job trains on another
node to the end; a cap on exclusions (targets.slurm.max_excluded_nodes) ends a job that would exclude its way to
nothing instead. The failing check is the test-only `bad_node` fault: broken GPUs cannot exist here."""

from __future__ import annotations

import os
import re
import time

import pytest
from test_containers import IMAGE, calls, stubs  # noqa: F401 - stubs: the pyxis case's fixture

from launcher.cli.diagnose import diagnose
from launcher.cli.jobs import of_ranks
from launcher.jobenv import Excluded, ExitCode
from launcher.runtime import hangs
from slurmkit import Job, overrides, release_after_requeue, render_to, sacct_rows, sh, wait_for

pytestmark = pytest.mark.slow


def wait_excluded(job: Job, node: str) -> None:
    """The job script sets ExcNodeList once the requeue has made the job pending (a second or so): before the job
    is released, or it could start on the node again."""
    wait_for(
        lambda: f"ExcNodeList={node}" in sh("scontrol", "show", "job", "-o", job.id, check=False).stdout,
        30,
        f"ExcNodeList={node}",
        explain=job.explain,
    )


def one_node(partition: str, extra=()) -> list[str]:
    return [*overrides(partition), "resources.nodes=1", "training.steps=6", "checkpoint.every=3", *extra]


@pytest.fixture(scope="module")
def undisturbed(slurm, tmp_path_factory):
    """The weights a one-node job on `accelerator` ends with when nothing goes wrong (one job per accelerator,
    run when first asked for): what each disturbed run below must end with too (deterministic training)."""
    done: dict[str, dict] = {}

    def weights(accelerator: str) -> dict:
        if accelerator not in done:
            out = tmp_path_factory.mktemp("undisturbed")
            render_to(out, "tiny", one_node(slurm["SLURM_LOCAL_PARTITION"], [f"resources.accelerator={accelerator}"]))
            job = Job(out)
            job.done(240)
            assert job.ledger("state") == ["COMPLETED"], job.explain()
            done[accelerator] = exported(job)
        return done[accelerator]

    return weights


def exported(job: Job) -> dict:
    """The run's final weights, as its export wrote them (model.safetensors)."""
    from safetensors.torch import load_file

    (export,) = job.events("export")
    return load_file(export["path"])


def assert_same_weights(job: Job, reference: dict) -> None:
    mine = exported(job)
    assert mine.keys() == reference.keys() and all(mine[k].equal(reference[k]) for k in mine), job.explain()


def status(job: Job) -> dict:
    """What `dtlaunch status` reads for the job (the SLURM backend's status; the registry record is the one
    `dtlaunch up` would have written)."""
    from launcher.targets.registry import JobRecord
    from launcher.targets.slurm.backend import SlurmBackend
    from launcher.targets.slurm.request import SlurmHandle

    rec = JobRecord("tiny", "slurm", job.id, str(job.out), SlurmHandle(str(job.out), "tiny"))
    return SlurmBackend().status(rec).to_dict()


def test_a_node_that_fails_its_check_is_excluded_and_the_job_finishes_elsewhere(tmp_path, partition, undisturbed):
    render_to(tmp_path, "tiny", one_node(partition))
    job = Job(tmp_path, fault="bad_node:step=0:attempt=0")  # whichever node the first allocation gets
    wait_for(lambda: job.ledger("excluded"), 120, "the bad node's exclusion", explain=job.explain)
    requeued_at = time.time()
    (line,) = job.ledger("excluded")
    bad = line.split()[2]  # ATTEMPT TIME NODES WHY
    assert bad in ("node1", "node2"), line
    wait_excluded(job, bad)
    release_after_requeue(job.id, requeued_at)
    job.done(240)
    assert job.ledger("state") == ["COMPLETED"], job.explain()
    first, second = (a.split() for a in job.ledger("attempts"))
    assert first[2] == bad and second[2] != bad, job.ledger("attempts")
    out = (tmp_path / f"tiny-{job.id}.out").read_text()
    assert f"node {bad} cannot run the plan: CUDA error: uncorrectable ECC error encountered (injected)" in out
    assert f"node(s) {bad} failed: requeueing job {job.id} without them" in out
    assert [e["step"] for e in job.events("end")] == [6]
    assert_same_weights(job, undisturbed("cpu:1"))
    why = Excluded.WORDS[Excluded.CHECK]
    said = diagnose(tmp_path)
    assert f"job {job.id}: excluded {bad} after attempt 0 and requeued: {why}" in said, said
    check = [line for line in said if line.startswith(f"node {bad} failed the check before training (attempt ")]
    assert len(check) == 1 and "PREFLIGHT (44): CUDA error: uncorrectable ECC error" in check[0], said
    # the node that ran it passed its check, and the run's preflight record holds what that check found
    good = second[2]
    (pre,) = job.events("preflight")
    assert pre["nodes"] == [good], pre  # one rank (cpu:1)
    assert pre["node_checks"][good]["code"] == 0 and "plan: " in pre["node_checks"][good]["summary"], pre
    assert pre["node_free_bytes"][good] > 0, pre
    assert status(job)["excluded"] == [{"attempt": "0", "nodes": bad, "why": why}]


def test_exclusions_stop_at_the_cap(tmp_path, partition):
    render_to(tmp_path, "tiny", one_node(partition, ["targets.slurm.max_excluded_nodes=0"]))
    job = Job(tmp_path, fault="bad_node:step=0")
    job.done(120)
    assert job.ledger("state") == ["FAILED"] and job.ledger("excluded") == [], job.explain()
    assert len(job.ledger("attempts")) == 1
    out = (tmp_path / f"tiny-{job.id}.out").read_text()
    assert "more than targets.slurm.max_excluded_nodes=0" in out and "exclude it and resubmit" in out, out
    # Accounting records the end asynchronously: read it once it has (sacct_rows), or it may still say 0:0.
    rows = {r[0]: r[1:] for r in sacct_rows(job.id)}
    assert rows[job.id] == ["FAILED", f"{ExitCode.PREFLIGHT}:0"], rows


def test_no_requeue_when_the_partition_without_the_node_cannot_hold_the_job(tmp_path, partition):
    """A 2-node job on the 2-node cluster whose node1 fails its check: without node1 the partition cannot hold the
    job, which would wait for nodes that never come. It ends instead, saying so, with nothing excluded."""
    render_to(tmp_path, "tiny", [*overrides(partition), "training.steps=2"])
    job = Job(tmp_path, fault="bad_node:step=0:node=node1")
    job.done(120)
    assert job.ledger("state") == ["FAILED"] and job.ledger("excluded") == [], job.explain()
    out = (tmp_path / f"tiny-{job.id}.out").read_text()
    assert "without node(s) node1 partition" in out and "has 1 node(s) for this job's 2" in out, out[-3000:]


def fails_on_node1_then_finishes_on_node2(
    tmp_path, partition, fault: str, extra: list[str], reference: dict, why: str, resume_at: int = 3
) -> tuple[Job, str]:
    """A one-node job whose first allocation is node1 (node2 held by another job until node1 is excluded), given
    `fault`: node1 excluded (for `why`, a jobenv.Excluded reason: in status and the diagnosis), the job released,
    resumed from its step-`resume_at` checkpoint on node2 and finished with the `reference` run's weights. The
    job and its output."""
    blocker = sh(
        "sbatch", "--parsable", "-p", partition, "-w", "node2", "-o", "/dev/null", "--wrap", "sleep 300"
    ).stdout.strip()
    try:
        render_to(tmp_path, "tiny", one_node(partition, ["targets.slurm.max_restarts=0", *extra]))
        job = Job(tmp_path, fault=fault)
        wait_for(lambda: job.ledger("excluded"), 180, "node1's exclusion", explain=job.explain)
        requeued_at = time.time()
    finally:
        sh("scancel", blocker, check=False)
    assert job.ledger("excluded")[0].split()[2:] == ["node1", why]
    wait_excluded(job, "node1")
    release_after_requeue(job.id, requeued_at)
    job.done(240)
    assert job.ledger("state") == ["COMPLETED"], job.explain()
    assert [a.split()[2] for a in job.ledger("attempts")] == ["node1", "node2"]
    assert [e["step"] for e in job.events("resume")] == [resume_at] and [e["step"] for e in job.events("end")] == [6]
    assert_same_weights(job, reference)
    words = Excluded.WORDS[why]
    said = diagnose(tmp_path)
    assert f"job {job.id}: excluded node1 after attempt 0 and requeued: {words}" in said, said
    # status reads accounting, which records the end asynchronously (RUNNING a moment after the job left squeue)
    st = wait_for(
        lambda: (s := status(job))["state"] == "COMPLETED" and s, 60, "the end in accounting", explain=job.explain
    )
    assert st["excluded"] == [{"attempt": "0", "nodes": "node1", "why": words}], st
    return job, (tmp_path / f"tiny-{job.id}.out").read_text()


def test_a_gpu_that_fails_under_the_job_takes_its_node_out_and_the_run_resumes_elsewhere(
    tmp_path, partition, undisturbed
):
    """A rank's GPU fails at step 4 (the test-only `gpu_fault`, an uncorrectable ECC error: exit 44) on node1; the
    rank's record names its node, the job is requeued without node1 and resumes from the step-3 checkpoint on
    node2. torchrun's own restarts are off (max_restarts=0): in place they would meet the same GPU."""
    job, out = fails_on_node1_then_finishes_on_node2(
        tmp_path, partition, "gpu_fault:rank=0:step=4:node=node1", [], undisturbed("cpu:1"), Excluded.FAULT
    )
    assert "dtlaunch: node node1 failed under the job (exit 44" in out, out[-3000:]
    said = diagnose(tmp_path)  # what `dtlaunch logs NAME --diagnose` prints for this job's directory
    assert "finished at step 6" in said, said  # and the exclusion, with its reason (fails_on_node1...)


# On the host (no container) the same bad-node functions run through submitit in
# tests/slurm/test_submitit.py::test_a_hangs_culprit_node_is_left_out_through_submitit_too (one template include).
@pytest.mark.parametrize("where", ["pyxis"])
def test_a_hangs_culprit_node_is_excluded_and_the_run_resumes_elsewhere(
    tmp_path, partition, where, request, undisturbed
):
    """Rank 1 (of 2, on node1) stops at step 4: rank 0 times out in the step's collective (43), rank 1 is ended by
    its no-progress watchdog. The job script names node1 as the culprit's node (what `logs --diagnose` says, from
    the ranks' flight-recorder dumps), requeues without it, and the run resumes from step 3 on node2. In a pyxis
    container job the diagnosis runs in the image (the host's Python need not have dtlaunch): one srun task
    through the stub pyxis of tests/slurm/test_containers.py, whose image environment would break an import of
    dtlaunch unless the job's own environment is restored in the container."""
    extra = ["resources.accelerator=cpu:2", "training.timeout_seconds=10"]
    if where == "pyxis":
        log = request.getfixturevalue("stubs")
        extra += [f"resources.image={IMAGE}", "targets.slurm.container={runtime: pyxis}"]
    job, out = fails_on_node1_then_finishes_on_node2(
        tmp_path, partition, "hang:rank=1:step=4:node=node1", extra, undisturbed("cpu:2"), Excluded.HANG
    )
    assert "dtlaunch: the hang's likely culprit ran on node1" in out, out[-3000:]
    # what the job script read: the hung attempt's flight-recorder dumps, rank 1's behind rank 0's; and py-spy's
    # stacks of both ranks, rank 1's in the injected stop
    hung = job.run / "status" / f"{job.id}.0"
    found = hangs.verdict(hangs.read_dumps(hung), world=2)
    assert found and found[0] == [1] and "where rank 0 waited" in found[1], (found, sorted(os.listdir(hung)))
    stacks = (hung / "stacks-node1.txt").read_text()
    assert "=== rank 1 " in stacks and re.search(r"Faults.at_step_start \(\S*inject.py:\d+\)", stacks), stacks
    if where == "pyxis":
        asked = [c for c in calls(log) if c["cmd"].endswith("--diagnose")]
        assert (
            len(asked) == 1 and asked[0]["image"] == "nvcr.io#nvidia/pytorch:24.05-py3"
        )  # enroot's spelling, calls(log)


def test_a_hang_on_another_node_is_the_attempts_43_though_srun_killed_that_nodes_task(tmp_path, partition):
    """Two nodes, a rank each: rank 1 (node2) stops at step 4, rank 0 (node1) times out in the collective (43) and
    its node's task ends; srun then kills node2's task, whose hung rank ignores its TERM (137, srun's code, over
    node1's 43). The attempt's code is the ranks' own, 43, so the job script names node2 as the culprit's node and
    would leave it out (here the partition cannot hold the job without it, which the job says)."""
    extra = [
        "training.steps=8",
        "training.timeout_seconds=10",
        "targets.slurm.max_restarts=0",
        "targets.slurm.max_failures=0",
    ]
    render_to(tmp_path, "tiny", [*overrides(partition), *extra])
    job = Job(tmp_path, fault="hang:rank=1:step=4")
    job.done(240)
    out = (tmp_path / f"tiny-{job.id}.out").read_text()
    assert job.ledger("exit_codes")[0].split()[:2] == ["0", str(ExitCode.HANG)], job.explain()
    assert "dtlaunch: the hang's likely culprit ran on node2" in out, out[-3000:]
    assert "without node(s) node2 partition" in out, out[-3000:]


def test_a_slow_nodes_straggler_is_named_excluded_and_the_run_resumes_elsewhere(tmp_path, partition, undisturbed):
    """Rank 1 (of 2, on node1) runs every forward 0.5 s slower from step 2 (the test-only `slow` fault: a throttled
    GPU). From step 2 (the first step warms up) it is named at each log step; at step 4, the third in a row, with
    training.on_straggler: exit, the ranks save step 4 and rank 1 exits 44 naming node1; the job script requeues
    without node1 and the run resumes from step 4 on node2 and finishes."""
    job, out = fails_on_node1_then_finishes_on_node2(
        tmp_path,
        partition,
        "slow:rank=1:step=2:node=node1:seconds=0.5",
        ["resources.accelerator=cpu:2", "training.on_straggler=exit"],
        undisturbed("cpu:2"),
        Excluded.FAULT,
        resume_at=4,
    )
    assert "WARNING: straggler: rank 1 on node node1" in out and "persistent straggler at step 4" in out, out[-3000:]
    assert "dtlaunch: node node1 failed under the job (exit 44" in out, out[-3000:]
    (event,) = job.events("straggler")
    assert event["step"] == 4 and event["stragglers"][0]["node"] == "node1" and event["saved"]
    said = "\n".join(diagnose(tmp_path))
    assert "finished at step 6" in said.splitlines(), said  # what `dtlaunch logs NAME --diagnose` prints
    assert "straggler ended the attempt at step 4: rank 1 on node1" in said, said
    # every line of the ranks names its node and rank (what `dtlaunch logs NAME --node node1 --rank 1` prints)
    mine = list(of_ranks(out.splitlines(keepends=True), "node1", 1))
    assert any("this rank is a persistent straggler" in line for line in mine), out[-3000:]
    assert not any("step 6/6" in line for line in mine)  # the run's end was node2's
    assert any("step 6/6" in line for line in of_ranks(out.splitlines(), "node2", 0))
    (run,) = (tmp_path / "runs").iterdir()
    first = sorted((run / "logs").glob("attempt-*"))[0]  # attempt-JOB.0: the job's first allocation
    ranks = sorted(p.parent.name for p in (first / "node1").rglob("stderr.log"))
    assert ranks == ["0", "1"], ranks  # torchrun's file per local rank, beside the run's records
