"""Resuming on a different world size: a 2-rank checkpoint continues on 1 rank, whose checkpoint
continues on 2 again (DCP reshards; the data order is world-independent), and the loss carries on
as if nothing had happened. Also: SIGUSR2 -> checkpoint + exit 42 -> the next start resumes."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from launcher.jobenv import ExitCode
from launcher.runtime.checkpoint import disk
from rt_harness import (
    DET_EVERY,
    DET_STEPS,
    RunResult,
    det_recipe,
    kill_tree,
    load_safetensors,
    parse_worker_codes,
    recipe_dict,
    run_torchrun,
    start_torchrun,
    worker_ranks,
    write_plan,
)

TOL = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_resume_2_to_1_to_2_ranks_continues_the_loss(reference, run_dir, strategy):
    ref = reference(strategy)
    ref_losses = ref.losses()
    plan = write_plan(run_dir, det_recipe(strategy))
    root = run_dir / "checkpoints"
    root.mkdir()
    shutil.copytree(ref.run_dir / "checkpoints" / disk.step_name(DET_EVERY), root / disk.step_name(DET_EVERY))
    # 2 -> 1: resume the reference's step-4 checkpoint on one rank; preempt it at step 8.
    stop = 2 * DET_EVERY
    one = run_torchrun(plan, run_dir, nproc=1, env={"DTLAUNCH_FAULT": f"signal:rank=0:step={stop}:sig=USR2"})
    assert ExitCode.PREEMPTED in one.worker_codes, one.output[-3000:]
    assert f"resumed from step {DET_EVERY}" in one.stdout
    assert "world_size 2 -> 1" in one.stdout and "grad_accum 2 -> 4" in one.stdout
    l1 = one.losses()
    first = DET_EVERY + 1
    print(
        f"\n{strategy} 2->1: step {first} loss {l1[first]:.6f} vs uninterrupted {ref_losses[first]:.6f} "
        f"(diff {abs(l1[first] - ref_losses[first]):.2e})"
    )
    for s in range(first, stop + 1):
        assert abs(l1[s] - ref_losses[s]) < TOL, (s, l1[s], ref_losses[s])
    assert disk.newest_step(root) == stop
    # 1 -> 2: the 1-rank checkpoint continues on two ranks to the end.
    two = run_torchrun(plan, run_dir, nproc=2)
    assert two.rc == 0, two.output[-3000:]
    assert f"resumed from step {stop}" in two.stdout and "world_size 1 -> 2" in two.stdout
    l2 = two.losses()
    print(
        f"{strategy} 1->2: step {stop + 1} loss {l2[stop + 1]:.6f} vs uninterrupted {ref_losses[stop + 1]:.6f} "
        f"(diff {abs(l2[stop + 1] - ref_losses[stop + 1]):.2e})"
    )
    for s in range(stop + 1, DET_STEPS + 1):
        assert abs(l2[s] - ref_losses[s]) < TOL, (s, l2[s], ref_losses[s])
    a, b = load_safetensors(ref.run_dir / "model.safetensors"), load_safetensors(run_dir / "model.safetensors")
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"{strategy}: final weights max |diff| vs uninterrupted = {worst:.2e}")
    assert worst < 1e-4


def _wait_for_step(run_dir, step: int, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    p = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"torchrun ended early: {proc.stderr.read()[-3000:]}")
        if p.exists() and any(f'"step": {step},' in line for line in p.read_text().splitlines()):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {timeout}s")


@pytest.mark.slow
def test_sigusr2_checkpoints_exits_42_and_the_next_start_resumes(run_dir):
    # The signal follows step 3's record within ~0.1 s (the poll) and the ranks stop at the next step boundary
    # (step 4 here); the 12 steps after it (~0.15 s each) are the margin for a late signal, and all the next
    # start has to train.
    steps = 16
    plan = write_plan(run_dir, recipe_dict(training={"steps": steps}, checkpoint={"every": 100}))
    proc = start_torchrun(plan, run_dir)
    try:
        _wait_for_step(run_dir, 3, proc)
        workers = worker_ranks(proc.pid)
        assert sorted(workers) == [0, 1], workers
        # Signal ONE worker directly (not torchrun): the flag travels with the per-step collective,
        # so both ranks stop at the same step boundary.
        os.kill(workers[1], signal.SIGUSR2)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    codes = parse_worker_codes(err)
    assert codes and all(c == ExitCode.PREEMPTED for c in codes), err[-3000:]
    res = RunResult(proc.returncode, out, err, 0.0, run_dir, codes)
    pre = res.events("preempt")
    assert len(pre) == 1 and pre[0]["ranks"] == [1], pre  # only rank 1 was signalled; both stopped
    assert "preemption signal (a signal on rank 1)" in out
    saved = pre[0]["step"]
    assert 3 <= saved < steps
    assert disk.newest_step(run_dir / "checkpoints") == saved
    assert {s["code"] for s in res.statuses().values()} == {ExitCode.PREEMPTED}
    assert f"preempted at step {saved}" in err
    # The next start picks the preemption checkpoint up and finishes.
    again = run_torchrun(plan, run_dir)
    assert again.rc == 0, again.output[-3000:]
    assert f"resumed from step {saved}" in again.stdout
    assert sorted(again.losses()) == list(range(1, steps + 1))
    # The plot of this interrupted run: one curve, with the preemption and the resume marked.
    from launcher.cli.plot import plot_metrics

    png = plot_metrics(run_dir, run_dir / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    print(f"\nSIGUSR2 at step ~{saved}: exit {ExitCode.PREEMPTED}, resumed from step {saved}, finished {steps} steps")
