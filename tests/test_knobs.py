"""The knobs users reach for first, and containers, without a cluster or a cloud: every new field is checked
with a located error, rendered into #SBATCH lines, submitit's parameters or SkyPilot's resources, and the
container plumbing appears only when asked for. The real tools accept the results in
tests/slurm/test_knobs_cluster.py (sbatch --test-only, jobs), tests/slurm/test_containers.py (the rendered
scripts run, with stub runtimes) and tests/sky/test_render_schema.py (sky.Task.from_yaml)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import msgspec
import pytest
import yaml

from launcher.errors import RecipeError
from launcher.plan import make_plan
from launcher.plan.choices import plan_choices
from launcher.recipe import load, load_text
from launcher.recipe.images import for_apptainer, for_enroot, for_sky
from launcher.recipe.schema import parse
from launcher.render import render
from launcher.targets.registry import JobRecord, Registry
from launcher.targets.sky.request import SkyHandle
from launcher.targets.slurm.request import SlurmHandle, SubmititSpec
from launcher.targets.slurm.syntax import expand_hostlist
from launcher.validate import validate
from testpaths import RECIPES

IMAGE = "nvcr.io/nvidia/pytorch:24.05-py3"


def rendered(recipe: str, target: str, *overrides: str, out: Path | None = None):
    r = load(RECIPES / f"{recipe}.yaml", list(overrides))
    art = render(r, make_plan(r), target)
    if out is not None:
        art.write(out)
    return r, art


def sbatch_lines(art) -> list[str]:
    return [line[len("#SBATCH ") :] for line in art.files["job.sbatch"].splitlines() if line.startswith("#SBATCH ")]


def rules(recipe: str, target: str, *overrides: str) -> dict:
    r = load(RECIPES / f"{recipe}.yaml", list(overrides))
    return {f.rule: f for f in validate(r, make_plan(r), target)}


# ----------------------------------------------------------------------------- SLURM: rendering


def test_every_slurm_knob_is_an_sbatch_line():
    _, art = rendered(
        "llama3-8b",
        "slurm",
        "targets.slurm.mem_per_gpu=80G",
        "targets.slurm.cpus_per_gpu=8",
        "targets.slurm.gpu_type=h100",
        "targets.slurm.nodelist=[gpu01]",
        "targets.slurm.exclude=gpu[07-09]",
        "targets.slurm.reservation=big-run",
        "targets.slurm.dependency=afterok:123:124",
        "targets.slurm.mail_type=end,fail",
        "targets.slurm.mail_user=me@example.org",
    )
    lines = sbatch_lines(art)
    for want in (
        "--gpus-per-node=h100:8",
        "--cpus-per-gpu=8",
        "--mem-per-gpu=80G",
        "--reservation=big-run",
        "--nodelist=gpu01",
        "--exclude=gpu[07-09]",
        "--dependency=afterok:123:124",
        "--mail-type=END,FAIL",
        "--mail-user=me@example.org",
        "--exclusive",
    ):
        assert want in lines, (want, lines)
    # --mem-per-gpu replaces the --mem=0 an exclusive job otherwise gets: sbatch refuses both together.
    assert not any(line.startswith("--mem=") for line in lines)
    assert not any(line.startswith("--cpus-per-task") for line in lines)


def test_gres_for_clusters_without_cons_tres():
    _, typed = rendered("llama3-8b", "slurm", "targets.slurm.gpu_request=gres", "targets.slurm.gpu_type=a100")
    _, plain = rendered("llama3-8b", "slurm", "targets.slurm.gpu_request=gres")
    _, cpu = rendered("tiny", "slurm", "targets.slurm.gpu_request=gres")
    assert "--gres=gpu:a100:8" in sbatch_lines(typed) and not any("gpus-per-node" in x for x in sbatch_lines(typed))
    assert "--gres=gpu:8" in sbatch_lines(plain)
    assert not any("gres" in x or "gpus" in x for x in sbatch_lines(cpu))  # a CPU job asks for no GPUs either way


def test_per_gpu_options_need_gpus():
    """On a CPU recipe there is nothing to count per GPU: not rendered, and validate says so."""
    _, art = rendered("tiny", "slurm", "targets.slurm.cpus_per_gpu=2", "targets.slurm.mem_per_gpu=4G")
    assert not any("per-gpu" in x for x in sbatch_lines(art))
    found = rules("tiny", "slurm", "targets.slurm.cpus_per_gpu=2", "targets.slurm.mem_per_gpu=4G")
    assert {"slurm-cpus-per-gpu-without-gpus", "slurm-mem-per-gpu-without-gpus"} <= set(found)
    assert found["slurm-mem-per-gpu-without-gpus"].severity == "error"


def test_submitit_gets_the_knobs_as_named_parameters():
    _, art = rendered(
        "llama3-8b",
        "slurm",
        "targets.slurm.submit=submitit",
        "targets.slurm.mem_per_gpu=80G",
        "targets.slurm.cpus_per_gpu=8",
        "targets.slurm.gpu_request=gres",
        "targets.slurm.nodelist=gpu01",
        "targets.slurm.exclude=gpu07",
        "targets.slurm.reservation=big",
        "targets.slurm.dependency=singleton",
        "targets.slurm.mail_type=[ALL]",
        "targets.slurm.mail_user=me",
    )
    p = SubmititSpec.from_json(art.files["submitit.json"]).parameters
    assert (
        p["gres"],
        p["mem_per_gpu"],
        p["nodelist"],
        p["exclude"],
        p["dependency"],
        p["mail_type"],
        p["mail_user"],
    ) == ("gpu:8", "80G", "gpu01", "gpu07", "singleton", "ALL", "me")
    # No submitit parameter (reservation), or one that warns wrongly on every submit (cpus_per_gpu).
    assert p["additional_parameters"] == {
        "cpus-per-gpu": 8,
        "reservation": "big",
        "signal": "B:USR2@120",
        "requeue": True,
    }
    assert "mem" not in p and "gpus_per_node" not in p


# ----------------------------------------------------------------------------- SLURM: checking


@pytest.mark.parametrize(
    "override,words",
    [
        ("targets.slurm.dependency=afterOK:12", "did you mean 'afterok'"),
        ("targets.slurm.dependency=afterok:12?afterany:3,afterok:4", "one separator"),
        ("targets.slurm.dependency=afterok:$(id)", "is not a job id"),
        ("targets.slurm.dependency=afterok", "is not a dependency"),
        ("targets.slurm.nodelist=node[3-1]", "runs backwards"),
        ("targets.slurm.nodelist=/etc/hosts", "as a file"),
        ("targets.slurm.exclude=node[1-99999999]", "more than 100,000 hosts"),
        ("targets.slurm.nodelist=node 1", "is not a host name"),
        ("targets.slurm.mail_type=[END, FIAL]", "did you mean 'FAIL'"),
        ("targets.slurm.mail_user=me; rm -rf /", "should match pattern"),
        ("targets.slurm.reservation=a b", "should match pattern"),
        ("targets.slurm.mem_per_gpu=80 GB", "is not a SLURM memory size"),
        ("targets.slurm.mem_per_gpu=0", "above 0"),
        ("targets.slurm.gpu_request=tres", "gpus_per_node"),
        ("targets.slurm.gpu_type=a100:8", "should match pattern"),
        ("resources.image=docker://nvcr.io/nvidia/pytorch:24.05-py3", "without a scheme"),
        ("resources.image=/shared/train.sif", "targets.slurm.container.image"),
        ("resources.image=NVIDIA/PyTorch", "names are lowercase"),
        ("targets.slurm.container={runtime: docker}", "pyxis"),
        ("targets.slurm.container={runtime: pyxis, mounts: ['/a,/b']}", "no ',' or ':' inside a path"),
        ("targets.slurm.container={runtime: pyxis, mounts: ['data:/data']}", "absolute paths"),
        ("targets.slurm.container={runtime: pyxis, mounts: ['/a:/b:rprivate']}", "ro|rw"),
        ("targets.slurm.container={runtime: pyxis, image: '-v /x'}", "not starting with '-'"),
        ("targets.slurm.container={runtime: apptainer, image: '$(id).sif'}", "no spaces, commas, quotes or $"),
        ("targets.slurm.container={runtime: pyxis, workdir: relative/dir}", "should match pattern"),
    ],
)
def test_bad_values_are_located_recipe_errors(override, words):
    with pytest.raises(RecipeError) as e:
        load(RECIPES / "tiny.yaml", [override])
    (p,) = e.value.problems
    assert p.file == f"--set {override}" and p.field.startswith(override.split("=")[0]), p
    assert words in p.message, p.message


def test_mutually_exclusive_options_are_refused_at_the_later_field_with_its_line(tmp_path):
    text = (RECIPES / "tiny.yaml").read_text() + "\n".join(["  # appended", "", ""])
    doc = yaml.safe_load(text)
    doc["targets"]["slurm"] = {"mem": "100G", "mem_per_gpu": "10G", "cpus_per_task": 4, "cpus_per_gpu": 2}
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(RecipeError) as e:
        load(f)
    by_field = {p.field: p for p in e.value.problems}
    lines = f.read_text().splitlines()
    for field, words in (
        ("targets.slurm.mem_per_gpu", "only one of `mem`"),
        ("targets.slurm.cpus_per_gpu", "only one of `cpus_per_task`"),
    ):
        p = by_field[field]
        assert words in p.message and p.file == str(f)
        assert lines[p.line - 1].strip().startswith(field.rsplit(".", 1)[1] + ":"), (p.line, lines[p.line - 1])


def test_host_lists_and_dependencies_parse_like_slurm():
    assert expand_hostlist("node[01-03,07],gpu9") == ["node01", "node02", "node03", "node07", "gpu9"]
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    r = load(RECIPES / "tiny.yaml", ["targets.slurm.nodelist=[node1, 'node[3-4]']"])
    assert r.targets.slurm.nodelist == "node1,node[3-4]"  # a YAML list is joined
    # array tasks, a delay after `after`, singleton: as sbatch reads them
    dep = "afterok:1:2_3,after:4+10,singleton"
    assert load(RECIPES / "tiny.yaml", [f"targets.slurm.dependency={dep}"]).targets.slurm.dependency == dep


@pytest.mark.parametrize(
    "extra,clash",
    [
        ('["--mem-per-gpu=10G"]', "--mem=0"),  # beside the --mem=0 an exclusive job gets
        ('["--mem=10G"]', "--mem=0"),
        ('["-w node1"]', None),
        ('["--comment=nightly", "--hold"]', None),
        ('["--gres=nvme:1"]', None),  # another generic resource is fine
        ('["--gres=gpu:2"]', "--gpus-per-node"),
        ('["--time=1:00:00"]', "--time=24:00:00"),
    ],
)
def test_extra_sbatch_must_not_repeat_a_field(extra, clash):
    found = rules("llama3-8b", "slurm", f"targets.slurm.extra_sbatch={extra}")
    f = found.get("slurm-extra-sbatch-field")
    if clash is None:
        assert f is None, f
    else:
        assert f and clash in f.message and f.severity == "error", f
    with_field = rules("llama3-8b", "slurm", 'targets.slurm.extra_sbatch=["-w node1"]', "targets.slurm.nodelist=node2")
    assert "nodelist" in with_field["slurm-extra-sbatch-field"].fix
    gres = rules("llama3-8b", "slurm", 'targets.slurm.extra_sbatch=["--gres=nvme:1"]', "targets.slurm.gpu_request=gres")
    assert "gpu_request" in gres["slurm-extra-sbatch-field"].fix


def test_knob_rules_stay_quiet_when_used_as_meant():
    found = rules(
        "llama3-8b",
        "slurm",
        "targets.slurm.mem_per_gpu=80G",
        "targets.slurm.cpus_per_gpu=8",
        "targets.slurm.nodelist=gpu01",
        "targets.slurm.exclude=gpu[02-09]",
        "targets.slurm.mail_type=[END]",
        "targets.slurm.mail_user=me",
        f"resources.image={IMAGE}",
        "targets.slurm.container={runtime: pyxis}",
    )
    before = rules("llama3-8b", "slurm")
    assert set(found) == set(before), found


def test_recipe_hash_is_unchanged_by_fields_left_unset():
    """A recipe's identity is what it gives that differs from the defaults: a newer dtlaunch that only adds
    optional fields cannot change an old recipe's hash, with no list of new fields to keep. Stated here
    independently of the code: the hash of the non-default fields as written (the second recipe also holds the
    optional sections, nested)."""
    import hashlib
    import json

    base = {"name": "digest", "model": {"preset": "tiny"}, "training": {"steps": 10}}
    full = {
        **base,
        "entrypoint": {"script": "train.py"},
        "targets": {
            "slurm": {"container": {"runtime": "pyxis"}, "ssh": {"host": "login"}},
            "sky": {"checkpoint_storage": {"bucket": "s3://b/ckpt"}},
        },
    }
    for given in (base, full):
        written = hashlib.sha256(json.dumps(given, sort_keys=True).encode()).hexdigest()[:16]
        assert parse(given).digest() == written, given
    r = load(RECIPES / "tiny.yaml")
    for written in (
        "targets.slurm.gpu_request=gpus_per_node",
        "targets.sky.accelerators=[]",
        "targets.sky.fallback=ordered",
        "targets.sky.ports=[]",
        "parallelism.pipeline_schedule=1f1b",
    ):
        assert load(RECIPES / "tiny.yaml", [written]).digest() == r.digest(), written  # a default written out
    for changed in ("targets.slurm.reservation=x", "targets.slurm.gpu_request=gres", "resources.image=org/train:1"):
        assert load(RECIPES / "tiny.yaml", [changed]).digest() != r.digest(), changed


# ----------------------------------------------------------------------------- containers: rendering


def test_image_spellings_per_runtime():
    assert for_sky(IMAGE) == "docker:nvcr.io/nvidia/pytorch:24.05-py3"
    assert for_apptainer(IMAGE) == "docker://nvcr.io/nvidia/pytorch:24.05-py3"
    assert for_enroot(IMAGE) == "nvcr.io#nvidia/pytorch:24.05-py3"  # enroot: REGISTRY#IMAGE
    hub = "pytorch/pytorch:2.3.1-cuda12.1-cudnn8-runtime"
    assert for_enroot(hub) == hub and for_apptainer(hub) == f"docker://{hub}"  # Docker Hub: no registry
    assert for_enroot("localhost:5000/team/train") == "localhost:5000#team/train"
    digest = "ghcr.io/org/img@sha256:" + "a" * 64
    assert for_enroot(digest) == "ghcr.io#org/img@sha256:" + "a" * 64


def test_no_container_renders_nothing_of_it():
    _, art = rendered("tiny", "slurm")
    text = art.files["job.sbatch"] + art.files["step.sh"]
    assert "container" not in text.lower() and "apptainer" not in text
    # no image to start on every node first: each node's torchrun agent checks its node before the rendezvous
    assert "launcher.runtime.train" not in art.files["job.sbatch"] and "--check-environment" in art.files["job.sbatch"]
    assert '"$PYTHON" -m launcher.runtime.elastic "--check-plan=$DTLAUNCH_PLAN" "--nnodes=' in art.files["step.sh"]


def test_pyxis_flags_on_srun_and_the_check_inside_the_image(tmp_path):
    _, art = rendered(
        "tiny",
        "slurm",
        f"resources.image={IMAGE}",
        "checkpoint.dir=/shared/ckpt/{run_id}",
        "targets.slurm.container={runtime: pyxis, mounts: ['/datasets:/data:ro', /scratch]}",
    )
    job, step = art.files["job.sbatch"], art.files["step.sh"]
    flags = (
        "'--container-image=nvcr.io#nvidia/pytorch:24.05-py3' \"--container-mounts=$CONTAINER_MOUNTS\" "
        '"--container-workdir=$SUBMIT_DIR" "--container-name=dtlaunch-$SLURM_JOB_ID"'
    )
    assert f'{flags} bash "$SUBMIT_DIR/step.sh" > >(tee' in job  # the training step
    # the check on every node, before the training step (each node imports the image outside the join window)
    check = f'srun "--nodes=$SLURM_NNODES" "--ntasks=$SLURM_NNODES" --ntasks-per-node=1 {flags} bash "$SUBMIT_DIR/step.sh" --check'
    assert check in job and job.index(check) < job.index("srun --kill-on-bad-exit=1 --wait=60")
    # the job's environment for inside the container, written before the check; step.sh sources it there
    assert job.index('export DTLAUNCH_JOB_ENV="$JOB_DIR/env-$ATTEMPT.sh"') < job.index(check)
    assert '. "$DTLAUNCH_JOB_ENV"' in step
    # the named container removed on every node when the job ends for good
    assert (
        'srun "--nodes=$SLURM_NNODES" "--ntasks=$SLURM_NNODES" --ntasks-per-node=1 enroot remove --force '
        '"pyxis_dtlaunch-$SLURM_JOB_ID"'
    ) in job
    assert (
        'CONTAINER_MOUNTS="$SUBMIT_DIR:$SUBMIT_DIR",/shared/ckpt:/shared/ckpt,/datasets:/data:ro,/scratch:/scratch'
        in job
    )
    assert "mkdir -p /shared/ckpt ||" in job
    # The batch shell (on the host) resolves no interpreter; step.sh does, inside the container.
    assert "command -v python3" not in job and 'PYTHON="${DTLAUNCH_PYTHON:-$(command -v python3' in step
    assert '"$PYTHON" -m launcher.runtime.train --plan "$DTLAUNCH_PLAN" --check' in step


@pytest.mark.parametrize(
    "runtime,recipe,nv",
    [("apptainer", "tiny", False), ("apptainer", "llama3-8b", True), ("singularity", "tiny", False)],
)
def test_apptainer_wraps_torchrun_and_the_check(runtime, recipe, nv):
    _, art = rendered(recipe, "slurm", f"resources.image={IMAGE}", f"targets.slurm.container={{runtime: {runtime}}}")
    job, step = art.files["job.sbatch"], art.files["step.sh"]
    sif = re.search(r'SIF="\$SUBMIT_DIR/"(image-[0-9a-f]{12}\.sif)', job).group(1)
    assert f'{runtime} pull "$SIF.part-$SLURM_JOB_ID" docker://{IMAGE}' in job  # once, into the submit directory
    prefix = (
        f'{runtime} exec {"--nv " if nv else ""}--bind "$CONTAINER_MOUNTS" --env-file "$DTLAUNCH_JOB_ENV" '
        f'--pwd "$PWD" "$SUBMIT_DIR/{sif}"'
    )
    assert f'{prefix} "$PYTHON" -m launcher.runtime.elastic' in step
    assert f'{prefix} "$PYTHON" -m launcher.runtime.train --plan "$DTLAUNCH_PLAN" --check' in step
    assert 'PYTHON="${DTLAUNCH_PYTHON:-python3}"' in step  # looked up on the image's PATH
    assert (
        'srun "--nodes=$SLURM_NNODES" "--ntasks=$SLURM_NNODES" --ntasks-per-node=1 bash "$SUBMIT_DIR/step.sh" '
        "--check || CHECK_RC=$?"
    ) in job  # on every node
    assert "--container-" not in job and ("--nv" in step) == nv and "enroot" not in job


def test_site_image_and_workdir_are_used_as_written():
    _, art = rendered(
        "tiny",
        "slurm",
        "targets.slurm.container={runtime: apptainer, image: /shared/img/train.sif, workdir: /workspace}",
    )
    assert "--pwd /workspace /shared/img/train.sif" in art.files["step.sh"]
    _, art = rendered(
        "tiny", "slurm", "targets.slurm.container={runtime: pyxis, image: /shared/img/train.sqsh, workdir: /workspace}"
    )
    assert "--container-image=/shared/img/train.sqsh --container-mounts" in art.files["job.sbatch"].replace('"', "")
    assert "--container-workdir=/workspace" in art.files["job.sbatch"]


@pytest.mark.parametrize(
    "variant",
    [
        ["targets.slurm.container={runtime: pyxis}"],
        ["targets.slurm.container={runtime: apptainer}"],
        ["targets.slurm.container={runtime: pyxis}", "targets.slurm.submit=submitit"],
        ["targets.slurm.container={runtime: apptainer}", "targets.slurm.submit=submitit"],
        ["targets.slurm.container={runtime: pyxis, mounts: [/data]}", "entrypoint={module: train, workdir: .}"],
    ],
    ids=["pyxis", "apptainer", "pyxis-submitit", "apptainer-submitit", "pyxis-entrypoint"],
)
def test_container_scripts_pass_bash_n_and_shellcheck(variant, tmp_path):
    _, art = rendered("tiny", "slurm", f"resources.image={IMAGE}", *variant, out=tmp_path)
    for name in ("job.sbatch", "step.sh", "submitit_setup.sh"):
        if name not in art.files:
            continue
        for argv in (["bash", "-n"], ["shellcheck", "-S", "warning", "-s", "bash"]):
            p = subprocess.run([*argv, str(tmp_path / name)], capture_output=True, text=True)
            assert p.returncode == 0, (name, p.stdout, p.stderr)


def test_submitit_with_a_container_keeps_the_host_python_for_itself():
    """submitit's own process runs on the host (it needs submitit and dtlaunch there); the plan check and the
    training run in the image."""
    _, art = rendered(
        "tiny",
        "slurm",
        f"resources.image={IMAGE}",
        "targets.slurm.container={runtime: pyxis}",
        "targets.slurm.submit=submitit",
    )
    pre = art.files["submitit_setup.sh"]
    assert 'PYTHON="${DTLAUNCH_PYTHON:-$(command -v python3' in pre
    assert '"$PYTHON" -m launcher.runtime.train' not in pre and 'bash "$SUBMIT_DIR/step.sh" --check' in pre
    assert pre.index('bash "$SUBMIT_DIR/step.sh" --check') < pre.index("import submitit")
    srun = SubmititSpec.from_json(art.files["submitit.json"]).step["srun"]
    assert srun[-4:] == [
        "--container-workdir=$SUBMIT_DIR",
        "--container-name=dtlaunch-$SLURM_JOB_ID",
        "bash",
        "$SUBMIT_DIR/step.sh",
    ]
    assert "--container-image=nvcr.io#nvidia/pytorch:24.05-py3" in srun


def test_container_rules():
    assert "slurm-image-no-container" in rules("tiny", "slurm", f"resources.image={IMAGE}")
    assert "slurm-container-no-image" in rules("tiny", "slurm", "targets.slurm.container={runtime: pyxis}")
    found = rules(
        "tiny",
        "slurm",
        f"resources.image={IMAGE}",
        "targets.slurm.container={runtime: pyxis}",
        "training.data.source=file",
        "training.data.path=/datasets/t.bin",
    )
    assert "/datasets:/datasets:ro" in found["slurm-container-input-unmounted"].fix
    assert found["slurm-container-input-unmounted"].severity == "error"
    found = rules(
        "tiny",
        "slurm",
        f"resources.image={IMAGE}",
        "targets.slurm.container={runtime: pyxis, mounts: ['/datasets:/datasets:ro']}",
        "training.data.source=file",
        "training.data.path=/datasets/t.bin",
    )
    assert "slurm-container-input-unmounted" not in found


def test_inputs_must_lie_under_a_mount_on_the_cloud():
    """A render-host path for data or weights fails on every cloud node; under a data mount it is fine."""
    data = ("training.data.source=file", "training.data.path=/inputs/t.bin")
    assert "sky-input-unmounted" in rules("tiny", "sky", *data)
    assert "sky-input-unmounted" not in rules(
        "tiny", "sky", *data, "targets.sky.data_mounts=[{path: /inputs, source: s3://b/tok, mode: MOUNT}]"
    )
    assert "sky-input-unmounted" not in rules(
        "tiny", "sky", *data, "targets.sky.data_mounts=[{path: /inputs, source: /home/me/tok, mode: COPY}]"
    )


# ----------------------------------------------------------------------------- SkyPilot


FALLBACKS = "targets.sky.accelerators=[A100-80GB:8, L4:8, V100:8, H100:4]"


def test_fallbacks_are_planned_one_by_one_and_the_shipped_plan_fits_all():
    r = load(RECIPES / "llama70b.yaml", [FALLBACKS])
    ch = plan_choices(r)
    by = {c.accelerator: c for c in ch.choices}
    assert list(by) == ["H100:8", "A100-80GB:8", "L4:8", "V100:8", "H100:4"]
    assert "no bf16" in by["V100:8"].dropped and "one world size" in by["H100:4"].dropped
    assert ch.basis == "L4:8" and ch.shipped.accelerator == "L4"  # the least memory per device
    for c in ch.kept:
        assert ch.shipped.memory.total <= c.device.memory_gb * 1e9
    costs = [c.usd for c in ch.kept]
    assert costs == sorted(costs) and [c.accelerator for c in ch.kept][0] == "H100:8"  # cheapest run first
    anyof = plan_choices(load(RECIPES / "llama70b.yaml", [FALLBACKS, "targets.sky.fallback=any_of"]))
    assert [c.accelerator for c in anyof.kept] == ["H100:8", "A100-80GB:8", "L4:8"]  # SkyPilot picks


def test_a_fallback_that_does_not_fit_is_dropped_and_the_rest_ship_the_primarys_plan():
    # DDP keeps 16 bytes per parameter on every GPU: 3B parameters fit 80 GB devices, not 24 GB ones.
    over = [
        "model={params: 3000000000}",
        "parallelism.strategy=ddp",
        "resources.accelerator=H100:2",
        "targets.sky.accelerators=[L4:2, A100-80GB:2]",
    ]
    ch = plan_choices(load(RECIPES / "tiny.yaml", over))
    (l4,) = [c for c in ch.choices if c.accelerator == "L4:2"]
    assert l4.dropped.startswith("its own plan (ddp) needs") and "of 24 GB" in l4.dropped
    assert ch.basis == "H100:2" and [c.accelerator for c in ch.kept] == ["H100:2", "A100-80GB:2"]
    assert "L4:2: its own plan" in rules("tiny", "sky", *over)["sky-fallback-dropped"].message


def test_sky_task_lists_the_kept_accelerators_and_ships_their_plan():
    r, art = rendered(
        "llama70b",
        "sky",
        FALLBACKS,
        "targets.sky.checkpoint_storage={bucket: 's3://b/c'}",
        "checkpoint.dir=null",
        f"resources.image={IMAGE}",
        "targets.sky.disk_tier=best",
        "targets.sky.ports=[8888, '10000-10010']",
    )
    res = yaml.safe_load(art.files["task.yaml"])["resources"]
    assert res["ordered"] == [{"accelerators": "H100:8"}, {"accelerators": "A100-80GB:8"}, {"accelerators": "L4:8"}]
    assert "accelerators" not in res and res["image_id"] == f"docker:{IMAGE}"
    assert res["disk_tier"] == "best" and res["ports"] == [8888, "10000-10010"]
    shipped = json.loads(art.files["plan.json"])["plan"]
    assert shipped["accelerator"] == "L4" and shipped["memory"] == msgspec.to_builtins(plan_choices(r).shipped.memory)
    assert any("V100:8 dropped" in n for n in art.notes)
    # Without fallbacks the task and its plan are the recipe's own.
    _, plain = rendered("llama70b", "sky", "targets.sky.checkpoint_storage={bucket: 's3://b/c'}", "checkpoint.dir=null")
    assert yaml.safe_load(plain.files["task.yaml"])["resources"]["accelerators"] == "H100:8"
    assert json.loads(plain.files["plan.json"])["plan"]["accelerator"] == "H100"


def test_sky_instance_cpus_memory():
    _, art = rendered(
        "tiny", "sky", "targets.sky.instance_type=n2-standard-8", "targets.sky.cpus=8+", "targets.sky.memory=32"
    )
    res = yaml.safe_load(art.files["task.yaml"])["resources"]
    assert (res["instance_type"], res["cpus"], res["memory"]) == ("n2-standard-8", "8+", "32")
    assert rules("tiny", "sky", "targets.sky.cpus=1").get("sky-cpus-fewer-than-ranks")


@pytest.mark.parametrize(
    "override,words",
    [
        ("targets.sky.ports=[0]", "1-65535"),
        ("targets.sky.ports=['9000-8000']", "LOW-HIGH"),
        ("targets.sky.ports=[true]", "not true/false"),
        ("targets.sky.cpus=-1", "positive number"),
        ("targets.sky.memory=lots", "positive number"),
        ("targets.sky.disk_tier=fastest", "'best'"),
        ("targets.sky.accelerators=[H100:eight]", "whole number"),
        ("targets.sky.accelerators=[cpu:8]", "no cpu"),
        ("targets.sky.accelerators=[H1000:8]", "did you mean 'H100'"),
        ("targets.sky.fallback=cheapest", "any_of"),
        ("targets.sky.instance_type=p5 48xlarge", "should match pattern"),
    ],
)
def test_bad_sky_values_are_located_recipe_errors(override, words):
    with pytest.raises(RecipeError) as e:
        load(RECIPES / "tiny.yaml", [override])
    (p,) = e.value.problems
    assert p.file == f"--set {override}" and words in p.message, p


def test_plan_shows_the_per_accelerator_table(run_cli):
    code, out, _ = run_cli("plan", RECIPES / "llama70b.yaml", "--set", FALLBACKS)
    assert code == 0 and "SkyPilot accelerators (ordered)" in out and "L4:8" in out and "V100:8 dropped" in out
    code, out, _ = run_cli("plan", RECIPES / "llama70b.yaml", "--json", "--set", FALLBACKS)
    rows = {r["accelerator"]: r for r in json.loads(out)["sky_accelerators"]}
    assert rows["L4:8"]["shipped"] and rows["H100:8"]["rank"] == 1 and rows["V100:8"]["rank"] is None
    code, out, _ = run_cli("plan", RECIPES / "llama70b.yaml", "--json")
    assert "sky_accelerators" not in json.loads(out)


# ----------------------------------------------------------------------------- up --after


def test_up_after_adds_the_dependency_by_id_or_name(run_cli, tmp_path):
    Registry().add(JobRecord("train", "slurm", "77", str(tmp_path), SlurmHandle(str(tmp_path), "train")))
    Registry().add(JobRecord("cloud", "sky", "5", str(tmp_path), SkyHandle("c", False, 5)))
    code, out, err = run_cli(
        "up",
        RECIPES / "tiny.yaml",
        "-t",
        "slurm",
        "--dry-run",
        "-o",
        tmp_path / "a",
        "--after",
        "train",
        "--after",
        "80",
        "--set",
        "targets.slurm.dependency=afterany:5",
    )
    assert code == 0, err
    assert "#SBATCH --dependency=afterany:5,afterok:77:80" in (tmp_path / "a" / "job.sbatch").read_text()
    assert "dependency: afterany:5,afterok:77:80" in (tmp_path / "a" / "recipe.yaml").read_text()
    for args, words in (
        (["--after", "cloud"], "that is a sky job"),
        (["--after", "nope"], "no job named 'nope'"),
        (["--after", "80", "-t", "local"], "--after chains SLURM jobs"),
        (["--after", "80", "--set", "targets.slurm.dependency=afterok:1?afterok:2"], "'any of'"),
        (["--after", "80", "--set", "targets.slurm.ssh={host: login.example}"], "job ids are per"),
    ):
        if "job ids are per" in words:
            args = ["--after", "train", *args[2:]]
        code, _, err = run_cli("up", RECIPES / "tiny.yaml", "-t", "slurm", "--dry-run", "-o", tmp_path / "b", *args)
        assert code != 0 and words in err, (args, err)


def test_help_lists_the_after_option(run_cli):
    code, out, _ = run_cli("up", "--help")
    assert code == 0 and re.search(r"--after JOB", out)


# ----------------------------------------------------------------------------- extra_sbatch: refused where render would refuse it

L70 = RECIPES / "llama70b.yaml"
TINY = RECIPES / "tiny.yaml"

BAD_ENTRIES = [
    ("", "is not an sbatch option"),
    ("   ", "is not an sbatch option"),
    ("comment=x", "is not an sbatch option"),
    ("rm -rf /", "is not an sbatch option"),
    ("-", "is not an sbatch option"),
    ("--", "is not an sbatch option"),
    ("--=x", "is not an sbatch option"),
]


@pytest.mark.parametrize("entry,words", BAD_ENTRIES)
def test_an_extra_sbatch_entry_render_refuses_is_refused_located_by_every_command(run_cli, tmp_path, entry, words):
    item = f"targets.slurm.extra_sbatch={json.dumps([entry])}"
    for args in (["validate", L70, "-t", "slurm"], ["render", L70, "-t", "slurm", "-o", tmp_path / "r"], ["plan", L70]):
        code, out, err = run_cli(*args, "--set", item)
        text = out + err
        assert code not in (0, 70) and "internal error" not in text, (args, text)
        # validate lists it as a finding, the others as the error they stop with
        where = "error [recipe] " if args[0] == "validate" else ""
        assert f"--set {item}: {where}targets.slurm.extra_sbatch.0: " in text and words in text, (args, text)
        assert "fix: " in text


@pytest.mark.parametrize(
    "entry,words", [("-w node1", "submitit writes long options only"), ("--comment=a\\b", "backslash")]
)
def test_what_submitit_refuses_in_extra_sbatch_is_refused_located(run_cli, entry, words):
    item = f"targets.slurm.extra_sbatch={json.dumps([entry])}"
    code, out, _ = run_cli("validate", L70, "-t", "slurm", "--set", "targets.slurm.submit=submitit", "--set", item)
    assert code == 1 and words in out and f"--set {item}: error [recipe]" in out, out
    # the same entries are fine for sbatch
    code, _, err = run_cli("validate", TINY, "-t", "slurm", "--set", item)
    assert code == 0, err


def test_an_extra_sbatch_entry_in_the_file_is_reported_at_its_line():
    text = TINY.read_text() + "  slurm:\n    extra_sbatch:\n      - --hold\n      - comment=nightly\n"
    line = text.splitlines().index("      - comment=nightly") + 1
    with pytest.raises(RecipeError) as e:
        load_text(text, "r.yaml")
    (p,) = e.value.problems
    assert (p.file, p.line, p.field) == ("r.yaml", line, "targets.slurm.extra_sbatch.1"), p


def test_the_plan_options_rule_reads_every_entry_the_loader_passes():
    for entry, hit in (
        ("-N 2", True),
        ("--nodes=2", True),
        ("--ntasks-per-node 2", True),
        ("--hold", False),
        ("-w node1", False),
    ):
        r = load(TINY, [f"targets.slurm.extra_sbatch={json.dumps([entry])}"])
        rules = {f.rule for f in validate(r, make_plan(r), "slurm")}
        assert ("slurm-extra-sbatch-plan" in rules) == hit, entry
