"""The whole job on real SLURM + srun + torchrun + the real runtime (`python -m launcher.train`): 2-node
rendezvous, USR2 -> checkpoint -> requeue -> resume, `scontrol requeue` -> resume, a crashing rank
restarted by torchrun without a requeue.

Nothing is stubbed: the rendered job.sbatch/step.sh start launcher.train on node1 and node2 (one CPU
rank each, gloo), and every assertion reads what the runtime and the script leave in the run dir
$SUBMIT_DIR/jobs/$SLURM_JOB_ID: metrics.jsonl (steps and events), checkpoints/, status/, the ledgers.
"Nothing lost" is checked against one uninterrupted reference job of the same deterministic plan: the
losses an interrupted job logs after resuming equal the reference's at the same steps.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from launcher.runtime.ckptdir import complete_steps
from launcher.runtime.metrics import read_metrics
from slurmkit import render_to, sh, squeue_state, wait_for, wait_gone

STEPS, EVERY = 20, 5
TOL = 1e-5


def overrides(partition: str) -> list[str]:
    return [f"targets.slurm.partition={partition}", "resources.nodes=2", "resources.accelerator=cpu:1",
            f"training.steps={STEPS}", f"checkpoint.every={EVERY}", "training.deterministic=true",
            "targets.slurm.max_requeues=2", "targets.slurm.max_restarts=2"]


class Job:
    """One submitted job: its id, submit dir and run dir, and readers for what it left there."""

    def __init__(self, out: Path, fault: str | None = None):
        env = {k: v for k, v in os.environ.items() if k != "DTLAUNCH_FAULT"}
        if fault:
            env["DTLAUNCH_FAULT"] = fault  # the job inherits it: sbatch's default --export=ALL
        p = sh("sbatch", "--parsable", "job.sbatch", cwd=out, env=env)
        self.out, self.id = out, p.stdout.strip().split(";")[0]
        self.run = out / "jobs" / self.id

    def metrics(self) -> list[dict]:
        return read_metrics(self.run) if (self.run / "metrics.jsonl").exists() else []

    def steps(self, after: float = 0.0) -> list[dict]:
        return [r for r in self.metrics() if "event" not in r and "loss" in r and r["time"] > after]

    def events(self, name: str) -> list[dict]:
        return [r for r in self.metrics() if r.get("event") == name]

    def max_step(self) -> int:
        return max((r["step"] for r in self.steps()), default=0)

    def ledger(self, name: str) -> list[str]:
        p = self.run / name
        return p.read_text().splitlines() if p.exists() else []

    def status(self) -> dict[int, dict]:
        return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in (self.run / "status").glob("rank-*.json")}

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted((self.run / "logs").glob("attempt-*.log")))

    def done(self, timeout: float = 240) -> None:
        try:
            wait_gone(self.id, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- job logs ---\n{self.logs()[-4000:]}") from None

    def explain(self) -> str:
        out = self.out / f"tiny-{self.id}.out"
        return f"--- {out.name} ---\n{out.read_text()[-6000:] if out.exists() else '(missing)'}"


def submit(out: Path, partition: str, fault: str | None = None) -> Job:
    render_to(out, "tiny", overrides(partition))
    return Job(out, fault)


def assert_completed(job: Job, attempts: int) -> None:
    assert job.ledger("state") == ["COMPLETED"], job.explain()
    assert (job.run / "finished").exists()
    assert len(job.ledger("attempts")) == attempts, job.ledger("attempts")
    end = job.events("end")
    assert [e["step"] for e in end] == [STEPS], job.explain()
    st = job.status()
    assert sorted(st) == [0, 1] and all(s["code"] == 0 and s["step"] == STEPS for s in st.values()), st
    assert complete_steps(job.run / "checkpoints")[-1] == STEPS


def assert_same_losses(records: list[dict], reference: dict[int, float]) -> None:
    assert records, "no steps logged"
    for r in records:
        assert abs(r["loss"] - reference[r["step"]]) <= TOL, (r["step"], r["loss"], reference[r["step"]])


def release_after_requeue(job: str, requeued_at: float) -> None:
    """Skip SLURM's ~121 s requeue hold; it must not happen in the requeue's own second (shared notes)."""
    wait_for(lambda: "PENDING" in squeue_state(job), 30, "the job to be pending after the requeue")
    time.sleep(max(0.0, requeued_at + 3.0 - time.time()))
    sh("scontrol", "update", f"JobId={job}", "StartTime=now")


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
    start, = job.events("start")
    assert start["world_size"] == 2 and start["attempt"] == 0, start
    pre, = job.events("preflight")
    assert pre["ok"] and pre["hosts"] == 2, pre  # one rank on node1, one on node2
    assert "rendezvous: 2 ranks on 2 host(s): node1, node2" in job.logs()
    out = (job.out / f"tiny-{job.id}.out").read_text()
    assert f"rendezvous node1:{20000 + int(job.id) % 20000}" in out
    assert [r["step"] for r in job.steps()] == list(range(1, STEPS + 1))
    assert not job.events("resume") and not job.events("preempt")
    export, = job.events("export")
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
    pre, = job.events("preempt")
    saved = pre["step"]
    assert 3 <= saved < STEPS and pre["signal"] == "SIGUSR2", pre
    assert saved in complete_steps(job.run / "checkpoints")
    st = job.status()
    assert sorted(st) == [0, 1] and {s["code"] for s in st.values()} == {42}, st
    release_after_requeue(job.id, requeued_at)
    job.done()
    resumed, = job.events("resume")
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
    print(f"\nscontrol requeue: attempt 0 reached step {before} (checkpoint on SIGTERM: {saved_on_term or 'none'}), "
          f"resumed from step {resumed['step']}; first resumed step {first['step']} logged "
          f"{first['time'] - t_requeue:.1f}s after the requeue (incl. the >= 3 s before the hold is released)")
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


def test_crashing_rank_is_restarted_by_torchrun_without_requeue(tmp_path, partition, ref_losses):
    crash_at = EVERY + 3  # the checkpoint at EVERY is committed by then
    job = submit(tmp_path, partition, fault=f"exit:rank=1:step={crash_at}:code=3")
    job.done()
    assert [e["attempt"] for e in job.events("start")] == [0, 1], job.explain()  # TORCHELASTIC_RESTART_COUNT
    resumed, = job.events("resume")
    assert resumed["step"] == EVERY, resumed
    assert f"FAULT INJECTION rank 1: exit at step {crash_at}" in job.logs()
    assert_same_losses(job.steps(after=resumed["time"]), ref_losses)
    assert [r["step"] for r in job.steps(after=resumed["time"])] == list(range(EVERY + 1, STEPS + 1))
    # Inside the same allocation: no requeue, SLURM_RESTART_COUNT stayed 0, one attempt.
    assert job.ledger("requeues") == [] and job.ledger("failures") == []
    assert [a.split()[0] for a in job.ledger("attempts")] == ["0"]
    assert job.ledger("exit_codes") == ["0 0 none"]
    assert_completed(job, attempts=1)


def test_real_time_limit_signal_checkpoints_and_requeues(tmp_path, partition):
    """A real `--time` limit: slurmctld sends `--signal=B:USR2@N` to the batch shell (up to 30 s early, on
    its 30 s tick), the runtime checkpoints at the next step and exits 42, and the script requeues the job.
    The job is cancelled after the requeue: resuming is what the tests above prove."""
    render_to(tmp_path, "tiny", overrides(partition) + [
        "training.steps=2000", "targets.slurm.time=2", "targets.slurm.signal_seconds=60"])
    t0 = time.time()
    job = Job(tmp_path)
    try:
        wait_for(lambda: job.ledger("requeues"), 150, "the time-limit signal to requeue the job")
        print(f"\ntime-limit USR2 -> checkpoint -> requeue after {time.time() - t0:.1f}s")
        assert job.ledger("exit_codes")[0] == "0 42 USR2", job.explain()
        pre, = job.events("preempt")
        assert pre["signal"] == "SIGUSR2" and 0 < pre["step"] < 2000, pre
        assert pre["step"] in complete_steps(job.run / "checkpoints")
        wait_for(lambda: "PENDING" in squeue_state(job.id), 60, "the requeued job to be pending again")
    finally:
        sh("scancel", job.id, check=False)
