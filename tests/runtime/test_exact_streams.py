"""Exactness across a crash, stream by stream: a user's own loop (the Job API, as in examples/plain-pytorch)
draws from every stream a training run depends on and records what it drew; a run killed in the middle of a
step's gradient accumulation and resumed from its last checkpoint must draw, from there on, exactly what an
undisturbed run drew. One test per stream, so a drift names its stream:

- data order: the sample indices of every micro-batch (DistributedSampler's shuffle, from the saved position)
- sampler epoch: the epoch each micro-batch belongs to (the run crosses two epoch boundaries after the resume)
- grad-accum position: each micro-batch's place in its step (a step cut short restarts at its first micro-batch)
- python, numpy and torch CPU generators: a number drawn from each per micro-batch, and dropout in the model
- per rank: each rank seeds its generators differently, so a checkpoint restoring one rank's streams on
  another fails too (each pipeline stage's generators are its ranks'); CUDA's generator is saved the same way,
  for the rank's own device (tests/runtime/test_gpu_paths.py; no GPU here)
- the LR schedule: the learning rate after every step (warm-up, then cosine)
- and the loss, which all of them feed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rt_harness import det_recipe, run_torchrun, write_plan

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 4
KILL = (7, 1)  # (step, micro-batch): rank 1 dies in the second micro-batch of step 7; step 4 is the newest save

SCRIPT = r"""
import json, os, random, signal, sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

import launcher

job = launcher.init()
seed = job.recipe.training.seed
torch.manual_seed(seed)  # the same initial weights on every rank
model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 4))
engine = job.wrap(model)
state = job.resume()
if not state:  # a fresh start: each rank's own streams (a resume restores them from its checkpoint)
    random.seed(100 + job.rank)
    np.random.seed(200 + job.rank)
    torch.manual_seed(300 + job.rank)
g = torch.Generator().manual_seed(seed)
x_all = torch.randn(80, 8, generator=g)
data = TensorDataset(x_all, (x_all @ torch.randn(8, 4, generator=g)).argmax(dim=1), torch.arange(80))
sampler = DistributedSampler(data, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=seed,
                             drop_last=True)
per_epoch = len(sampler) // job.micro_batch // job.grad_accum
epoch, batch = state.get("epoch", 0), state.get("batch", 0)
kill_step, kill_micro = (int(v) for v in os.environ.get("KILL_AT", "0:0").split(":"))
out = open(os.path.join(job.run_dir, f"streams-{job.rank}.jsonl"), "a")
step, total = job.step, job.total_steps
while step < total:
    sampler.set_epoch(epoch)
    rest = list(sampler)[batch * job.micro_batch:]
    loader = DataLoader(Subset(data, rest), batch_size=job.micro_batch, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))  # as examples/plain-pytorch does
    batches = iter(loader)
    while step < total and batch < per_epoch * job.grad_accum:
        for i in range(job.grad_accum):
            if job.rank == 1 and (step + 1, i) == (kill_step, kill_micro):
                os.kill(os.getpid(), signal.SIGKILL)
            x, y, idx = next(batches)
            loss = engine.accumulate(lambda m: F.cross_entropy(m(x), y), last=i == job.grad_accum - 1)
            out.write(json.dumps({
                "step": step + 1, "micro": i, "batch": batch, "epoch": epoch, "indices": idx.tolist(),
                "python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(1).item(),
                "loss": loss.item(),
            }) + "\n")
            out.flush()
            batch += 1
        engine.step()
        step += 1
        out.write(json.dumps({"step": step, "lr": engine.optimizer.param_groups[0]["lr"]}) + "\n")
        out.flush()
        job.step_done(step, loss=loss, state={"epoch": epoch, "batch": batch})
    epoch, batch = epoch + 1, 0
job.finish(state={"epoch": epoch, "batch": 0})
"""


def _recipe() -> dict:
    return det_recipe(
        "ddp",
        training={"steps": STEPS, "micro_batch": 4, "global_batch": 16, "warmup_steps": 3, "lr": 0.01},
        checkpoint={"every": EVERY, "keep": 5, "async": False, "export": "none"},
    )


def _run(tmp: Path, name: str, kill: tuple[int, int] | None = None) -> tuple[Path, list]:
    """The loop under torchrun; `kill`: rank 1 dies there, and the job runs again, as a requeue would."""
    run_dir = tmp / name
    plan = write_plan(run_dir, _recipe())
    script = tmp / "loop.py"
    script.write_text(SCRIPT)
    env = {"DTLAUNCH_PLAN": str(plan), "DTLAUNCH_RUN_DIR": str(run_dir)}
    worker = [sys.executable, str(script)]
    runs = [run_torchrun(plan, run_dir, env={**env, "KILL_AT": f"{kill[0]}:{kill[1]}"} if kill else env, worker=worker)]
    if kill:
        runs.append(run_torchrun(plan, run_dir, env=env, worker=worker))
    return run_dir, runs


def _final(run_dir: Path, rank: int) -> dict:
    """What each (step, micro-batch) drew as the run finally trained it (a later attempt's record wins)."""
    out: dict = {}
    for line in (run_dir / f"streams-{rank}.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[(r["step"], r.get("micro", "after"))] = r
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("streams")
    ref_dir, [ref] = _run(tmp, "reference")
    assert ref.rc == 0, ref.output[-3000:]
    crash_dir, [first, again] = _run(tmp, "crashed", kill=KILL)
    assert first.rc != 0 and again.rc == 0, again.output[-3000:]
    assert "resumed from step 4" in again.output, again.output[-3000:]
    return {rank: (_final(ref_dir, rank), _final(crash_dir, rank)) for rank in (0, 1)}


def _after_resume(records: dict) -> dict:
    return {k: v for k, v in records.items() if k[0] > 4}


FIELDS = {
    "data order": ["indices"],
    "sampler epoch": ["epoch"],
    "grad-accum position": ["batch", "micro"],
    "python generator": ["python"],
    "numpy generator": ["numpy"],
    "torch CPU generator": ["torch"],
    "LR schedule": ["lr"],
    "loss": ["loss"],
}


@pytest.mark.parametrize("stream", list(FIELDS))
def test_each_stream_resumes_exactly(runs, stream):
    for rank, (ref, crashed) in runs.items():
        want, got = _after_resume(ref), _after_resume(crashed)
        assert want.keys() == got.keys(), (rank, sorted(set(want) ^ set(got)))
        for key in sorted(want, key=lambda k: (k[0], str(k[1]))):
            for f in FIELDS[stream]:
                if f in want[key]:
                    assert got[key][f] == want[key][f], f"{stream} drifted on rank {rank} at {key}: {f}"
        values = [json.dumps([r.get(f) for f in FIELDS[stream]]) for r in want.values() if FIELDS[stream][0] in r]
        assert len(set(values)) > 1, f"{stream} never changes: this test could not see a drift"


def test_the_streams_are_the_ranks_own_and_cross_epochs(runs):
    """Each rank's generators differ (a swapped restore would show), and the resumed steps span three epochs."""
    (ref0, _), (ref1, _) = runs[0], runs[1]
    for f in ("python", "numpy", "torch", "indices"):
        assert ref0[(5, 0)][f] != ref1[(5, 0)][f], f
    assert {r["epoch"] for r in _after_resume(ref0).values() if "epoch" in r} == {0, 1, 2}
