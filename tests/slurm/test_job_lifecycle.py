"""The whole job on real SLURM + srun + torchrun + the real runtime (`python -m launcher.runtime.train`): 2-node
rendezvous, USR2 -> checkpoint -> requeue -> resume, `scontrol requeue` -> resume, a crashing rank
restarted by torchrun without a requeue, a new job given the id of an earlier one in the same submit dir.

Nothing is stubbed: the rendered job.sbatch/step.sh start launcher.runtime.train on node1 and node2 (one CPU
rank each, gloo), and every assertion reads what the runtime and the script leave behind: the run dir
$SUBMIT_DIR/runs/$DTLAUNCH_RUN_ID (metrics.jsonl, checkpoints/, status/) and the job dir
$SUBMIT_DIR/jobs/$SLURM_JOB_ID (the ledgers and per-attempt logs).
"Nothing lost" is checked against one uninterrupted reference job of the same deterministic plan: the
losses an interrupted job logs after resuming equal the reference's at the same steps.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import pytest

from launcher.runtime.checkpoint.disk import complete_steps
from launcher.runtime.goodput import ledger
from slurmkit import (
    EVERY,
    STEPS,
    Job,
    assert_completed,
    assert_same_losses,
    overrides,
    release_after_requeue,
    render_to,
    sh,
    submit,
    wait_for,
)


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory) -> Job:
    """One uninterrupted 2-node job: test 1 checks it, the others compare their losses against it."""
    job = submit(tmp_path_factory.mktemp("reference"), slurm["SLURM_LOCAL_PARTITION"])
    t0 = time.time()
    job.done()
    print(f"\nreference job {job.id}: {time.time() - t0:.1f}s")
    return job


@pytest.fixture(scope="module")
def ref_losses(reference) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in reference.steps()}


def test_two_nodes_rendezvous_and_complete(reference):
    job = reference
    (start,) = job.events("start")
    assert start["world_size"] == 2 and start["attempt"] == 0, start
    (pre,) = job.events("preflight")
    assert pre["ok"] and pre["hosts"] == 2, pre  # one rank on node1, one on node2
    assert "rendezvous: 2 ranks on 2 host(s): node1, node2" in job.logs()
    out = (job.out / f"tiny-{job.id}.out").read_text()
    assert f"rendezvous node1:{10000 + int(job.id) % 20000}" in out
    assert [r["step"] for r in job.steps()] == list(range(1, STEPS + 1))
    assert not job.events("resume") and not job.events("preempt")
    (export,) = job.events("export")
    assert export["step"] == STEPS and Path(export["path"]).is_file() and Path(export["path"]).stat().st_size > 0
    assert complete_steps(job.run / "checkpoints") == [STEPS - EVERY, STEPS]  # keep=2
    assert_completed(job, attempts=1)
    assert job.ledger("exit_codes") == ["0 0 none"] and job.ledger("requeues") == [] == job.ledger("failures")


def test_usr2_to_batch_shell_checkpoints_requeues_and_resumes(tmp_path, partition, ref_losses):
    """What a time limit does (--signal=B:USR2@N), without waiting for one: USR2 to the batch shell."""
    job = submit(tmp_path, partition)
    wait_for(lambda: job.max_step() >= 3, 180, "step 3")
    sh("scancel", "--signal=USR2", "--batch", job.id)
    wait_for(lambda: job.ledger("requeues"), 90, "the script to requeue itself")
    requeued_at = time.time()
    assert job.ledger("exit_codes")[0] == "0 42 USR2", job.explain()
    (pre,) = job.events("preempt")
    saved = pre["step"]
    assert 3 <= saved < STEPS and pre["signal"] == "SIGUSR2", pre
    assert saved in complete_steps(job.run / "checkpoints")
    st = job.status()
    assert sorted(st) == [0, 1] and {s["code"] for s in st.values()} == {42}, st
    release_after_requeue(job.id, requeued_at)
    job.done()
    (resumed,) = job.events("resume")
    assert resumed["step"] == saved and resumed["world_size"] == 2, resumed
    assert [e["attempt"] for e in job.events("start")] == [0, 0]  # torchrun restart count: a new allocation
    assert [a.split()[0] for a in job.ledger("attempts")] == ["0", "1"]  # SLURM_RESTART_COUNT
    # Nothing lost, nothing redone: steps 1..saved, then saved+1..STEPS, with the reference's losses.
    assert [r["step"] for r in job.steps()] == list(range(1, STEPS + 1))
    assert_same_losses(job.steps(after=resumed["time"]), ref_losses)
    assert job.ledger("exit_codes") == ["0 42 USR2", "1 0 none"]
    assert_completed(job, attempts=2)


def test_scontrol_requeue_resumes_from_checkpoint(tmp_path, partition, ref_losses):
    job = submit(tmp_path, partition)
    wait_for(lambda: job.max_step() >= EVERY + 2, 180, f"step {EVERY + 2}")
    sh("scontrol", "requeue", job.id)
    t_requeue = time.time()
    release_after_requeue(job.id, t_requeue)
    resumed = wait_for(lambda: job.events("resume"), 180, "the resume event")[0]
    first = wait_for(lambda: job.steps(after=resumed["time"]), 120, "the first resumed step")[0]
    # The requeue SIGTERMs the steps; the runtime may still finish a step (and save it) before it stops.
    before = max(r["step"] for r in job.steps() if r["time"] < resumed["time"])
    saved_on_term = [e["step"] for e in job.events("preempt")]
    print(
        f"\nscontrol requeue: attempt 0 reached step {before} (checkpoint on SIGTERM: {saved_on_term or 'none'}), "
        f"resumed from step {resumed['step']}; first resumed step {first['step']} logged "
        f"{first['time'] - t_requeue:.1f}s after the requeue (incl. the >= 3 s before the hold is released)"
    )
    job.done()
    # The newest complete checkpoint: at most checkpoint.every steps are redone.
    assert EVERY <= resumed["step"] and before - EVERY <= resumed["step"] <= before, (before, resumed)
    assert all(s == resumed["step"] for s in saved_on_term), (saved_on_term, resumed)
    assert first["step"] == resumed["step"] + 1
    after = job.steps(after=resumed["time"])
    assert [r["step"] for r in after] == list(range(resumed["step"] + 1, STEPS + 1))
    assert_same_losses(after, ref_losses)
    assert [a.split()[0] for a in job.ledger("attempts")] == ["0", "1"]
    assert_completed(job, attempts=2)
    # Two allocations: the time between them the job was queued, holding no nodes (goodput's allocated time)
    first, second = (e["allocation_start"] for e in job.events("start"))
    assert t_requeue - 120 < first < t_requeue < second < resumed["time"], (first, t_requeue, second)
    led = ledger(job.metrics())
    assert led["queue"] > 0 and led["allocated"] == pytest.approx(led["elapsed"] - led["queue"])


def test_crashing_rank_is_restarted_by_torchrun_without_requeue(tmp_path, partition, ref_losses):
    crash_at = EVERY + 3  # the checkpoint at EVERY is committed by then
    job = submit(tmp_path, partition, fault=f"exit:rank=1:step={crash_at}:code=3")
    job.done()
    assert [e["attempt"] for e in job.events("start")] == [0, 1], job.explain()  # TORCHELASTIC_RESTART_COUNT
    (resumed,) = job.events("resume")
    assert resumed["step"] == EVERY, resumed
    assert f"FAULT INJECTION rank 1: exit at step {crash_at}" in job.logs()
    assert_same_losses(job.steps(after=resumed["time"]), ref_losses)
    assert [r["step"] for r in job.steps(after=resumed["time"])] == list(range(EVERY + 1, STEPS + 1))
    # Inside the same allocation: no requeue, SLURM_RESTART_COUNT stayed 0, one attempt.
    assert job.ledger("requeues") == [] and job.ledger("failures") == []
    assert [a.split()[0] for a in job.ledger("attempts")] == ["0"]
    assert job.ledger("exit_codes") == ["0 0 none"]
    assert_completed(job, attempts=1)
    # One allocation (its start the same in both start records), and the job script's record of the exit last
    starts = [e["allocation_start"] for e in job.events("start")]
    assert starts[0] == starts[1] and starts[0] <= job.events("start")[0]["time"], starts
    (exited,) = job.events("exited")
    assert exited["code"] == 0 and exited == job.metrics()[-1], job.metrics()[-3:]
    assert ledger(job.metrics())["queue"] == 0


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_new_job_with_an_earlier_jobs_id_trains_its_own_run_and_keeps_the_earlier_one(
    tmp_path, partition, reference, ref_losses
):
    """SLURM numbers jobs from FirstJobId again once its saved state is lost, so a new job can get the id of an
    earlier one submitted from the same directory (every `dtlaunch up` of a recipe uses one). Here the earlier
    job is the reference job's own files (ledgers, logs, its finished run and checkpoints), put under the id the
    new job got while SLURM held it. Without a guard the new job stops at once as "already finished"; it must
    train its own run from step 0, leave every earlier file as it was, and resume that run of its own, not the
    earlier one, when it is requeued."""
    render_to(tmp_path, "tiny", overrides(partition))
    job = Job(tmp_path, sbatch_args=("--hold",))
    earlier_run = tmp_path / "runs" / job.id
    shutil.copytree(reference.jobdir, job.jobdir)
    shutil.copytree(reference.run, earlier_run)
    earlier_ledgers, earlier_files = _tree(job.jobdir), _tree(earlier_run)
    sh("scontrol", "release", job.id)
    wait_for(
        lambda: list(tmp_path.glob(f"jobs/{job.id}.earlier-*")),
        120,
        "the earlier ledgers to move aside",
        explain=job.explain,
    )
    run_id = wait_for(
        lambda: (job.jobdir / "run_id").is_file() and (job.jobdir / "run_id").read_text().strip(),
        60,
        "the new job's run_id",
        explain=job.explain,
    )
    assert run_id.startswith(f"{job.id}-") and run_id != job.id, run_id
    job.run = tmp_path / "runs" / run_id
    wait_for(lambda: job.max_step() >= EVERY + 2, 180, f"step {EVERY + 2}", explain=job.explain)
    sh("scontrol", "requeue", job.id)
    t_requeue = time.time()
    release_after_requeue(job.id, t_requeue)
    job.done()
    (moved,) = tmp_path.glob(f"jobs/{job.id}.earlier-*")
    assert _tree(moved) == earlier_ledgers  # the earlier job's ledgers and logs, moved aside whole
    assert _tree(earlier_run) == earlier_files  # its run untouched: no checkpoint resumed into or pruned
    out = (tmp_path / f"tiny-{job.id}.out").read_text()
    assert f"job id {job.id} was used before" in out and f"this job's run is {run_id}" in out, out[-3000:]
    # The new run: its own steps from 1, then a resume from its own checkpoint after the requeue.
    start = job.events("start")
    assert [e["attempt"] for e in start] == [0, 0], job.explain()
    (resumed,) = job.events("resume")
    assert EVERY <= resumed["step"] < STEPS, resumed
    assert [r["step"] for r in job.steps(after=0)][:EVERY] == list(range(1, EVERY + 1))
    assert_same_losses(job.steps(), ref_losses)
    # The requeue SIGTERMs the steps; the runtime may still finish a step (and save it) before it stops. It resumes
    # from the newest complete checkpoint (at most checkpoint.every steps redone) and trains every step after it.
    before = max(r["step"] for r in job.steps() if r["time"] < resumed["time"])
    saved_on_term = [e["step"] for e in job.events("preempt")]
    assert before - EVERY <= resumed["step"] <= before, (before, resumed)
    assert all(s == resumed["step"] for s in saved_on_term), (saved_on_term, resumed)
    assert [r["step"] for r in job.steps(after=resumed["time"])] == list(range(resumed["step"] + 1, STEPS + 1))
    assert (job.jobdir / "run_id").read_text().strip() == run_id  # the requeue kept the run
    assert [a.split()[0] for a in job.ledger("attempts")] == ["0", "1"]
    assert_completed(job, attempts=2)
    # Two allocations: the time between them the job was queued, holding no nodes (goodput's allocated time)
    first, second = (e["allocation_start"] for e in start)
    assert t_requeue - 120 < first < t_requeue < second < resumed["time"], (first, t_requeue, second)
    led = ledger(job.metrics())
    assert led["queue"] > 0 and led["allocated"] == pytest.approx(led["elapsed"] - led["queue"])
