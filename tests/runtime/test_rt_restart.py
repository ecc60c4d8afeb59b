"""Nothing is lost: a rank SIGKILLed at a random step, restarted by torchrun, ends with weights
bit-identical to an uninterrupted run; a process killed while committing a checkpoint leaves the
previous checkpoint loadable and the partial one ignored."""

from __future__ import annotations

import os
import random

import pytest
import torch

from launcher.runtime.checkpoint import disk
from rt_harness import DET_EVERY, DET_STEPS, det_recipe, load_safetensors, run_torchrun, write_plan


def assert_bit_identical(a_path, b_path):
    a, b = load_safetensors(a_path), load_safetensors(b_path)
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[:3]}"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigkill_at_random_step_then_torchrun_restart_is_bit_identical(reference, run_dir, strategy):
    ref = reference(strategy)
    seed = int(os.environ.get("DTLAUNCH_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    kill_step, kill_rank = rng.randint(DET_EVERY + 2, DET_STEPS), rng.randint(0, 1)
    print(f"\n{strategy}: SIGKILL rank {kill_rank} at step {kill_step} (DTLAUNCH_TEST_SEED={seed})")
    res = run_torchrun(
        write_plan(run_dir, det_recipe(strategy)),
        run_dir,
        max_restarts=2,
        env={"DTLAUNCH_FAULT": f"sigkill:rank={kill_rank}:step={kill_step}"},
    )
    assert res.rc == 0, res.output[-4000:]
    assert f"FAULT INJECTION rank {kill_rank}: sigkill at step {kill_step}" in res.stderr
    # torchrun saw a worker die (the killed one, -9, or its peer, whose collective failed first) and
    # restarted the world once.
    assert res.worker_codes and set(res.worker_codes) <= {-9, 1}, res.stderr[-3000:]
    assert [e["attempt"] for e in res.events("start")] == [0, 1]
    resumed = [e["step"] for e in res.events("resume")]
    assert resumed and resumed[0] >= DET_EVERY and resumed[0] % DET_EVERY == 0, res.stdout[-3000:]
    assert f"resumed from step {resumed[0]}" in res.stdout
    assert_bit_identical(ref.run_dir / "model.safetensors", run_dir / "model.safetensors")
    # The logged losses after the restart are the uninterrupted run's, exactly.
    ref_losses, losses = ref.losses(), res.losses()
    assert all(losses[s] == ref_losses[s] for s in range(1, DET_STEPS + 1))
    print(f"{strategy}: resumed from step {resumed[0]}, {res.seconds:.1f}s, weights bit-identical")


@pytest.mark.slow
def test_kill_while_committing_a_checkpoint_keeps_the_previous_one(reference, run_dir):
    ref = reference("ddp")
    plan = write_plan(run_dir, det_recipe("ddp"))
    torn = 2 * DET_EVERY
    res = run_torchrun(plan, run_dir, env={"DTLAUNCH_FAULT": f"kill_in_checkpoint:rank=0:step={torn}"})
    assert res.rc != 0 and -9 in res.worker_codes, res.output[-3000:]
    root = run_dir / "checkpoints"
    # The torn save is on disk (every rank's files and manifest) but not committed; the one before it is.
    torn_dir = disk.step_path(root, torn)
    assert torn_dir.is_dir() and (torn_dir / disk.manifest_name(1)).is_file()
    assert not disk.is_complete(torn_dir)
    assert disk.complete_steps(root) == [DET_EVERY]
    # The next start ignores (and removes) the partial one, resumes from the previous, and ends exactly
    # where an uninterrupted run ends.
    res2 = run_torchrun(plan, run_dir)
    assert res2.rc == 0, res2.output[-3000:]
    assert f"removed partial checkpoint {disk.step_name(torn)} (never committed)" in res2.stdout
    assert f"resumed from step {DET_EVERY}" in res2.stdout
    assert disk.complete_steps(root) == [DET_EVERY, 2 * DET_EVERY, 3 * DET_EVERY]
    assert_bit_identical(ref.run_dir / "model.safetensors", run_dir / "model.safetensors")
