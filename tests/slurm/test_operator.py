"""SLURM as an operator uses it, on the real local cluster: the job's environment comes from its setup lines
(not from the machine that rendered it), a user's scancel ends a running job for good, a run longer than
its time limit continues across allocations without using up max_requeues, a run resubmitted by id resumes
its own checkpoints, and a checkpoint slower than torchrun's default 30 s grace survives a TERM.

The submitting shell here has a PATH without the test venv, like a login node's: only the recipe's
`targets.slurm.setup` lines can make torch and dtlaunch importable in the job.
"""

from __future__ import annotations

import time

import pytest

from launcher.jobenv import ExitCode
from launcher.runtime.checkpoint.disk import complete_steps
from slurmkit import Job, overrides, release_after_requeue, render_to, sacct_rows, sh, squeue_state, wait_for, wait_gone

pytestmark = pytest.mark.slow
BARE = {"PATH": "/usr/local/bin:/usr/bin:/bin"}  # a login shell with no environment activated


def activating(partition: str, extra=()) -> list[str]:
    return overrides(partition) + list(extra)  # overrides() activates the venv in targets.slurm.setup


def sacct_state(job_id: str) -> str:
    return sacct_rows(job_id, "JobID,State")[0][1]


def test_the_environment_comes_from_setup_not_from_the_rendering_machine(tmp_path, partition):
    """The job finds python in the environment its setup activates. Without setup, it fails once with exit 2
    and a message that says what to do, instead of a crash requeued max_failures times."""
    render_to(tmp_path / "ok", "tiny", activating(partition, ["training.steps=4"]))
    good = Job(tmp_path / "ok", env=BARE)
    render_to(tmp_path / "bare", "tiny", overrides(partition) + ["training.steps=4", "targets.slurm.setup=[]"])
    bare = Job(tmp_path / "bare", env=BARE)
    good.done(180)
    bare.done(120)
    assert good.ledger("state") == ["COMPLETED"], good.explain()
    assert bare.ledger("state") == ["FAILED"] and len(bare.ledger("attempts")) == 1, bare.explain()
    assert bare.ledger("failures") == [] and bare.ledger("requeues") == []
    out = (bare.out / f"tiny-{bare.id}.out").read_text()
    assert "cannot run this plan" in out and "targets.slurm.setup" in out
    assert sacct_state(bare.id) == "FAILED"


def test_scancel_of_a_running_job_ends_it_for_good(tmp_path, partition):
    render_to(tmp_path, "tiny", activating(partition, ["training.steps=2000"]))
    job = Job(tmp_path, env=BARE)
    wait_for(lambda: job.max_step() >= 3, 180, "step 3")
    sh("scancel", job.id)
    wait_gone(job.id, 60)
    time.sleep(5)  # a requeued job would be back in squeue by now (held, PENDING)
    assert squeue_state(job.id) == "" and sacct_state(job.id).startswith("CANCELLED"), sacct_state(job.id)
    assert job.ledger("requeues") == [] and job.ledger("continuations") == []
    (line,) = job.ledger("exit_codes")
    assert line.endswith(" TERM"), line  # SIGTERM came from SLURM: checkpoint, never requeue
    pre = job.events("preempt")
    assert pre and pre[0]["step"] in complete_steps(job.run / "checkpoints")  # they checkpointed on the way out


def test_a_run_longer_than_its_time_limit_continues_past_max_requeues(tmp_path, partition):
    """max_requeues=0 (no preemption may be retried), yet a time limit is not a preemption: each allocation
    ends with a checkpoint and the job continues in the next one, as long as it makes progress."""
    render_to(
        tmp_path,
        "tiny",
        activating(
            partition,
            [
                "training.steps=5000",
                # slurmctld passes over the time limits every 30 s and signals a job that will be within --signal's
                # seconds of its limit by the next pass: USR2 15-45 s into this 1-minute job, after its first steps,
                # with 15 s or more left to save and requeue
                "targets.slurm.time=1",
                "targets.slurm.signal_seconds=15",
                "targets.slurm.max_requeues=0",
            ],
        ),
    )
    job = Job(tmp_path, env=BARE)
    t0 = time.time()
    try:
        wait_for(lambda: job.ledger("continuations"), 180, "the time-limit continuation")
        requeued_at = time.time()
        print(f"\ntime limit -> checkpoint -> continuation after {requeued_at - t0:.1f}s")
        assert job.ledger("exit_codes")[0].split()[1:] == [str(ExitCode.PREEMPTED), "USR2"], job.explain()
        assert job.ledger("requeues") == [], "a time-limit continuation must not count as a preemption requeue"
        (pre,) = job.events("preempt")
        release_after_requeue(job.id, requeued_at)
        try:
            resumed = wait_for(lambda: job.events("resume"), 180, "the next allocation to resume")[0]
        except AssertionError as e:
            state = sh("scontrol", "show", "job", job.id, check=False).stdout
            raise AssertionError(f"{e}\n{state}\n{job.ledger('attempts')}\n{job.explain()}") from None
        assert resumed["step"] == pre["step"]
        wait_for(lambda: job.max_step() > pre["step"] + 2, 120, "progress in the second allocation")
        assert [a.split()[0] for a in job.ledger("attempts")] == ["0", "1"]
    finally:
        sh("scancel", job.id, check=False)


def test_resubmitting_a_run_by_id_resumes_its_checkpoints(tmp_path, partition):
    render_to(tmp_path, "tiny", activating(partition, ["training.steps=10"]))
    first = Job(tmp_path, env=BARE)
    first.done()
    assert complete_steps(first.run / "checkpoints")[-1] == 10, first.explain()
    render_to(tmp_path, "tiny", activating(partition, ["training.steps=16"]))  # the same directory, a longer run
    again = Job(tmp_path, env=BARE, run_id=first.id)
    again.done()
    assert again.id != first.id and again.run == first.run
    assert [e["step"] for e in again.events("resume")] == [10], again.explain()
    assert complete_steps(again.run / "checkpoints")[-1] == 16
    assert again.ledger("state") == ["COMPLETED"]


SLOW_SAVE_S = 34  # longer than torchrun's default 30 s between SIGTERM and SIGKILL


def test_a_checkpoint_slower_than_torchruns_default_grace_survives_term(tmp_path, partition):
    """TERM reaches torchrun and the workers (as a site's preemption or KillWait would); the save it starts
    takes SLOW_SAVE_S, longer than torchrun's default 30 s before SIGKILL. With the rendered --shutdown-timeout
    (checkpoint.grace_seconds) the checkpoint is committed and every rank reports PREEMPTED."""
    render_to(
        tmp_path,
        "tiny",
        activating(partition, ["training.steps=2000", "checkpoint.every=100000", "checkpoint.grace_seconds=90"]),
    )
    job = Job(tmp_path, env={**BARE, "DTLAUNCH_FAULT": f"slow_checkpoint:step=any:seconds={SLOW_SAVE_S}"})
    try:
        wait_for(lambda: job.max_step() >= 3, 180, "step 3")
        t_term = time.time()
        sh("scancel", "--signal=TERM", job.id)  # every step process, not the batch shell
        wait_for(lambda: job.events("preempt"), 120, "the checkpoint after TERM")
        took = time.time() - t_term
        (pre,) = job.events("preempt")
        assert took > SLOW_SAVE_S - 3, f"the slow checkpoint took only {took:.0f}s: the fault did not fire"
        assert pre["step"] in complete_steps(job.run / "checkpoints")
        wait_for(lambda: len(job.status()) == 2, 60, "both ranks' exit records")
        assert {s["code"] for s in job.status().values()} == {ExitCode.PREEMPTED}, job.status()
        print(f"\nTERM -> {SLOW_SAVE_S} s checkpoint committed after {took:.1f}s (torchrun's default grace is 30 s)")
    finally:
        sh("scancel", job.id, check=False)


@pytest.fixture(autouse=True)
def _no_leftover_jobs(slurm):
    """A failed test must not leave a job holding the cluster's two nodes for the next one."""
    yield
    for jid in sh("squeue", "-h", "-o", "%i", check=False).stdout.split():
        sh("scancel", jid, check=False)
