"""The job also runs without torchrun: started once per rank with the variables `srun` sets (or
SkyPilot's), as the SLURM and SkyPilot targets may launch it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rt_harness import free_port, recipe_dict, torchrun_env, write_plan


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["slurm", "skypilot"])
def test_ranks_started_without_torchrun(run_dir, launcher):
    plan = write_plan(run_dir, recipe_dict(training={"steps": 4}, checkpoint={"every": 4}))
    port = free_port()
    procs = []
    for rank in range(2):
        env = torchrun_env({"MASTER_PORT": str(port)})
        if launcher == "slurm":
            env.update(
                {
                    "SLURM_PROCID": str(rank),
                    "SLURM_NTASKS": "2",
                    "SLURM_LOCALID": str(rank),
                    "SLURM_NODEID": "0",
                    "SLURM_JOB_NODELIST": "localhost",
                    "SLURM_JOB_ID": "77",
                }
            )
        else:  # SkyPilot runs one process per node: two "nodes" on loopback
            env.update(
                {
                    "SKYPILOT_NODE_RANK": str(rank),
                    "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1\n",
                    "SKYPILOT_NUM_NODES": "2",
                }
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "launcher.runtime.train", "--plan", str(plan), "--run-dir", str(run_dir)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    assert f"world 2 via {launcher}, backend gloo" in outs[0][0]
    assert "step 4/4" in outs[0][0]
    assert (run_dir / "model.safetensors").exists()
