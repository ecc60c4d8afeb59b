"""The job script's lifecycle on real SLURM + srun + torchrun: 2-node rendezvous, USR2 -> checkpoint ->
requeue -> resume, `scontrol requeue` -> resume, a crashing rank restarted by torchrun without a requeue.

The training module is a small stand-in (STUB below, put first on PYTHONPATH, which the job inherits
through sbatch's --export=ALL) that keeps the runtime's contract: it resumes from a checkpoint in
$DTLAUNCH_RUN_DIR, and on USR2/TERM it checkpoints and exits 42. It is a stand-in for launcher.train
only, so that these tests pin the shell logic independently of the training code; everything else
(sbatch, slurmctld, srun, torchrun, gloo, signals) is real.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from slurmkit import render_to, sbatch, sh, squeue_state, wait_for, wait_gone

STUB = r'''
import json, os, signal, sys, time
import torch.distributed as dist
got = []
signal.signal(signal.SIGUSR2, lambda s, f: got.append("USR2"))
signal.signal(signal.SIGTERM, lambda s, f: got.append("TERM"))
rank, run = int(os.environ["RANK"]), os.environ["DTLAUNCH_RUN_DIR"]
dist.init_process_group("gloo")
t = __import__("torch").ones(1); dist.all_reduce(t)
ck = os.path.join(run, "stub-ckpt")
step = int(open(ck).read()) if os.path.exists(ck) else 0
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
def log(**kw):
    print(f"rank {rank}: {kw}", flush=True)
    if rank == 0:
        with open(os.path.join(run, "stub-events.jsonl"), "a") as f:
            f.write(json.dumps({"t": time.time(), **kw}) + "\n")
log(event="start", step=step, world=int(t.item()), restart=restart, host=os.uname().nodename,
    run_id=os.environ["DTLAUNCH_RUN_ID"], attempt=os.environ.get("SLURM_RESTART_COUNT", "0"))
crash = os.environ.get("STUB_CRASH_RANK_AT")
while step < int(os.environ.get("STUB_STEPS", "20")):
    time.sleep(0.25)
    flag = torch_flag = __import__("torch").tensor([1.0 if got else 0.0]); dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        if rank == 0: open(ck, "w").write(str(step))
        log(event="preempted", step=step)
        dist.destroy_process_group()
        sys.exit(42)
    step += 1
    log(event="step", step=step)
    if rank == 0 and step % 2 == 0: open(ck, "w").write(str(step))
    if crash and rank == 1 and restart == 0 and step == int(crash):
        os._exit(3)
log(event="done", step=step)
dist.barrier()
dist.destroy_process_group()
'''


@pytest.fixture
def job_dir(tmp_path, partition, monkeypatch):
    stub = tmp_path / "stub" / "launcher"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "train.py").write_text(STUB)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "stub"))
    out = tmp_path / "job"
    render_to(out, "tiny", [f"targets.slurm.partition={partition}", "resources.nodes=2",
                            "targets.slurm.max_requeues=2", "targets.slurm.max_restarts=2"])
    return out


def events(out: Path, job: str) -> list[dict]:
    p = out / "jobs" / job / "stub-events.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def ledger(out: Path, job: str, name: str) -> list[str]:
    p = out / "jobs" / job / name
    return p.read_text().splitlines() if p.exists() else []


def release_after_requeue(job: str, requeued_at: float) -> None:
    """Skip SLURM's ~121 s requeue hold; it must not happen in the requeue's own second (shared notes)."""
    wait_for(lambda: "PENDING" in squeue_state(job), 30, "the job to be pending after the requeue")
    time.sleep(max(0.0, requeued_at + 3.0 - time.time()))
    sh("scontrol", "update", f"JobId={job}", "StartTime=now")


def test_two_nodes_rendezvous_and_complete(job_dir):
    job = sbatch(job_dir)
    wait_gone(job, 120)
    ev = events(job_dir, job)
    start = ev[0]
    assert start["world"] == 4 and start["run_id"] == job  # 2 nodes x 2 ranks met at node1
    assert ev[-1] == {**ev[-1], "event": "done", "step": 20}
    assert ledger(job_dir, job, "state") == ["COMPLETED"] and (job_dir / "jobs" / job / "finished").exists()
    assert len(ledger(job_dir, job, "attempts")) == 1 and ledger(job_dir, job, "exit_codes") == ["0 0 none"]
    out = (job_dir / f"tiny-{job}.out").read_text()
    assert f"rendezvous node1:{20000 + int(job) % 20000}" in out
    assert (job_dir / "jobs" / job / "logs" / "attempt-0.log").read_text().strip()


def test_usr2_to_batch_shell_checkpoints_requeues_and_resumes(job_dir):
    """What a time limit does (--signal=B:USR2@N), without waiting for one: USR2 to the batch shell."""
    job = sbatch(job_dir)
    wait_for(lambda: any(e.get("step", 0) >= 5 for e in events(job_dir, job)), 90, "step 5")
    sh("scancel", "--signal=USR2", "--batch", job)
    wait_for(lambda: ledger(job_dir, job, "requeues"), 60, "the script to requeue itself")
    requeued_at = time.time()
    assert ledger(job_dir, job, "exit_codes")[0] == "0 42 USR2"
    saved = next(e["step"] for e in events(job_dir, job) if e["event"] == "preempted")
    release_after_requeue(job, requeued_at)
    wait_gone(job, 120)
    ev = events(job_dir, job)
    resumed = [e for e in ev if e["event"] == "start"][1]
    assert resumed["step"] == saved and resumed["attempt"] == "1" and resumed["run_id"] == job
    assert ev[-1]["event"] == "done" and ev[-1]["step"] == 20
    assert ledger(job_dir, job, "state") == ["COMPLETED"] and len(ledger(job_dir, job, "attempts")) == 2


def test_scontrol_requeue_resumes_from_checkpoint(job_dir):
    job = sbatch(job_dir)
    wait_for(lambda: any(e.get("step", 0) >= 6 for e in events(job_dir, job)), 90, "step 6")
    sh("scontrol", "requeue", job)
    t_requeue = time.time()
    release_after_requeue(job, t_requeue)
    resumed = wait_for(lambda: [e for e in events(job_dir, job) if e["event"] == "start"][1:], 90, "the resumed start")[0]
    first_step = wait_for(lambda: [e for e in events(job_dir, job) if e["t"] > resumed["t"] and e["event"] == "step"],
                          60, "the first resumed step")[0]
    print(f"scontrol requeue -> resumed step {first_step['step']}: {first_step['t'] - t_requeue:.1f}s")
    wait_gone(job, 120)
    ev = events(job_dir, job)
    before = max(e["step"] for e in ev if e["event"] == "step" and e["t"] < t_requeue)
    assert resumed["step"] >= before - 2  # at most the steps since the last checkpoint (every 2) are redone
    assert resumed["attempt"] == "1" and ev[-1]["event"] == "done" and ev[-1]["step"] == 20
    assert ledger(job_dir, job, "state") == ["COMPLETED"]


def test_crashing_rank_is_restarted_by_torchrun_without_requeue(job_dir, monkeypatch):
    monkeypatch.setenv("STUB_CRASH_RANK_AT", "4")
    job = sbatch(job_dir)
    wait_gone(job, 120)
    starts = [e for e in events(job_dir, job) if e["event"] == "start"]
    assert [s["restart"] for s in starts] == [0, 1] and {s["attempt"] for s in starts} == {"0"}
    assert events(job_dir, job)[-1]["event"] == "done"
    assert ledger(job_dir, job, "requeues") == [] and ledger(job_dir, job, "failures") == []
    assert ledger(job_dir, job, "state") == ["COMPLETED"]
