"""The pre-start check inside torchrun's agent (`python -m launcher.runtime.elastic --check-plan=PLAN ...`, as the SLURM
step script starts it): a node that passes starts its workers; one that fails ends the agent with the check's
code before it joins the rendezvous, without starting a worker, and a broken node is named in the job's
bad-node file for the job script to exclude. Real torchrun (one node, one worker), real plan files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import jobenv
from launcher.jobenv import ExitCode
from launcher.plan import make_plan
from launcher.recipe import load
from launcher.render import render
from launcher.render.torchrun import SIGNALS
from rt_harness import free_port
from testpaths import RECIPES

pytestmark = pytest.mark.slow

WORKER = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('trained')"


def _agent_cmd(tmp_path: Path, plan: Path, *extra: str) -> tuple[list[str], dict, Path]:
    """The agent as the job scripts start it, one node and one worker that marks `trained`: (argv, env, trained)."""
    worker, trained = tmp_path / "worker.py", tmp_path / "trained"
    worker.write_text(WORKER)
    argv = [
        sys.executable,
        "-m",
        "launcher.runtime.elastic",
        f"--check-plan={plan}",
        "--nnodes=1",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--max-restarts=0",
        *extra,
        str(worker),
        str(trained),
    ]
    return argv, {k: v for k, v in os.environ.items() if not k.startswith("DTLAUNCH_")}, trained


def _agent(tmp_path: Path, plan: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    argv, base, trained = _agent_cmd(tmp_path, plan)
    p = subprocess.run(argv, env={**base, **env}, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    return p, trained


def _plan(tmp_path: Path) -> Path:
    rec = load(RECIPES / "tiny.yaml", [f"checkpoint.dir={tmp_path / 'ck'}"])
    render(rec, make_plan(rec), "slurm").write(tmp_path / "job")
    return tmp_path / "job" / "plan.json"


def test_a_node_that_passes_its_check_starts_its_workers(tmp_path):
    p, trained = _agent(tmp_path, _plan(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "dtlaunch: check ok:" in p.stdout and trained.read_text() == "trained"


def test_a_broken_node_ends_its_agent_with_44_named_and_no_worker_started(tmp_path):
    bad = tmp_path / "bad_nodes"
    p, trained = _agent(
        tmp_path,
        _plan(tmp_path),
        **{jobenv.FAULT: "bad_node:step=0", jobenv.BAD_NODES: str(bad), "SLURMD_NODENAME": "gpu17"},
    )
    assert p.returncode == ExitCode.PREFLIGHT, p.stdout + p.stderr
    assert "node gpu17 cannot run the plan" in p.stderr and "uncorrectable ECC error" in p.stderr
    assert bad.read_text() == "gpu17\n" and not trained.exists()


def test_a_plan_the_node_cannot_read_ends_its_agent_with_config(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text("{not json")
    p, trained = _agent(tmp_path, plan)
    assert p.returncode == ExitCode.CONFIG, p.stdout + p.stderr
    assert "cannot read the plan" in p.stderr and not trained.exists()


def test_a_torch_that_cannot_load_its_libraries_ends_the_agent_with_config_and_a_record(tmp_path):
    """torch's import raises OSError, not ImportError, for a CUDA library it cannot load (an image without
    libcudart): that is the environment's fault, a final CONFIG with a record, not a crash to retry."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        'raise OSError("libcudart.so.12: cannot open shared object file: No such file or directory")\n'
    )
    run = tmp_path / "run"
    p, trained = _agent(
        tmp_path,
        _plan(tmp_path),
        PYTHONPATH=os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")]),
        **{jobenv.RUN_DIR: str(run), "SLURMD_NODENAME": "gpu17"},
    )
    assert p.returncode == ExitCode.CONFIG, p.stdout + p.stderr
    assert "node gpu17: cannot import torch: libcudart.so.12" in p.stderr and not trained.exists()
    (record,) = run.rglob(f"{jobenv.CHECK_RECORD_PREFIX}gpu17.code")
    assert record.read_text().split()[0] == str(int(ExitCode.CONFIG))


def _catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for `sig` (the kernel's SigCgt mask in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR2"])
def test_a_stop_before_the_workers_start_ends_the_agent_as_preempted(tmp_path, sig):
    """`dtlaunch down`, a cancel or a preemption while the agent is still starting (importing torch, checking the
    node, in the rendezvous): torchrun's own handlers come only with the workers; without the agent's, the signal
    would kill it, which the job scripts read as a lost job. It ends with PREEMPTED and one line, no worker
    started: nothing trained, so nothing is lost."""
    import signal
    import time

    argv, base, trained = _agent_cmd(tmp_path, _plan(tmp_path), f"--signals-to-handle={SIGNALS}")
    p = subprocess.Popen(argv, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    signum = signal.Signals[sig]
    t0 = time.monotonic()
    while not _catches(p.pid, signum) and p.poll() is None and time.monotonic() - t0 < 30:
        time.sleep(0.01)
    p.send_signal(signum)
    out, err = p.communicate(timeout=60)
    assert p.returncode == ExitCode.PREEMPTED, out + err
    assert f"dtlaunch: stopped by {sig} before training began" in err and "Traceback" not in err, err
    assert not trained.exists()
