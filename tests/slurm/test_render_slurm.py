"""The rendered job script: directives, rendezvous, quoting, the interpreter. Pure rendering plus `bash -n`
and shellcheck; the scripts run on a real cluster in test_job_lifecycle.py and test_operator.py."""

from __future__ import annotations

import math
import subprocess

import pytest

from launcher.cli.sweep import expand
from launcher.errors import DtlaunchError
from launcher.plan import make_plan
from launcher.recipe import load
from launcher.render.shell import sbatch_value
from launcher.targets.slurm.sbatch import render_slurm_array
from slurmkit import REPO, render_to

RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_renders_valid_bash(name, tmp_path):
    _, art = render_to(tmp_path, name, ["targets.slurm.partition=debug"])
    script = art.files["job.sbatch"]
    for f in ("job.sbatch", "step.sh"):
        p = subprocess.run(["bash", "-n", str(tmp_path / f)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        p = subprocess.run(
            ["shellcheck", "-S", "warning", "-s", "bash", str(tmp_path / f)], capture_output=True, text=True
        )
        assert p.returncode == 0, p.stdout
    for d in (
        "--ntasks-per-node=1",
        "--open-mode=append",
        "--requeue",
        "--signal=B:USR2@",
        "--output=%x-%j.out",
        "--partition=debug",
        "--time=",
    ):
        assert f"#SBATCH {d}" in script
    assert art.submit_command == ["sbatch", "--parsable", "job.sbatch"]
    step = art.files["step.sh"]
    assert "--rdzv-backend=c10d" in step and '"--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT"' in step
    assert "is_host=$IS_HOST" in step and '"--local-addr=$SLURMD_NODENAME"' in step
    assert "--node-rank" not in step and "localhost" not in script + step and "127.0.0.1" not in script + step
    assert "srun --kill-on-bad-exit=1 --wait=60" in script
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"' in script
    assert '[ -n "$MASTER_ADDR" ] || fail' in script
    assert "pdsh" not in script + step  # DeepSpeed runs through the same torchrun on every node


def test_the_interpreter_is_resolved_on_the_node_after_setup(tmp_path):
    """Never the rendering machine's interpreter: after the setup lines, then checked for dtlaunch (the plan is
    checked on each node by its torchrun agent)."""
    import sys

    _, art = render_to(tmp_path, "tiny", ['targets.slurm.setup=["source /opt/venv/bin/activate"]'])
    script = art.files["job.sbatch"]
    assert sys.executable not in script
    setup_at = script.index("source /opt/venv/bin/activate")
    resolve_at = script.index('PYTHON="${DTLAUNCH_PYTHON:-$(command -v python3')
    check_at = script.index('"$PYTHON" -m launcher.runtime.elastic --check-environment')
    assert setup_at < resolve_at < check_at < script.index("srun --kill-on-bad-exit")


def test_memory_cpu_and_gpu_requests(tmp_path):
    _, gpu = render_to(tmp_path / "g", "llama3-8b")
    _, cpu = render_to(tmp_path / "c", "tiny")
    _, shared = render_to(
        tmp_path / "s", "llama3-8b", ["targets.slurm.exclusive=false", "targets.slurm.cpus_per_gpu=8"]
    )
    _, offload = render_to(tmp_path / "o", "llama2-13b-zero3", ["targets.slurm.exclusive=false"])
    g, c, s, o = (a.files["job.sbatch"] for a in (gpu, cpu, shared, offload))
    assert "#SBATCH --gpus-per-node=8" in g and "--gpus-per-node" not in c
    assert "#SBATCH --cpus-per-task=2" in c and '"--cpus-per-task=$SLURM_CPUS_PER_TASK"' in c
    # --exclusive alone gets only the memory asked for: 0 asks for all of it; so does host-side offload.
    assert "#SBATCH --exclusive" in g and "#SBATCH --mem=0" in g
    assert "#SBATCH --exclusive" not in s and "--mem=" not in s and "#SBATCH --cpus-per-gpu=8" in s
    assert "#SBATCH --exclusive" not in o and "#SBATCH --mem=0" in o


def test_torchrun_gets_time_to_checkpoint_and_forwards_usr2(tmp_path):
    _, big = render_to(tmp_path / "b", "llama70b")
    _, small = render_to(tmp_path / "s", "tiny")
    _, fixed = render_to(tmp_path / "f", "tiny", ["checkpoint.grace_seconds=90"])
    plan = make_plan(load(REPO / "recipes" / "llama70b.yaml"))
    # a step (twice the plan's estimate: the signal may come just after one began), a save, 30 s to exit
    want = math.ceil(2 * plan.step_seconds + plan.checkpoint_write_seconds + 30)
    assert f"--shutdown-timeout={want}" in big.files["step.sh"] and want > 150
    assert "--shutdown-timeout=30" in small.files["step.sh"] or "--shutdown-timeout=31" in small.files["step.sh"]
    assert "--shutdown-timeout=90" in fixed.files["step.sh"]
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2" in small.files["step.sh"]


def test_port_stays_below_the_ephemeral_range_and_flight_recorder_in_the_run(tmp_path):
    _, art = render_to(tmp_path, "tiny")
    s = art.files["job.sbatch"]
    assert "MASTER_PORT=$(( 10000 + SLURM_JOB_ID % 20000 ))" in s  # 10000-29999 < 32768
    assert 'TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$DTLAUNCH_STATUS/nccl_trace_rank_"' in s


def test_network_profiles_leave_nccl_its_own_choices(tmp_path):
    _, efa = render_to(tmp_path / "e", "llama3-8b", ["resources.network=efa"])
    _, tcp = render_to(tmp_path / "t", "llama3-8b", ["resources.network=tcp"])
    _, ifname = render_to(tmp_path / "i", "llama3-8b", ["resources.network=tcp", "resources.socket_ifname=eth0"])
    e, t, i = (a.files["job.sbatch"] for a in (efa, tcp, ifname))
    assert "export FI_PROVIDER=efa" in e
    for forced in ("FI_EFA_USE_DEVICE_RDMA", "NCCL_PROTO", "NCCL_NET_GDR_LEVEL"):
        assert forced not in e + t
    assert "NCCL_SOCKET_IFNAME" not in t and "export NCCL_SOCKET_IFNAME=eth0" in i
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=2" in e  # the error reaches Python: exit 43, not an abort


def test_deepspeed_recipe_ships_its_config_and_uses_torchrun(tmp_path):
    _, art = render_to(tmp_path, "llama2-13b-zero3")
    assert "ds_config.json" in art.files
    assert "launcher.runtime.elastic" in art.files["step.sh"]


def test_sbatch_value_quotes_for_sbatchs_own_parser():
    assert sbatch_value("debug") == "debug"
    assert sbatch_value('a b"#c') == '"a b\\"\\#c"'
    with pytest.raises(DtlaunchError, match="newline"):
        sbatch_value("gpu\n#SBATCH --wrap=evil", "targets.slurm.partition")


def test_hostile_values_are_quoted_and_secret_values_never_written(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_TOKEN", "s3cr3t-value-42")
    r, art = render_to(
        tmp_path,
        "tiny",
        [
            "name=x; touch /tmp/pwned",
            "env.EVIL=$(touch /tmp/pwned-env) `touch /tmp/pwned-bt` ' \" ; rm -rf /",
            "secrets=[MY_TOKEN]",
        ],
    )
    script = art.files["job.sbatch"]
    assert f"#SBATCH --job-name={r.job_name}" in script and r.job_name.startswith("x-touch-tmp-pwned-")
    assert "export EVIL='$(touch /tmp/pwned-env) `touch /tmp/pwned-bt` '\"'\"' \" ; rm -rf /'" in script
    assert '[ -n "${MY_TOKEN+x}" ]' in script
    for rel in art.files:
        assert "s3cr3t-value-42" not in (tmp_path / rel).read_text(), rel


def test_extra_sbatch_must_be_options(tmp_path):
    with pytest.raises(DtlaunchError, match="not an sbatch option"):
        render_to(tmp_path, "tiny", ['targets.slurm.extra_sbatch=["rm -rf /"]'])


def test_array_render_one_plan_per_task_with_a_throttle(tmp_path):
    items = []
    for ov in expand(["training.lr=0.001,0.003", "training.steps=4"]):
        r = load(REPO / "recipes" / "tiny.yaml", ov + ["targets.slurm.array_parallelism=1"])
        items.append((r, make_plan(r)))
    art = render_slurm_array(items)
    s = art.files["job.sbatch"]
    assert "#SBATCH --array=0-1%1" in s and "#SBATCH --output=%x-%A_%a.out" in s
    assert 'DEFAULT_RUN_ID="$SLURM_ARRAY_JOB_ID"' in s and '_${SLURM_ARRAY_TASK_ID}"' in s
    assert {"task-0/plan.json", "task-1/plan.json"} <= set(art.files)
    assert '"0.001"' not in art.files["task-0/plan.json"] and "0.001" in art.files["task-0/plan.json"]
    bad = [(load(REPO / "recipes" / "tiny.yaml", [f"resources.nodes={n}"]),) for n in (1, 2)]
    with pytest.raises(DtlaunchError, match="allocation"):
        render_slurm_array([(r, make_plan(r)) for (r,) in bad])
