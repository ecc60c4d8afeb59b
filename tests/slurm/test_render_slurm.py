"""The rendered job script: directives, rendezvous, quoting. Pure rendering plus `bash -n`; no cluster."""
from __future__ import annotations

import subprocess

import pytest

from launcher.errors import DtlaunchError
from launcher.plan import make_plan
from launcher.recipe import load
from launcher.render.slurm import render_slurm_array, sbatch_value
from launcher.sweep import expand
from slurmkit import REPO, render_to

RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_renders_valid_bash(name, tmp_path):
    _, art = render_to(tmp_path, name, ["targets.slurm.partition=debug"])
    script = art.files["job.sbatch"]
    for f in ("job.sbatch", "step.sh"):
        p = subprocess.run(["bash", "-n", str(tmp_path / f)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
    for d in ("--ntasks-per-node=1", "--open-mode=append", "--requeue", "--signal=B:USR2@", "--output=%x-%j.out",
              "--partition=debug", "--time="):
        assert f"#SBATCH {d}" in script
    assert art.submit_command == ["sbatch", "--parsable", "job.sbatch"]
    step = art.files["step.sh"]
    assert "--rdzv-backend=c10d" in step and '"--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT"' in step
    assert "--node-rank" not in step and "localhost" not in script + step and "127.0.0.1" not in script + step
    assert "srun --kill-on-bad-exit=1 --wait=60" in script
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"' in script
    assert '[ -n "$MASTER_ADDR" ] || fail' in script
    assert "pdsh" not in script + step  # DeepSpeed runs through the same torchrun on every node


def test_gpus_per_node_only_for_gpu_accelerators(tmp_path):
    _, gpu = render_to(tmp_path / "g", "llama3-8b")
    _, cpu = render_to(tmp_path / "c", "tiny")
    assert "#SBATCH --gpus-per-node=8" in gpu.files["job.sbatch"]
    assert "--gpus-per-node" not in cpu.files["job.sbatch"]
    assert "#SBATCH --cpus-per-task=2" in cpu.files["job.sbatch"]


def test_deepspeed_recipe_ships_its_config_and_uses_torchrun(tmp_path):
    _, art = render_to(tmp_path, "llama2-13b-zero3")
    assert "ds_config.json" in art.files
    assert "torch.distributed.run" in art.files["step.sh"]


def test_sbatch_value_quotes_for_sbatchs_own_parser():
    assert sbatch_value("debug") == "debug"
    assert sbatch_value('a b"#c') == '"a b\\"\\#c"'
    with pytest.raises(DtlaunchError, match="newline"):
        sbatch_value("gpu\n#SBATCH --wrap=evil")


def test_hostile_values_are_quoted_and_secret_values_never_written(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_TOKEN", "s3cr3t-value-42")
    r, art = render_to(tmp_path, "tiny", [
        "name=x; touch /tmp/pwned",
        "env.EVIL=$(touch /tmp/pwned-env) `touch /tmp/pwned-bt` ' \" ; rm -rf /",
        "secrets=[MY_TOKEN]",
    ])
    script = art.files["job.sbatch"]
    assert "#SBATCH --job-name=x-touch-tmp-pwned" in script
    assert "export EVIL='$(touch /tmp/pwned-env) `touch /tmp/pwned-bt` '\"'\"' \" ; rm -rf /'" in script
    assert '[ -n "${MY_TOKEN+x}" ]' in script
    for rel in art.files:
        assert "s3cr3t-value-42" not in (tmp_path / rel).read_text(), rel


def test_extra_sbatch_must_be_options(tmp_path):
    with pytest.raises(DtlaunchError, match="not an sbatch option"):
        render_to(tmp_path, "tiny", ["targets.slurm.extra_sbatch=[\"rm -rf /\"]"])


def test_array_render_one_plan_per_task(tmp_path):
    items = []
    for ov in expand(["training.lr=0.001,0.003", "training.steps=4"]):
        r = load(REPO / "recipes" / "tiny.yaml", ov)
        items.append((r, make_plan(r)))
    art = render_slurm_array(items)
    assert "#SBATCH --array=0-1" in art.files["job.sbatch"]
    assert "#SBATCH --output=%x-%A_%a.out" in art.files["job.sbatch"]
    assert {"task-0/plan.json", "task-1/plan.json"} <= set(art.files)
    assert '"0.001"' not in art.files["task-0/plan.json"] and "0.001" in art.files["task-0/plan.json"]
    bad = [(load(REPO / "recipes" / "tiny.yaml", [f"resources.nodes={n}"]),) for n in (1, 2)]
    with pytest.raises(DtlaunchError, match="allocation"):
        render_slurm_array([(r, make_plan(r)) for (r,) in bad])
