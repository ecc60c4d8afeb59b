"""Every task YAML dtlaunch renders must be accepted by the installed SkyPilot's own schema, and say what a
cloud node needs: shared checkpoint storage, dtlaunch shipped with the job, autostop, bounded recovery.

`sky.Task.from_yaml` validates offline (unknown fields, bad values, storage specs), which is the contract
`sky launch` applies first; a cloud is not needed for that. GPU names are not checked by SkyPilot offline,
so dtlaunch rejects those itself before rendering (see test_validation.py).
"""

from __future__ import annotations

import json
import os
import zipfile

import pytest
import yaml

from launcher.jobenv import ExitCode
from launcher.plan import make_plan
from launcher.render.package import wheel_name
from launcher.validate import RULES, has_errors, validate
from sky_helpers import RECIPES, render_to

BUCKET = "targets.sky.checkpoint_storage={bucket: 's3://dtlaunch-test-bucket/ckpt'}"
VARIANTS = {
    "single": ["resources.nodes=1"],
    "two-nodes": ["resources.nodes=2", BUCKET],
    "managed": [
        "resources.nodes=2",
        "targets.sky.managed=true",
        "targets.sky.spot=false",
        "targets.sky.infra=gcp/us-central1",
        "targets.sky.checkpoint_storage={volume: ckpt-vol}",
    ],
    "spot": [
        "targets.sky.spot=true",
        "targets.sky.infra=null",
        "targets.sky.cloud=aws",
        "targets.sky.region=us-east-1",
        BUCKET,
    ],
    "deepspeed-launcher": ["resources.nodes=2", "parallelism.strategy=zero2", "parallelism.launcher=deepspeed", BUCKET],
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
    # a disk for the variants' per-node checkpoint share (405B on one node caches ~5 TB: sky-disk-checkpoint-cache)
    overrides = VARIANTS[variant] + ["checkpoint.dir=null", "targets.sky.disk_size=16000"]
    data = yaml.safe_load(recipe_path.read_text())["training"].get("data", {})
    if data.get("source") == "file" and str(data.get("path", "")).startswith("/"):  # a SLURM recipe's shared path
        overrides.append(
            f"targets.sky.data_mounts=[{{path: {os.path.dirname(data['path'])}, "
            "source: 's3://dtlaunch-test-bucket/data', mode: MOUNT}]"
        )
    rec, art, out = render_to(tmp_path, recipe_path, overrides)
    sky_rules = [r for r in RULES if "sky" in r.targets]
    assert not has_errors(validate(rec, make_plan(rec), "sky", sky_rules)), "the variant must satisfy the sky rules"
    task = from_yaml(sky_lib, out)
    doc = yaml.safe_load(art.files["task.yaml"])
    res = doc["resources"]

    assert task.num_nodes == rec.resources.nodes
    assert art.entrypoint == "task.yaml" and {"plan.json", "recipe.yaml", wheel_name()} <= set(art.files)
    (r,) = task.resources
    if rec.resources.device().is_gpu:
        assert r.accelerators == {rec.resources.accel_name: rec.resources.per_node}
        assert "SKYPILOT_NUM_GPUS_PER_NODE" in doc["run"]
    else:  # SkyPilot has no cpu accelerator: vCPUs instead, and the plan's process count
        assert "accelerators" not in res and res["cpus"] == f"{rec.resources.per_node}+"
    fabric = rec.resources.network in ("best", "infiniband", "efa")
    assert ("network_tier" in res) == (fabric and rec.resources.nodes > 1)  # only between nodes
    managed = rec.targets.sky.managed or rec.targets.sky.spot
    assert (art.submit_command[:3] == ["sky", "jobs", "launch"]) == managed
    if managed:
        rec_cfg = res["job_recovery"]
        # Only PREEMPTED recovers uncounted: a reproducible hang must use up max_restarts_on_errors.
        assert rec_cfg["recover_on_exit_codes"] == [ExitCode.PREEMPTED]
        assert rec_cfg["strategy"] == ("EAGER_NEXT_REGION" if rec.targets.sky.spot else "FAILOVER")  # recovery: auto
        assert r.job_recovery["max_restarts_on_errors"] == rec.targets.sky.max_restarts_on_errors
        assert "autostop" not in res
    else:
        assert "job_recovery" not in res and art.submit_command[:3] == ["sky", "launch", "-c"]
        assert res["autostop"] == {"idle_minutes": 10, "down": True} and r.autostop_config.enabled
    storage = rec.targets.sky.checkpoint_storage
    if storage and storage.bucket:
        assert doc["file_mounts"]["/checkpoints"] == {"source": storage.bucket, "mode": "MOUNT_CACHED"}
        assert str(task.storage_mounts["/checkpoints"].mode.value) == "MOUNT_CACHED"
    for m in rec.targets.sky.data_mounts:  # the recipe's weights and data, at the paths it reads them from
        assert task.storage_mounts[m.path].source == m.source and task.storage_mounts[m.path].mode.value == m.mode
    if storage and storage.volume:
        assert doc["volumes"] == {"/checkpoints": storage.volume}
    if storage:
        assert "CHECKPOINT_TEMPLATE='/checkpoints/{run_id}'" in doc["run"]
    # dtlaunch comes from the wheel beside the task, never from a package index.
    assert f"pip install './{wheel_name()}[train]'" in doc["setup"] and "dtlaunch[train]==" not in doc["setup"]
    if variant == "deepspeed-launcher":
        assert "deepspeed==" in doc["setup"] and "--no_ssh" in doc["run"] and "ds_config.json" in art.files
    else:
        assert "launcher.runtime.elastic" in doc["run"] and "--node-rank" not in doc["run"]
        assert '"--rdzv-conf=join_timeout=' in doc["run"] and 'is_host=$IS_HOST"' in doc["run"]
        assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2" in doc["run"]


def test_the_wheel_is_installable_and_holds_this_dtlaunch(tmp_path):
    import launcher

    _, art, out = render_to(tmp_path, RECIPES[0], [])
    whl = out / wheel_name()
    with zipfile.ZipFile(whl) as zf:
        names = set(zf.namelist())
        meta = zf.read(f"dtlaunch-{launcher.__version__}.dist-info/METADATA").decode()
        record = zf.read(f"dtlaunch-{launcher.__version__}.dist-info/RECORD").decode()
    assert "launcher/runtime/train.py" in names and "launcher/targets/slurm/templates/slurm_job.sh.j2" in names
    assert not any("__pycache__" in n for n in names)
    assert "Requires-Dist: torch" in meta and 'extra == "train"' in meta
    assert all(line.count(",") == 2 for line in record.splitlines())
    # Rendering again gives the same bytes: a re-render shows no spurious change.
    _, art2, _ = render_to(tmp_path / "again", RECIPES[0], [])
    assert art2.files[wheel_name()] == art.files[wheel_name()]


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
            assert b"hf_supersecretvalue" not in p.read_bytes()
    task = from_yaml(sky_lib, out)  # SkyPilot reads null-valued secrets as references filled by --secret
    assert set(task.to_yaml_config()["secrets"]) == {"secrets:HF_TOKEN", "secrets:WANDB_API_KEY"}


def test_project_workdir_ships_rendered_files_as_a_mount(sky_lib, tmp_path):
    """With targets.sky.workdir the user's project is synced, and the job's files (wheel included) ride in a
    file mount; setup installs the wheel from there."""
    from sky_helpers import ROOT

    rec, art, out = render_to(tmp_path, RECIPES[0], [f"targets.sky.workdir={ROOT}"])
    task = from_yaml(sky_lib, out)
    assert task.workdir == str(ROOT)
    assert task.file_mounts == {"~/dtlaunch-job": "."}
    doc = yaml.safe_load(art.files["task.yaml"])
    assert 'JOB_DIR="$HOME/dtlaunch-job"' in doc["run"]
    assert f'pip install "$HOME/dtlaunch-job/{wheel_name()}[train]"' in doc["setup"]


def test_autostop_can_be_turned_off(sky_lib, tmp_path):
    _, art, out = render_to(tmp_path, RECIPES[0], ["targets.sky.autostop_minutes=null"])
    assert "autostop" not in yaml.safe_load(art.files["task.yaml"])["resources"]
    (r,) = from_yaml(sky_lib, out).resources
    assert not (r.autostop_config and r.autostop_config.enabled)


# ----------------------------------------------------------------------------- the knobs users reach for first

LLAMA70B = next(p for p in RECIPES if p.stem == "llama70b")
IMAGE = "nvcr.io/nvidia/pytorch:24.05-py3"
KNOBS = [
    BUCKET,
    "checkpoint.dir=null",
    f"resources.image={IMAGE}",
    "targets.sky.disk_tier=high",
    "targets.sky.ports=[8888, '10000-10010']",
    "targets.sky.memory=256+",
    "targets.sky.cpus=32+",
]


@pytest.mark.parametrize("order", ["ordered", "any_of"])
def test_accelerator_fallbacks_and_knobs_are_accepted_by_skypilot(sky_lib, tmp_path, order):
    """SkyPilot gets one candidate per accelerator that can run the shipped plan (V100 cannot: no bf16), in
    dtlaunch's cheapest-first order for `ordered`; every other field applies to each candidate."""
    from launcher.plan.choices import plan_choices

    rec, art, out = render_to(
        tmp_path,
        LLAMA70B,
        KNOBS + ["targets.sky.accelerators=[A100-80GB:8, H200:8, V100:8]", f"targets.sky.fallback={order}"],
    )
    task = from_yaml(sky_lib, out)
    kept = [c.accelerator for c in plan_choices(rec).kept]
    assert sorted(kept) == ["A100-80GB:8", "H100:8", "H200:8"]
    got = [dict(r.accelerators) for r in task.resources]
    want = [{a.split(":")[0]: 8} for a in kept]
    if order == "ordered":  # a list, tried in this order
        assert isinstance(task.resources, list) and got == want
    else:  # a set: SkyPilot's optimizer picks
        assert isinstance(task.resources, set) and sorted(map(str, got)) == sorted(map(str, want))
    for r in task.resources:
        assert r.image_id == {None: f"docker:{IMAGE}"} and r.disk_tier.value == "high"
        assert r.ports == ["8888", "10000-10010"] and (r.memory, r.cpus) == ("256+", "32+")
        assert r.job_recovery["recover_on_exit_codes"] == [ExitCode.PREEMPTED]  # the common fields, on each
    doc = yaml.safe_load(art.files["task.yaml"])
    assert "accelerators" not in doc["resources"] and len(doc["resources"][order]) == 3
    assert json.loads(art.files["plan.json"])["plan"]["accelerator"] == "H100"  # the least memory (80 GB), first


def test_instance_type_and_cpus_are_accepted_by_skypilot(sky_lib, tmp_path):
    rec, art, out = render_to(
        tmp_path,
        RECIPES[0],
        [
            "resources.accelerator=cpu:4",
            "targets.sky.cpus=8",
            "targets.sky.instance_type=n2-standard-8",
            "targets.sky.infra=gcp",
        ],
    )
    (r,) = from_yaml(sky_lib, out).resources
    assert (r.instance_type, r.cpus, r.accelerators) == ("n2-standard-8", "8", None)


def test_disk_size_only_when_the_recipe_sets_it(tmp_path):
    """On Kubernetes a task's disk_size becomes an ephemeral-storage request each pod must meet (512 GB excluded
    most GPU node pools): the task names a disk size only when the recipe does."""
    tiny = next(p for p in RECIPES if p.name == "tiny.yaml")
    _, art, _ = render_to(tmp_path / "a", tiny, ["targets.sky.infra=k8s"])
    assert "disk_size" not in yaml.safe_load(art.files["task.yaml"])["resources"]
    _, art, _ = render_to(tmp_path / "b", tiny, ["targets.sky.infra=k8s", "targets.sky.disk_size=100"])
    assert yaml.safe_load(art.files["task.yaml"])["resources"]["disk_size"] == 100


def test_data_mounts_are_accepted_by_skypilot_and_silence_the_input_rule(sky_lib, tmp_path):
    """Weights and data reach the nodes through task file_mounts: a bucket as a MOUNT or COPY storage mount, a
    local directory copied; SkyPilot's own Task parses both, and validate is then quiet about the inputs."""
    local = tmp_path / "tokens"
    local.mkdir()
    rec, art, out = render_to(
        tmp_path / "out",
        RECIPES[0],
        [
            "training.data.source=file",
            "training.data.path=/data/tokens.bin",
            f"targets.sky.data_mounts=[{{path: /data, source: 's3://dtlaunch-test-bucket/tok', mode: MOUNT}}, "
            f"{{path: /copied, source: '{local}', mode: COPY}}]",
        ],
    )
    task = from_yaml(sky_lib, out)
    assert task.file_mounts == {"/copied": str(local)}  # SkyPilot's own reading: a local copy
    (storage,) = task.storage_mounts.items()
    assert storage[0] == "/data" and storage[1].source == "s3://dtlaunch-test-bucket/tok"
    assert storage[1].mode.value == "MOUNT"
    assert not [f for f in validate(rec, make_plan(rec), "sky") if f.rule == "sky-input-unmounted"]


def _pip_lines(setup: str) -> list[list[str]]:
    import shlex

    return [shlex.split(line) for line in setup.splitlines() if line.startswith("pip install")]


def test_with_an_image_the_wheel_leaves_the_images_torch_alone(tmp_path):
    """The README's kind of image (NGC, its own torch build): setup installs the wheel without dependencies and
    then only the pure-Python ones, so pip never replaces the image's torch. Resolved by pip itself (dry run,
    no index) in an environment whose torch is 2.4, as NGC 24.05 has; `wheel[train]`, what setup installed
    before, needs a torch from the index there."""
    import subprocess
    import sys

    tiny = next(p for p in RECIPES if p.stem == "tiny")
    _, art, out = render_to(tmp_path / "out", tiny, ["resources.image=nvcr.io/nvidia/pytorch:24.05-py3"])
    setup = yaml.safe_load(art.files["task.yaml"])["setup"]
    wheel_line, deps_line = _pip_lines(setup)
    assert wheel_line[:3] == ["pip", "install", "--no-deps"] and wheel_line[3].endswith(".whl")
    assert not [w for w in deps_line if w.lower().startswith("torch")] and "safetensors>=0.4" in deps_line
    env = tmp_path / "image-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    (site,) = env.glob("lib/python*/site-packages")
    # what the image has: its own torch, and (so that only torch decides) the other dependencies too
    for name, version in (
        ("torch", "2.4.0"),
        ("click", "8.1.7"),
        ("PyYAML", "6.0.2"),
        ("msgspec", "0.19.0"),
        ("pydantic", "2.7.0"),
        ("rich", "13.9.4"),
        ("Jinja2", "3.1.4"),
        ("MarkupSafe", "2.1.5"),
        ("safetensors", "0.4.5"),
        ("matplotlib", "3.9.2"),
        ("psutil", "6.1.0"),
        ("py-spy", "0.4.3"),
    ):
        # the wheel spec's folder name: the name with `-` as `_` (importlib.metadata finds a dist by its folder)
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text("")

    def pip(python, args, report):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(python),
                "install",
                "--dry-run",
                "--no-index",
                "--quiet",
                "--report",
                str(report),
                *args,
            ],
            cwd=out,
            capture_output=True,
            text=True,
        )

    p = pip(env / "bin" / "python", wheel_line[2:], tmp_path / "r1.json")
    assert p.returncode == 0, p.stderr
    installs = json.loads((tmp_path / "r1.json").read_text())["install"]
    assert [i["metadata"]["name"] for i in installs] == ["dtlaunch"]
    old = pip(env / "bin" / "python", [wheel_line[3] + "[train]"], tmp_path / "r0.json")
    assert old.returncode != 0 and "torch" in old.stderr  # it would fetch torch>=2.12 over the image's
    # the rest resolves without torch (satisfied here, where they are installed)
    p = pip(sys.executable, deps_line[2:], tmp_path / "r2.json")
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "r2.json").read_text())["install"] == []


def test_fresh_nodes_recovery_terminates_the_cluster_first(sky_lib, tmp_path):
    """targets.sky.recovery: fresh_nodes on an on-demand managed job: SkyPilot's EAGER_NEXT_REGION, whose recovery
    terminates the cluster before it provisions (FAILOVER relaunches on the cluster while it is up, keeping the
    node a 44 named); the installed SkyPilot takes it, and validate's straggler warning is gone."""
    over = [*VARIANTS["managed"], "targets.sky.recovery=fresh_nodes", "training.on_straggler=exit"]
    rec, art, out = render_to(tmp_path, RECIPES[0], over)
    (r,) = from_yaml(sky_lib, out).resources
    assert r.job_recovery["strategy"] == "EAGER_NEXT_REGION"
    found = {f.rule for f in validate(rec, make_plan(rec), "sky", RULES)}
    assert "sky-straggler-same-nodes" not in found
    rec, _, _ = render_to(tmp_path / "default", RECIPES[0], [*VARIANTS["managed"], "training.on_straggler=exit"])
    assert "sky-straggler-same-nodes" in {f.rule for f in validate(rec, make_plan(rec), "sky", RULES)}
