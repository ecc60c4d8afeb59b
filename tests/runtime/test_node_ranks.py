"""Node ranks follow the scheduler, not the sort order of addresses (launcher.runtime.elastic).

Two real torch elastic agents (`python -m launcher.runtime.elastic`, torchrun's own code) rendezvous over c10d on
loopback, each announcing an address of its own: 127.0.0.9 for the scheduler's node 0 and 127.0.0.10 for
its node 1 (every 127/8 address is the loopback interface on Linux). As strings, "127.0.0.10" sorts first, so
torch alone makes the scheduler's node 1 global rank 0, away from the node that hosts the store; with
DTLAUNCH_NODE_RANK (set by step.sh from SLURM_NODEID, by the SkyPilot run from SKYPILOT_NODE_RANK) the ranks
follow the scheduler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.jobenv import NODE_RANK
from launcher.prepare import prepare
from rt_harness import free_port
from testpaths import RECIPES

WORKER = """import json, os, sys
out = os.path.join(sys.argv[1], "node-%s.json" % os.environ["TAG"])
json.dump({k: os.environ[k] for k in ("RANK", "GROUP_RANK", "MASTER_ADDR")}, open(out, "w"))
"""
ADDRS = ("127.0.0.9", "127.0.0.10")  # the scheduler's node 0, node 1


def _rendezvous(tmp_path: Path, with_node_rank: bool) -> dict[int, dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []
    for node, addr in enumerate(ADDRS):
        env = {k: v for k, v in os.environ.items() if k != NODE_RANK}
        env["TAG"] = str(node)
        if with_node_rank:
            env[NODE_RANK] = str(node)
        cmd = [
            sys.executable,
            "-m",
            "launcher.runtime.elastic",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=ranks",
            f"--rdzv-conf=join_timeout=60,is_host={int(node == 0)}",
            f"--local-addr={addr}",
            "--max-restarts=0",
            str(script),
            str(tmp_path),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    return {node: json.loads((tmp_path / f"node-{node}.json").read_text()) for node in (0, 1)}


def test_torch_alone_ranks_nodes_by_address(tmp_path):
    """The defect this module guards against, shown with torch's own rendezvous: without the scheduler's
    rank, the node announcing 127.0.0.10 becomes global rank 0."""
    got = _rendezvous(tmp_path, with_node_rank=False)
    assert got[1]["RANK"] == "0" and got[0]["RANK"] == "1", got


def test_node_ranks_follow_the_scheduler(tmp_path):
    got = _rendezvous(tmp_path, with_node_rank=True)
    assert [got[n]["GROUP_RANK"] for n in (0, 1)] == ["0", "1"], got
    assert [got[n]["RANK"] for n in (0, 1)] == ["0", "1"], got
    assert got[0]["MASTER_ADDR"] == got[1]["MASTER_ADDR"] == ADDRS[0]  # rank 0 on the store's node


@pytest.mark.parametrize(
    "target,script,source", [("slurm", "step.sh", "${SLURM_NODEID:-}"), ("sky", "task.yaml", "$SKYPILOT_NODE_RANK")]
)
def test_job_scripts_pass_the_schedulers_node_rank(tmp_path, target, script, source):
    files = prepare(RECIPES / "tiny.yaml", target=target).artifacts.files
    text = yaml.safe_load(files["task.yaml"])["run"] if target == "sky" else files[script]
    assert f'export {NODE_RANK}="{source}"' in text
    # set before torchrun starts (the agent's line: an environment check may run launcher.runtime.elastic before)
    assert text.index(f"export {NODE_RANK}=") < text.index("--nproc-per-node=")
