"""Every task YAML dtlaunch renders must be accepted by the installed SkyPilot's own schema.

`sky.Task.from_yaml` validates offline (unknown fields, bad values), which is the contract `sky launch`
applies first; a cloud is not needed for that. GPU names are not checked by SkyPilot offline, so dtlaunch
rejects those itself before rendering (see test_validation.py).
"""
from __future__ import annotations

import os

import pytest
import yaml

from launcher.jobenv import ExitCode

from sky_helpers import RECIPES, render_to, sky_lib  # noqa: F401 (fixture)

VARIANTS = {
    "single": [],
    "two-nodes": ["resources.nodes=2"],
    "managed": ["resources.nodes=2", "targets.sky.managed=true", "targets.sky.spot=false",
                "targets.sky.infra=gcp/us-central1"],
    "spot": ["targets.sky.spot=true", "targets.sky.infra=null", "targets.sky.cloud=aws", "targets.sky.region=us-east-1"],
    "deepspeed-launcher": ["resources.nodes=2", "parallelism.strategy=zero2", "parallelism.launcher=deepspeed"],
}


def from_yaml(sky_lib, out):
    cwd = os.getcwd()
    os.chdir(out)  # workdir '.' is relative to where `sky launch` runs: the rendered directory
    try:
        return sky_lib.Task.from_yaml(str(out / "task.yaml"))
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("recipe_path", RECIPES, ids=[p.stem for p in RECIPES])
def test_rendered_yaml_is_accepted_by_skypilot(sky_lib, tmp_path, recipe_path, variant):
    overrides = VARIANTS[variant]
    rec, art, out = render_to(tmp_path, recipe_path, overrides)
    task = from_yaml(sky_lib, out)
    doc = yaml.safe_load(art.files["task.yaml"])
    res = doc["resources"]

    assert task.num_nodes == rec.resources.nodes
    assert art.entrypoint == "task.yaml" and {"plan.json", "recipe.yaml"} <= set(art.files)
    (r,) = task.resources
    if rec.resources.device().is_gpu:
        assert r.accelerators == {rec.resources.accel_name: rec.resources.per_node}
        assert "SKYPILOT_NUM_GPUS_PER_NODE" in doc["run"]
    else:  # SkyPilot has no cpu accelerator: vCPUs instead, and the plan's process count
        assert "accelerators" not in res and res["cpus"] == f"{rec.resources.per_node}+"
        assert f"--nproc-per-node={rec.resources.per_node}" in doc["run"] or "NPROC=" in doc["run"]
    assert r.network_tier is not None if rec.resources.network in ("best", "infiniband", "efa") else True
    managed = rec.targets.sky.managed or rec.targets.sky.spot  # shipped recipes may ask for spot themselves
    assert (art.submit_command[:3] == ["sky", "jobs", "launch"]) == managed
    if managed:
        rec_cfg = res["job_recovery"]
        assert rec_cfg["recover_on_exit_codes"] == [ExitCode.PREEMPTED, ExitCode.HANG]
        assert rec_cfg["strategy"] == ("EAGER_NEXT_REGION" if rec.targets.sky.spot else "FAILOVER")
        assert r.job_recovery["max_restarts_on_errors"] == rec.targets.sky.max_restarts_on_errors
    else:
        assert "job_recovery" not in res and art.submit_command[:3] == ["sky", "launch", "-c"]
    if variant == "spot":
        assert r.use_spot and str(r.cloud).lower() == "aws" and r.region == "us-east-1"
    if variant == "managed":
        assert str(r.cloud).lower() == "gcp" and r.region == "us-central1"
    if variant == "deepspeed-launcher":
        assert "deepspeed" in doc["setup"] and ".deepspeed_env" in doc["run"] and "ds_config.json" in art.files
    else:
        assert "torch.distributed.run" in doc["run"] and "--node-rank" not in doc["run"]


def test_secrets_by_name_never_values(sky_lib, tmp_path, monkeypatch):
    """Secrets go in as names (null values) plus `--secret NAME`; their values never reach a file."""
    monkeypatch.setenv("HF_TOKEN", "hf_supersecretvalue")
    rec, art, out = render_to(tmp_path, RECIPES[0], ["secrets=[HF_TOKEN, WANDB_API_KEY]"])
    doc = yaml.safe_load(art.files["task.yaml"])
    assert doc["secrets"] == {"HF_TOKEN": None, "WANDB_API_KEY": None}
    assert "HF_TOKEN" not in doc["envs"]
    assert art.submit_command[-5:] == ["--secret", "HF_TOKEN", "--secret", "WANDB_API_KEY", "task.yaml"]
    for p in out.rglob("*"):
        if p.is_file():
            assert "hf_supersecretvalue" not in p.read_text()
    task = from_yaml(sky_lib, out)  # SkyPilot reads null-valued secrets as references filled by --secret
    assert set(task.to_yaml_config()["secrets"]) == {"secrets:HF_TOKEN", "secrets:WANDB_API_KEY"}


def test_project_workdir_ships_rendered_files_as_a_mount(sky_lib, tmp_path):
    """With targets.sky.workdir the user's project is synced, and plan.json rides in a file mount."""
    from sky_helpers import ROOT

    rec, art, out = render_to(tmp_path, RECIPES[0], [f"targets.sky.workdir={ROOT}"])
    task = from_yaml(sky_lib, out)
    assert task.workdir == str(ROOT)
    assert task.file_mounts == {"~/dtlaunch-job": "."}
    assert 'JOB_DIR="$HOME/dtlaunch-job"' in yaml.safe_load(art.files["task.yaml"])["run"]
