"""Checkpoints you can trust, with real 2-rank torchrun runs: a checkpoint whose bytes changed (same size) or
that was truncated is reported in one line, marked CORRUPT and skipped for the one before it, and the run
ends exactly where an uninterrupted one ends; a diverging loss ends the run with its own exit code, commits
nothing while it is not finite, and keeps the last good checkpoint."""

from __future__ import annotations

import json

import pytest

from launcher.jobenv import ExitCode
from launcher.runtime.checkpoint import disk
from rt_harness import DET_EVERY, DET_STEPS, det_recipe, load_safetensors, run_torchrun, write_plan

pytestmark = pytest.mark.slow


def assert_same_weights(a, b):
    import torch

    wa, wb = load_safetensors(a), load_safetensors(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def newest_data_file(root, step):
    return disk.step_path(root, step) / "__1_0.distcp"


@pytest.mark.parametrize("damage", ["same-size", "truncated"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(reference, run_dir, trained, damage):
    ref = reference("ddp")
    plan = trained()  # a finished run's checkpoints
    root = run_dir / "checkpoints"
    assert disk.complete_steps(root)[-1] == DET_STEPS
    f = newest_data_file(root, DET_STEPS)
    data = bytearray(f.read_bytes())
    if damage == "same-size":  # bit rot in the middle of a tensor: only a checksum can see it
        mid = len(data) // 2
        data[mid : mid + 64] = b"\x7f" * 64
        f.write_bytes(bytes(data))
    else:
        f.write_bytes(bytes(data[: len(data) // 2]))
    again = run_torchrun(plan, run_dir)
    assert again.rc == 0, again.output[-3000:]
    previous = DET_STEPS - DET_EVERY
    lines = [ln for ln in again.stdout.splitlines() if f"checkpoint step {DET_STEPS} cannot be used" in ln]
    assert len(lines) == 1, again.stdout[-3000:]  # one clear line, not a traceback per rank and attempt
    assert f"trying step {previous}" in lines[0]
    assert ("has changed since it was written" if damage == "same-size" else "written as") in lines[0]
    assert "Traceback" not in again.stderr
    assert f"resumed from step {previous}" in again.stdout
    # Never deleted: when the run reached that step again, the corrupt one was moved aside for inspection.
    (aside,) = root.glob(f"{disk.step_name(DET_STEPS)}.corrupt-*")
    assert "__1_0.distcp" in json.loads((aside / disk.CORRUPT).read_text())["reason"]
    assert f"moved the corrupt checkpoint step {DET_STEPS} to {aside.name}" in again.stdout
    assert disk.complete_steps(root)[-1] == DET_STEPS  # a good one in its place
    # Never loaded: the run redid the steps after the previous checkpoint and ended with exactly the
    # uninterrupted run's weights.
    assert_same_weights(ref.run_dir / "model.safetensors", run_dir / "model.safetensors")
    losses = again.losses()
    assert all(losses[s] == ref.losses()[s] for s in range(previous + 1, DET_STEPS + 1))


def test_no_usable_checkpoint_stops_instead_of_starting_over(run_dir, trained):
    plan = trained(keep=(DET_STEPS,))  # a finished run that kept one checkpoint
    root = run_dir / "checkpoints"
    (only,) = disk.complete_steps(root)
    newest_data_file(root, only).write_bytes(b"")
    res = run_torchrun(plan, run_dir)
    assert ExitCode.CONFIG in res.worker_codes, res.output[-3000:]
    assert "no checkpoint in" in res.stderr and "can be used" in res.stderr and "move the directory aside" in res.stderr


def test_a_diverging_loss_ends_the_run_and_commits_nothing_meanwhile(run_dir):
    """NaN at steps 7, 8, 9 with a checkpoint every 2 steps and keep=2: the run exits DIVERGED (45) at step 9;
    the checkpoints of steps 8 (NaN) are never written; pruning kept the last good ones, 4 and 6."""
    recipe = det_recipe("ddp", training={"steps": 20, "max_nonfinite_steps": 3}, checkpoint={"every": 2, "keep": 2})
    plan = write_plan(run_dir, recipe)
    res = run_torchrun(plan, run_dir, env={"DTLAUNCH_FAULT": "nan_loss:step=7;nan_loss:step=8;nan_loss:step=9"})
    assert res.worker_codes and set(res.worker_codes) == {ExitCode.DIVERGED}, res.output[-3000:]
    assert disk.complete_steps(run_dir / "checkpoints") == [4, 6]
    assert "the loss was not finite for 3 steps in a row (steps 7-9)" in res.stderr
    statuses = res.statuses()
    assert {s["code"] for s in statuses.values()} == {ExitCode.DIVERGED}
