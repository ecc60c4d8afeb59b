"""The rendered `setup` and `run` really execute, per node, with the variables SkyPilot sets.

The harness (sky_harness.py) plays SkyPilot; here `python`/`deepspeed` are stubs that record their
arguments, so these tests check what each node would start (fast). test_harness_train.py runs the
real training. `pip` is always a stub: installing from PyPI is the one thing that needs the network.
"""
from __future__ import annotations

import shlex
import pytest

from sky_harness import Cluster, free_port
from sky_helpers import RECIPES, render_to

TINY = next(p for p in RECIPES if p.name == "tiny.yaml")
TASK_ID = "sky-2026-11-21-10-00-00-123456_tiny_7"


def _argv(cluster: Cluster, tool: str) -> list[list[str]]:
    log = cluster.root / f"{tool}.log"
    return [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_setup_runs_user_lines_and_installs_dtlaunch(tmp_path):
    _, _, out = render_to(tmp_path, TINY, ["resources.nodes=2", 'targets.sky.setup=["touch setup-ran-$SKYPILOT_NODE_RANK"]'])
    c = Cluster(out, task_id=TASK_ID)
    assert all(r.returncode == 0 for r in c.setup())
    assert [a[:2] for a in _argv(c, "pip")] == [["install", "dtlaunch[train]==0.1.0"]] * 2
    assert (c.workdir / "setup-ran-0").exists() and (c.workdir / "setup-ran-1").exists()


def test_each_node_starts_torchrun_against_the_head(tmp_path):
    _, _, out = render_to(tmp_path, TINY, ["resources.nodes=2", "targets.sky.max_restarts=5"])
    c = Cluster(out, task_id=TASK_ID, ips=("10.0.0.5", "10.0.0.6"), stubs=("pip", "sudo", "python"))
    port = free_port()
    assert c.wait(c.start({"DTLAUNCH_PORT": str(port)}), timeout=30) == [0, 0]
    calls = _argv(c, "python")
    assert len(calls) == 2
    for argv in calls:
        assert argv[:2] == ["-m", "torch.distributed.run"]
        assert "--nnodes=2" in argv and "--nproc-per-node=2" in argv  # cpu:2 -> the plan's count, not SkyPilot's 0 GPUs
        assert f"--rdzv-endpoint=10.0.0.5:{port}" in argv and "--rdzv-backend=c10d" in argv
        assert f"--rdzv-id={TASK_ID}" in argv and "--max-restarts=5" in argv
        assert argv[argv.index("--plan") + 1] == str(c.workdir / "plan.json")
        assert argv[argv.index("--run-dir") + 1] == str(c.workdir / "runs" / TASK_ID)
    assert all("--node-rank" not in " ".join(a) for a in calls)  # ignored by torch with c10d: not rendered


def test_missing_head_address_fails_fast(tmp_path):
    _, _, out = render_to(tmp_path, TINY)
    c = Cluster(out, nodes=1, ips=("",), stubs=("pip", "sudo", "python"))
    assert c.wait(c.start(), timeout=30) == [44]
    assert "SKYPILOT_NODE_IPS is empty" in c.log(0) and not (c.root / "python.log").exists()


EVIL_NAME = "x; touch {m}"
EVIL_ENV = "$(touch {m})`touch {m}`"


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_shell_metacharacters_in_recipe_values_are_never_executed(tmp_path, launcher):
    marker = tmp_path / "pwned"
    text = TINY.read_text().replace("name: tiny", f"name: {EVIL_NAME.format(m=marker)!r}")
    text += f"env:\n  EVIL: {EVIL_ENV.format(m=marker)!r}\n"
    ov = ["resources.nodes=2"] + (["parallelism.strategy=zero2", "parallelism.launcher=deepspeed"] if launcher == "deepspeed" else [])
    _, art, out = render_to(tmp_path, None, ov, text=text)
    c = Cluster(out, task_id=TASK_ID, ips=("127.0.0.1", "127.0.0.2"), stubs=("pip", "sudo", "python", "deepspeed"))
    # SkyPilot exports `envs` itself; the harness passes them as a process environment, like it does.
    assert all(r.returncode == 0 for r in c.setup())
    assert c.wait(c.start(), timeout=30) == [0, 0]
    assert not marker.exists(), "a recipe value was executed by the shell"
    assert not set(art.job_name) & set(" ;$()`/"), art.job_name  # the YAML `name:` is scheduler-safe too
    if launcher == "deepspeed":
        envfile = (c.workdir / ".deepspeed_env").read_text().splitlines()
        assert f"EVIL={EVIL_ENV.format(m=marker)}" in envfile and f"DTLAUNCH_RUN_ID={TASK_ID}" in envfile
        assert (c.workdir / "runs" / TASK_ID / "hostfile.0").read_text() == "127.0.0.1 slots=2\n127.0.0.2 slots=2\n"
        (head,) = _argv(c, "deepspeed")  # head-only: node 1 leaves its workers to the head's ssh launch
        assert "--no_ssh" not in head and "--master_addr=127.0.0.1" in head
        assert head[head.index("--module") + 1] == "launcher.train" and "--no_local_rank" in head


def test_deepspeed_no_ssh_runs_every_node(tmp_path):
    _, _, out = render_to(tmp_path, TINY, ["resources.nodes=2", "parallelism.strategy=zero2", "parallelism.launcher=deepspeed"])
    c = Cluster(out, task_id=TASK_ID, ips=("127.0.0.1", "127.0.0.2"), stubs=("pip", "sudo", "python", "deepspeed"))
    assert c.wait(c.start({"DTLAUNCH_DEEPSPEED_NO_SSH": "1"}), timeout=30) == [0, 0]
    calls = _argv(c, "deepspeed")
    assert sorted(next(x for x in a if x.startswith("--node_rank")) for a in calls) == ["--node_rank=0", "--node_rank=1"]
    assert all("--no_ssh" in a for a in calls)
