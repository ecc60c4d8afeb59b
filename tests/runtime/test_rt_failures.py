"""Failures end the job fast, with the right exit code and a message that names the step:
a stuck rank (collective timeout), an off-by-one rank (step agreement), a rank that skips a
collective, a failed preflight, and checkpoint layouts that cannot be resumed."""

from __future__ import annotations

import re
import shutil
import time

import pytest
import yaml

from launcher.jobenv import ExitCode
from launcher.runtime.checkpoint import disk
from rt_harness import recipe_dict, run_torchrun, write_plan

TIMEOUT_S = 5


def _fault_time(stderr: str) -> float:
    m = re.search(r"FAULT INJECTION rank \d+: \w+ at step \d+ \(t=([\d.]+)\)", stderr)
    assert m, stderr[-2000:]
    return float(m.group(1))


@pytest.mark.slow
def test_stuck_rank_ends_the_job_with_HANG_within_the_timeout(run_dir):
    rec = recipe_dict(
        training={"steps": 30, "timeout_seconds": TIMEOUT_S, "init_timeout_seconds": 60}, checkpoint={"every": 100}
    )
    res = run_torchrun(write_plan(run_dir, rec), run_dir, env={"DTLAUNCH_FAULT": "hang:rank=1:step=5"}, timeout=120)
    end = time.time()
    assert res.rc != 0
    assert ExitCode.HANG in res.worker_codes, res.output[-3000:]
    fault_t = _fault_time(res.stderr)
    status = res.statuses()[0]
    detected, ended = status["time"] - fault_t, end - fault_t
    print(
        f"\nhang: rank 1 stuck at step 5; rank 0 exited HANG after {detected:.1f}s, torchrun ended after "
        f"{ended:.1f}s (timeout_seconds={TIMEOUT_S}); whole run {res.seconds:.1f}s"
    )
    assert TIMEOUT_S - 0.5 < detected < TIMEOUT_S + 3, f"detected after {detected:.1f}s"
    # The stuck rank ignores torchrun's SIGTERM (the handler only sets a flag); the watchdog ends it
    # one timeout later instead of torchrun's SIGKILL after 30 s.
    assert ended < 2 * TIMEOUT_S + 8, f"took {ended:.1f}s"
    assert -9 not in res.worker_codes
    assert status["code"] == ExitCode.HANG and status["step"] == 5
    assert "timed out during step 5" in status["message"] and f"timeout_seconds={TIMEOUT_S}" in status["message"]


WATCHED = """
import contextlib, os, signal, sys, time
from launcher.runtime.hangs import Watchdog
from launcher.runtime.signals import PreemptionFlag

mode = sys.argv[1]
flag = PreemptionFlag().install()
# a step may take 100 s (1 s when paused: were the pause lost, it would end the process), a signal must reach a
# step boundary within 0.5 s
watchdog = Watchdog(1.0 if mode == "paused" else 100, 0.5, 0, flag)
watchdog.beat(3)
if mode == "paused":  # the trainer pauses it before the final save; the save must leave it paused
    watchdog.pause()
    with watchdog.saving(5.0):
        pass
    time.sleep(2.5)
    print("never ended", flush=True)
    sys.exit(0)
saving = {
    "save": lambda: watchdog.saving(2.0),  # writing a checkpoint: nothing written for 2 s ends the rank
    "writing": lambda: watchdog.saving(2.0, written=time.monotonic),  # a save that keeps writing does not end
    "step": contextlib.nullcontext,
}[mode]
with saving():
    os.kill(os.getpid(), signal.SIGTERM)  # a preemption, or torchrun ending the world
    time.sleep(1.2)
    print("alive after the signal's grace", flush=True)
    time.sleep(3)
    print("never ended", flush=True)
"""


@pytest.mark.parametrize("mode", ["save", "writing", "step", "paused"])
def test_a_save_outlives_a_signal_and_a_rank_stuck_writing_it_ends_with_HANG(mode, tmp_path):
    """The watchdog while a checkpoint is written: a preemption signal lets the save finish (a step that reaches
    no boundary within the grace ends at once), a save that writes nothing for its limit (storage that stopped
    answering, which no collective timeout sees when every rank is stuck there, or in a world of one) ends with
    HANG, one that keeps writing does not, and after it the watchdog is as it was."""
    import subprocess
    import sys

    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-c", WATCHED, mode], capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    took = time.monotonic() - t0
    if mode in ("writing", "paused"):
        assert res.returncode == 0 and "never ended" in res.stdout, (res.stdout, res.stderr[-2000:])
        return
    assert res.returncode == ExitCode.HANG, res.stderr[-2000:]
    assert "never ended" not in res.stdout and "last completed step 3" in res.stderr
    if mode == "save":
        assert "alive after the signal's grace" in res.stdout, res.stdout
        assert "a checkpoint being written made no progress for 2s" in res.stderr and took < 8, (took, res.stderr)
    else:
        assert "alive" not in res.stdout and "received SIGTERM but reached no step boundary" in res.stderr


@pytest.mark.slow
def test_a_rank_stuck_committing_a_checkpoint_is_named_with_the_checkpoint_groups_timeout(run_dir):
    """Rank 0 takes 14 s to commit step 4's checkpoint; rank 1 waits for it on the checkpoint group, whose timeout
    is training.init_timeout_seconds (10 here), not the training groups' timeout_seconds (5): its message says
    which save and which setting, and the diagnosis names rank 0."""
    from launcher.cli.diagnose import diagnose

    rec = recipe_dict(
        training={"steps": 8, "timeout_seconds": TIMEOUT_S, "init_timeout_seconds": 10}, checkpoint={"every": 4}
    )
    status_dir = run_dir / "status" / "a1"  # where the job scripts have the ranks write their flight recorders
    env = {
        "DTLAUNCH_FAULT": "slow_checkpoint:rank=0:step=4:seconds=14",
        "DTLAUNCH_ATTEMPT": "a1",
        "DTLAUNCH_STATUS": str(status_dir),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{status_dir}/nccl_trace_rank_",
    }
    res = run_torchrun(write_plan(run_dir, rec), run_dir, env=env, timeout=90)
    assert ExitCode.HANG in res.worker_codes, res.output[-3000:]
    status = res.statuses()[1]
    assert status["code"] == ExitCode.HANG, status
    assert status["message"].startswith(
        "a collective timed out while writing the checkpoint of step 4 (the checkpoint group's "
        f"training.init_timeout_seconds=10; the training groups' training.timeout_seconds={TIMEOUT_S})"
    ), status["message"]
    # rank 0 reached that collective too, but only after rank 1 had given up on it: its flight recorder, written as
    # the peer's loss ended it, says when
    assert res.statuses()[0]["message"].startswith("communication with a peer failed while writing the checkpoint")
    assert (status_dir / "lost_peer_trace_rank_0").is_file() and not (status_dir / "nccl_trace_rank_0").exists()
    said = "\n".join(diagnose(run_dir))
    assert re.search(
        r"likely culprit: rank 0 on \S+: was late to gloo:barrier #\d+ in checkpoint, where rank 1 waited; it entered "
        r"it "
        r"only after a rank had timed out there",
        said,
    ), said


@pytest.mark.slow
def test_off_by_one_rank_is_caught_by_step_agreement(run_dir):
    rec = recipe_dict(training={"steps": 30, "timeout_seconds": TIMEOUT_S}, checkpoint={"every": 100})
    res = run_torchrun(write_plan(run_dir, rec), run_dir, env={"DTLAUNCH_FAULT": "desync_step:rank=1:step=5"})
    end = time.time()
    assert ExitCode.HANG in res.worker_codes, res.output[-3000:]
    assert "ranks disagree on the step number (per rank: [5, 6])" in res.stderr
    detect = end - _fault_time(res.stderr)
    print(f"\ndesync: caught {detect:.1f}s after the divergence")
    assert detect < TIMEOUT_S  # immediately, not by a timeout
    assert max(res.losses()) == 4  # step 5 was never reported as done


@pytest.mark.slow
def test_rank_skipping_a_collective_ends_with_HANG(run_dir):
    rec = recipe_dict(training={"steps": 30, "timeout_seconds": TIMEOUT_S}, checkpoint={"every": 100})
    res = run_torchrun(
        write_plan(run_dir, rec), run_dir, env={"DTLAUNCH_FAULT": "skip_collective:rank=1:step=5"}, timeout=120
    )
    end = time.time()
    assert ExitCode.HANG in res.worker_codes, res.output[-3000:]
    detect = end - _fault_time(res.stderr)
    print(f"\nskip_collective: job ended {detect:.1f}s after rank 1 skipped a collective")
    assert detect < TIMEOUT_S + 15
    assert re.search(r"exit 43 \(HANG\): .*(step 5|step 6)", res.stderr)


@pytest.mark.slow
def test_failed_preflight_exits_44_before_training(run_dir):
    """Two simulated nodes (two torchrun agents) of one rank each: the world's all-reduce crosses nodes and is held
    against the network profile. The 'best' profile expects 40 GB/s; loopback gloo on this machine gives ~1 GB/s."""
    rec = recipe_dict(
        resources={"network": "best", "accelerator": "cpu:1", "nodes": 2}, training={"min_allreduce_fraction": 0.9}
    )
    res = run_torchrun(write_plan(run_dir, rec), run_dir, nproc=1, nnodes=2)
    assert res.worker_codes and set(res.worker_codes) <= {ExitCode.PREFLIGHT, -15}, res.output[-3000:]
    assert ExitCode.PREFLIGHT in res.worker_codes
    assert "preflight failed before any training step" in res.stderr
    assert "across 2 nodes" in res.stderr and "below the required 90%" in res.stderr
    assert not res.losses()
    pre = res.events("preflight")
    assert pre and not pre[0]["ok"] and pre[0]["allreduce_gbps"] > 0


@pytest.mark.slow
def test_unresumable_checkpoints_are_config_errors(run_dir, tmp_path):
    """A ZeRO checkpoint cannot be resharded into another layout (here FSDP2 with tensor parallelism), nor a tiny
    checkpoint loaded by another model shape. Both are a ConfigError of check_compatible: the first ends a real
    job with CONFIG; the second is checked in this process, on the meta the ZeRO run wrote."""
    from launcher.recipe import load_text
    from launcher.runtime.checkpoint.checkpointer import FORMAT
    from launcher.runtime.checkpoint.compat import check_compatible
    from launcher.runtime.failures import ConfigError

    zero_dir = tmp_path / "zero"
    zero = run_torchrun(
        write_plan(
            zero_dir,
            recipe_dict(
                parallelism={"strategy": "zero1"}, training={"steps": 2}, checkpoint={"every": 2, "export": "none"}
            ),
        ),
        zero_dir,
    )
    assert zero.rc == 0, zero.output[-3000:]
    assert disk.complete_steps(zero_dir / "checkpoints") == [2]
    shutil.copytree(zero_dir / "checkpoints", run_dir / "checkpoints")
    fsdp = run_torchrun(
        write_plan(run_dir, recipe_dict(parallelism={"strategy": "fsdp", "tensor": 2}, training={"steps": 4})), run_dir
    )
    assert ExitCode.CONFIG in fsdp.worker_codes, fsdp.output[-3000:]
    assert "written by zero1 (deepspeed format) and cannot be resharded into fsdp dp1 tp2 pp1" in fsdp.stderr
    assert fsdp.stderr.count("Traceback (most recent call last)") == 1  # torchrun's report only
    # The tiny model's checkpoint, resumed by a recipe with another shape (micro): refused, though nothing else
    # differs. The shape the run recorded is the tiny model's; the resuming run's is described the same way.
    saved = disk.read_meta(disk.step_path(zero_dir / "checkpoints", 2))

    def shape(model: dict) -> dict:
        s = load_text(yaml.safe_dump(recipe_dict(model=model)), "<test>").model.shape()
        return {k: getattr(s, k) for k in saved["shape"]}

    assert saved["shape"] == shape({"preset": "tiny", "seq_len": 64}), saved["shape"]
    mine = {**saved, "shape": shape({"preset": "micro", "seq_len": 64})}
    with pytest.raises(ConfigError, match="different model shape") as refused:
        check_compatible(saved, mine, world_size=2, deepspeed=True, allow_changed_recipe=False, fmt=FORMAT)
    assert "resume with the recipe's original model" in refused.value.fix


@pytest.mark.slow
def test_a_rank_aborted_after_a_collective_timeout_counts_as_a_hang(tmp_path):
    """NCCL's watchdog may abort a rank after a collective times out, before Python can say why: the rank
    leaves no exit record, only the flight recorder's dump. The rendered launch script (the same outcome logic
    as the SLURM step and the SkyPilot run) reports HANG (43), not torchrun's generic 1. No GPU here: the
    fault writes the dump and aborts, as the watchdog would."""
    import subprocess

    from launcher.jobenv import ExitCode
    from launcher.plan import make_plan
    from launcher.recipe import load_text
    from launcher.render import render
    from rt_harness import BASE_RECIPE, torchrun_env

    rec = load_text(yaml.safe_dump(recipe_dict(targets={"local": {"max_restarts": 0}})), "<test>")
    art = render(rec, make_plan(rec), "local")
    out = art.write(tmp_path / "run")
    env = torchrun_env({"DTLAUNCH_FAULT": "collective_abort:rank=1:step=3"})
    p = subprocess.run(["bash", str(out / "launch.sh")], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == ExitCode.HANG, p.stdout[-2000:] + p.stderr[-2000:]
    (status,) = (out / "status").glob("manual-*")
    assert (status / "nccl_trace_rank_1").is_file() and not (status / "rank-00001.code").exists()
    assert BASE_RECIPE["training"]["steps"] > 3


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,code,says",
    [
        ("oom", ExitCode.CONFIG, "the plan expected"),
        ("gpu_fault", ExitCode.PREFLIGHT, "exclude this node"),
    ],
)
def test_gpu_errors_end_with_the_code_that_says_what_to_do(run_dir, fault, code, says):
    """A CUDA out-of-memory error is deterministic (the same step needs the same memory): CONFIG, never retried,
    with the plan's figure beside it. A GPU's hardware failing (an ECC error, an unspecified launch failure):
    PREFLIGHT, so the node can be excluded. Both used to exit FAILED and be retried as they were. No GPU here: the
    fault raises the error torch raises. Neither is restarted in place by the job's agent (max_restarts 2 here):
    the same plan, or the same node, would meet it again (a restart would not: the fault is the first attempt's)."""
    rec = recipe_dict(training={"steps": 10, "timeout_seconds": TIMEOUT_S}, checkpoint={"every": 100})
    res = run_torchrun(
        write_plan(run_dir, rec),
        run_dir,
        env={"DTLAUNCH_FAULT": f"{fault}:rank=1:step=3"},
        elastic=True,
        max_restarts=2,
    )
    assert code in res.worker_codes, res.output[-3000:]
    assert len(res.events("start")) == 1 and "not restarting the workers" in res.stderr, res.stderr[-3000:]
    status = res.statuses()[1]
    assert status["code"] == code and says in status["message"] and status["step"] == 3


@pytest.mark.slow
def test_an_aborted_communicator_is_a_hang_and_its_dump_is_kept(tmp_path, run_dir):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (what the job sets): after a collective times out, NCCL's watchdog aborts
    the communicators, the rank's next NCCL call raises "NCCL communicator was aborted" (no timeout in the text),
    and the flight recorder's dump may still be on its way. The rank exits HANG (it exited FAILED), and only once
    its dump is on disk (an immediate exit lost it). No GPU here: the fault raises the error and writes the dump
    2 s later from another thread, as the watchdog would."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    rec = recipe_dict(training={"steps": 10, "timeout_seconds": TIMEOUT_S}, checkpoint={"every": 100})
    res = run_torchrun(
        write_plan(run_dir, rec),
        run_dir,
        env={
            "DTLAUNCH_FAULT": "comm_abort:rank=1:step=3:delay=2",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(dumps / "nccl_trace_rank_"),
        },
        timeout=120,
    )
    status = res.statuses()[1]
    assert status["code"] == ExitCode.HANG and "watchdog aborted" in status["message"], res.output[-3000:]
    assert (dumps / "nccl_trace_rank_1").read_bytes().startswith(b"flight recorder dump")
