"""examples/plain-pytorch: a user's own ~100-line training loop on dtlaunch's library, run for real.

`dtlaunch up` trains it on 2 ranks; a preemption (the USR2 a scheduler sends, through the rendered launch
script) checkpoints and exits 42; the next `up` resumes, and every step's loss equals an uninterrupted
run's: nothing trained twice, nothing skipped. The same recipe runs under DDP and a ZeRO stage unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from testpaths import ROOT

pytestmark = pytest.mark.slow
EXAMPLE = ROOT / "examples" / "plain-pytorch" / "recipe.yaml"


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


STEPS = 24  # checkpoints at 10 and 20 (every: 10), the preemption's in between


def up(run_cli, out: Path, *sets: str):
    args = ["up", EXAMPLE, "-o", out, "--set", "training.log_every=1", "--set", f"training.steps={STEPS}"]
    for s in sets:
        args += ["--set", s]
    return run_cli(*args)


def test_example_trains_and_a_preempted_run_resumes_with_nothing_lost(run_cli, tmp_path):
    ref = tmp_path / "ref"
    code, out, err = up(run_cli, ref)
    assert code == 0, out + err
    reference = losses(ref)
    assert sorted(reference) == list(range(1, STEPS + 1)) and reference[STEPS] < reference[1] * 0.7

    # Preempt the same run through the rendered launch script, as a scheduler would.
    run = tmp_path / "run"
    code, out, err = run_cli(
        "render", EXAMPLE, "-t", "local", "-o", run, "--set", "training.log_every=1", "--set", f"training.steps={STEPS}"
    )
    assert code == 0, err
    proc = subprocess.Popen(
        ["bash", str(run / "launch.sh")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    t0 = time.time()
    while time.time() - t0 < 120:
        if (run / "metrics.jsonl").exists() and max(losses(run), default=0) >= 13:
            break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGUSR2)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 42, log[-3000:]
    stopped = max(losses(run))
    assert 13 <= stopped < STEPS and f"preempted at step {stopped}" in log
    status = json.loads((run / "status" / "rank-00000.json").read_text())
    assert status["code"] == 42 and status["step"] == stopped

    # Resume: `up` on the same directory continues from the preemption's checkpoint.
    code, out, err = up(run_cli, run)
    assert code == 0, out + err
    assert f"resumed from step {stopped}" in out
    resumed = losses(run)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == pytest.approx(reference, rel=1e-6, abs=1e-7), (
        "the resumed run must train exactly what the uninterrupted one did"
    )


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_example_runs_under_other_strategies(run_cli, tmp_path, strategy):
    out_dir = tmp_path / strategy
    code, out, err = up(run_cli, out_dir, f"parallelism.strategy={strategy}")
    assert code == 0, out + err
    ls = losses(out_dir)
    assert sorted(ls) == list(range(1, STEPS + 1)) and ls[STEPS] < ls[1]


def test_a_tensor_parallel_plan_is_refused_for_your_own_model(run_cli, tmp_path):
    """job.wrap cannot split a model it knows nothing about, nor run a loop of accumulate() as a pipeline: a
    tensor/pipeline plan ends with CONFIG (2) and says why, not a crash inside DTensor."""
    code, out, err = up(run_cli, tmp_path / "tp", "parallelism.tensor=2", "targets.local.max_restarts=0")
    assert code == 2, out + err
    assert "job.wrap trains your own model data-parallel only" in out + err
