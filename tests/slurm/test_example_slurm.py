"""examples/plain-pytorch on the real local SLURM cluster: the user's own script (shipped as code/ in the
submit directory) trains on 2 nodes, survives the USR2 a time limit or a preemption sends (checkpoint,
exit 42, the job script requeues itself), and the resumed run's losses equal an uninterrupted job's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from launcher.plan import make_plan
from launcher.recipe import load
from launcher.render import render
from launcher.runtime.checkpoint.disk import complete_steps
from slurmkit import VENV_ACTIVATE, Job, assert_completed, release_after_requeue, sh, wait_for

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plain-pytorch" / "recipe.yaml"
STEPS = 24


def submit_example(out: Path, partition: str) -> Job:
    r = load(
        EXAMPLE,
        [
            f"targets.slurm.partition={partition}",
            "resources.nodes=2",
            "resources.accelerator=cpu:1",
            f"training.steps={STEPS}",
            "training.log_every=1",
            "targets.slurm.max_requeues=2",
            f'targets.slurm.setup=["source {VENV_ACTIVATE}"]',
        ],
    )
    art = render(r, make_plan(r), "slurm")
    art.write(out)
    assert (out / "code" / "train.py").is_file()
    return Job(out)


def losses(job: Job) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in job.steps()}


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory) -> dict[int, float]:
    job = submit_example(tmp_path_factory.mktemp("example-ref"), slurm["SLURM_LOCAL_PARTITION"])
    job.done()
    assert job.ledger("state") == ["COMPLETED"], job.explain()
    return losses(job)


def test_user_script_survives_a_preemption_on_slurm(tmp_path, partition, reference):
    assert sorted(reference) == list(range(1, STEPS + 1))
    job = submit_example(tmp_path, partition)
    wait_for(lambda: job.max_step() >= 12, 180, "step 12")
    sh("scancel", "--signal=USR2", "--batch", job.id)
    wait_for(lambda: job.ledger("requeues"), 90, "the script to requeue itself")
    requeued_at = time.time()
    assert job.ledger("exit_codes")[0] == "0 42 USR2", job.explain()
    st = job.status()
    assert sorted(st) == [0, 1] and {s["code"] for s in st.values()} == {42}, st
    saved = st[0]["step"]
    (pre,) = job.events("preempt")
    assert pre["step"] == saved and 12 <= saved < STEPS and pre["signal"] == "SIGUSR2", pre
    assert saved in complete_steps(job.run / "checkpoints")
    release_after_requeue(job.id, requeued_at)
    job.done()
    assert job.ledger("state") == ["COMPLETED"], job.explain()
    (resumed,) = job.events("resume")
    assert resumed["step"] == saved and resumed["world_size"] == 2, resumed
    assert [e["attempt"] for e in job.events("start")] == [0, 0]  # torchrun restart count: a new allocation
    assert [a.split()[0] for a in job.ledger("attempts")] == ["0", "1"]  # SLURM_RESTART_COUNT
    # Nothing lost, nothing redone: steps 1..saved, then saved+1..STEPS, with the reference's losses.
    assert [r["step"] for r in job.steps()] == list(range(1, STEPS + 1))
    got = losses(job)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step
    assert job.ledger("exit_codes") == ["0 42 USR2", "1 0 none"]
    assert_completed(job, attempts=2, steps=STEPS)
