"""Containers on the real local SLURM cluster, with stub runtimes: the rendered job scripts run as they would
on a cluster with pyxis or Apptainer, and training really starts and completes on two nodes.

What is stubbed, and why: Debian 12 packages neither Apptainer nor Singularity (`apt-cache policy apptainer
singularity-container`: no candidate; `singularity` is a game), and pyxis is a SPANK plugin built against a
site's SLURM with enroot, neither packaged. So:

* `apptainer` is a stub on PATH: it checks that it is called as `apptainer exec [--nv] --bind LIST --pwd DIR
  IMAGE CMD...`, that every bind source exists (Apptainer refuses a missing one), records the call, enters DIR
  and runs CMD on the host.
* `srun` is a stub on PATH in front of the real one: it takes out the `--container-*` options (what pyxis
  consumes), records them, checks that every mount is SRC:DST with an existing SRC (what pyxis needs), enters
  the container workdir, and runs the real /usr/bin/srun with the rest.

* `enroot` is a stub on PATH: it records `enroot remove` calls (the job removes its named pyxis container).

Both container stubs give the command the environment precedence the real runtimes have: the image's own
variables win over the host's (pyxis: spank_import_container_env keeps an image value unless the variable is
named in --container-env; Apptainer: a host variable does not override one the image sets, but --env-file
does). The stub "image" sets PYTHONPATH to a directory whose `launcher` package refuses to import and
MASTER_PORT to a port that cannot exist (enroot's PyTorch hook writes its own MASTER_PORT; Megatron and NeMo
images set PYTHONPATH): a job that let the image's values stand would import the wrong dtlaunch or fail its
rendezvous. `apptainer pull DEST SRC` writes DEST; `exec` takes only an existing image file.

No image is pulled and no filesystem is remapped; every mount the scripts ask for is at its own path, so the
host paths are what the container would see. Everything else is real: sbatch, the cluster's two nodes, the
batch shell, torchrun, the runtime, its checkpoints, and submitit for the submitit variant.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest

from launcher.render.package import wheel_name
from slurmkit import REPO, VENV_ACTIVATE, render_to, result, sacct_rows, sh, shared_dir, wait_gone

IMAGE = "nvcr.io/nvidia/pytorch:24.05-py3"
STEPS = 4

# The image's environment, as the runtimes apply it over the host's (see the module docstring).
IMAGE_ENV = r"""
apply_image_env() {  # $1: names kept from the host (pyxis --container-env), comma-separated
  local k v
  while IFS='=' read -r k v; do
    [ -n "$k" ] || continue
    case ",${1:-}," in *",$k,"*) continue ;; esac
    export "$k=$v"
  done < "${STUB_IMAGE_ENV:?}"
}
"""

APPTAINER = (
    r"""#!/usr/bin/env bash
# Stub apptainer (see the test module's docstring): checks the call, records it, runs CMD on the host.
set -uo pipefail
log=${STUB_LOG:?STUB_LOG unset: the job did not inherit the submitting environment}
"""
    + IMAGE_ENV
    + r"""
if [ "${1:-}" = pull ]; then
  [ $# = 3 ] || { echo "stub apptainer: pull DEST SRC expected" >&2; exit 97; }
  [ ! -e "$2" ] || { echo "stub apptainer: $2 exists" >&2; exit 97; }
  echo "SIF of $3" > "$2"
  printf 'op=pull host=%s dest=%s image=%s cmd=\n' "$(hostname)" "$2" "$3" >> "$log"
  exit 0
fi
[ "${1:-}" = exec ] || { echo "stub apptainer: expected 'exec' or 'pull', got '${1:-}'" >&2; exit 97; }
shift
nv=0 bind="" pwd="" envfile=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nv) nv=1; shift ;;
    --bind) bind=$2; shift 2 ;;
    --pwd) pwd=$2; shift 2 ;;
    --env-file) envfile=$2; shift 2 ;;
    -*) echo "stub apptainer: unexpected option $1" >&2; exit 97 ;;
    *) break ;;
  esac
done
image=${1:?stub apptainer: no image}; shift
[ -n "$bind" ] && [ -n "$pwd" ] || { echo "stub apptainer: --bind and --pwd expected" >&2; exit 97; }
[ -f "$image" ] || { echo "stub apptainer: image file $image does not exist (pull it first)" >&2; exit 97; }
IFS=, read -ra mounts <<< "$bind"
for m in "${mounts[@]}"; do
  [ -e "${m%%:*}" ] || { echo "stub apptainer: bind source ${m%%:*} does not exist" >&2; exit 97; }
done
apply_image_env ""
if [ -n "$envfile" ]; then set -a; . "$envfile" || exit 97; set +a; fi  # --env-file: over the image's values
printf 'op=exec host=%s image=%s nv=%s bind=%s pwd=%s envfile=%s pythonpath=%s master_port=%s cmd=%s\n' \
  "$(hostname)" "$image" "$nv" "$bind" "$pwd" "$envfile" "${PYTHONPATH:-}" "${MASTER_PORT:-}" "$*" >> "$log"
cd "$pwd" || exit 97
exec "$@"
"""
)

PYXIS_SRUN = (
    r"""#!/usr/bin/env bash
# Stub pyxis (see the test module's docstring): srun without the --container-* options pyxis would consume.
set -uo pipefail
"""
    + IMAGE_ENV
    + r"""
args=() image="" mounts="" workdir="" name="" keep=""
for a in "$@"; do
  case "$a" in
    --container-image=*) image=${a#*=} ;;
    --container-mounts=*) mounts=${a#*=} ;;
    --container-workdir=*) workdir=${a#*=} ;;
    --container-name=*) name=${a#*=} ;;
    --container-env=*) keep=${a#*=} ;;
    --container-*) echo "stub pyxis: unexpected option $a" >&2; exit 97 ;;
    *) args+=("$a") ;;
  esac
done
if [ -n "$image" ]; then
  IFS=, read -ra list <<< "$mounts"
  for m in "${list[@]}"; do
    case "$m" in /*:/*) ;; *) echo "stub pyxis: mount '$m' is not SRC:DST" >&2; exit 97 ;; esac
    [ -e "${m%%:*}" ] || { echo "stub pyxis: mount source ${m%%:*} does not exist" >&2; exit 97; }
  done
  apply_image_env "$keep"
  printf 'op=srun host=%s image=%s mounts=%s workdir=%s name=%s pythonpath=%s cmd=%s\n' "$(hostname)" "$image" \
    "$mounts" "$workdir" "$name" "${PYTHONPATH:-}" "${args[*]}" >> "${STUB_LOG:?}"
  cd "$workdir" || exit 97
fi
exec /usr/bin/srun "${args[@]}"
"""
)

ENROOT = r"""#!/usr/bin/env bash
# Stub enroot: records `enroot remove` (the job's named pyxis container, removed when the job ends for good).
set -uo pipefail
[ "${1:-}" = remove ] || { echo "stub enroot: only 'remove' expected, got '${1:-}'" >&2; exit 97; }
shift
[ "${1:-}" = --force ] && shift
printf 'op=remove host=%s name=%s cmd=\n' "$(hostname)" "$*" >> "${STUB_LOG:?}"
"""


@pytest.fixture
def stubs(tmp_path, monkeypatch):
    """A bin directory first on PATH (sbatch passes the submitting environment to the job) and the call log."""
    bin_dir = tmp_path / "stub-bin"
    bin_dir.mkdir()
    for name, text in (("apptainer", APPTAINER), ("srun", PYXIS_SRUN), ("enroot", ENROOT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "stub-calls.log"
    # The image's own environment: a dtlaunch that must not be imported, a rendezvous port that cannot exist.
    site = tmp_path / "image-site" / "launcher"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("raise SystemExit('imported the image\\'s launcher, not the job\\'s wheel')\n")
    image_env = tmp_path / "image.env"
    image_env.write_text(f"PYTHONPATH={site.parent}\nMASTER_PORT=99999\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("STUB_LOG", str(log))
    monkeypatch.setenv("STUB_IMAGE_ENV", str(image_env))
    for name in ("DTLAUNCH_FAULT", "DTLAUNCH_RUN_ID", "DTLAUNCH_PYTHON"):
        monkeypatch.delenv(name, raising=False)
    return log


def container_overrides(partition: str, tmp: Path, container: str, *extra: str) -> list[str]:
    (tmp / "datasets").mkdir(exist_ok=True)
    return [
        f"targets.slurm.partition={partition}",
        "resources.nodes=2",
        "resources.accelerator=cpu:1",
        f"training.steps={STEPS}",
        "checkpoint.every=2",
        f"checkpoint.dir={shared_dir(tmp)}/ckpt-root/{{run_id}}",
        f"resources.image={IMAGE}",
        f'targets.slurm.setup=["source {VENV_ACTIVATE}"]',
        "targets.slurm.max_failures=0",
        f"targets.slurm.container={{runtime: {container}, mounts: ['{tmp}/datasets:/datasets:ro']}}",
        *extra,
    ]


def calls(log: Path) -> list[dict]:
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        head, _, cmd = line.partition(" cmd=")
        out.append({**dict(kv.split("=", 1) for kv in shlex.split(head)), "cmd": cmd})
    return out


def mounts(submit: str, tmp: Path) -> str:
    """The submit directory, the checkpoint root (absolute checkpoint.dir), then the recipe's own mounts."""
    return f"{submit}:{submit},{shared_dir(tmp)}/ckpt-root:{shared_dir(tmp)}/ckpt-root,{tmp}/datasets:/datasets:ro"


def run_job(out: Path) -> str:
    job = sh("sbatch", "--parsable", "job.sbatch", cwd=out).stdout.strip().split(";")[0]
    wait_gone(job, 180)
    return job


def assert_wheel_first(c: dict, submit: str) -> None:
    """The job imports the dtlaunch that rendered it from the shipped wheel, ahead of anything installed."""
    assert c["pythonpath"].startswith(f"{submit}/{wheel_name()}"), c
    assert (Path(submit) / wheel_name()).is_file()


def assert_trained(out: Path, job: str, log_text: str) -> None:
    state = out / "jobs" / job / "state"
    assert state.exists() and state.read_text().strip() == "COMPLETED", log_text[-4000:]
    assert "dtlaunch: check ok" in log_text  # the interpreter check ran (inside the "container")
    run = out / "runs" / job
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(steps) >= STEPS, log_text[-3000:]


@pytest.mark.slow
def test_apptainer_runs_torchrun_in_the_image_on_every_node(tmp_path, partition, stubs):
    out = tmp_path / "job"
    render_to(out, "tiny", container_overrides(partition, tmp_path, "apptainer"))
    job = run_job(out)
    log_text = (out / f"tiny-{job}.out").read_text()
    assert_trained(out, job, log_text)  # despite the image's PYTHONPATH and MASTER_PORT
    got = calls(stubs)
    pulls = [c for c in got if c["op"] == "pull"]
    execs = [c for c in got if c["op"] == "exec"]
    check = [c for c in execs if "--check" in c["cmd"]]
    train = [c for c in execs if "launcher.runtime.elastic" in c["cmd"]]
    submit = str(out.resolve())
    # the registry image converted once, into the submit directory, then run from there on every node
    assert [(c["host"], c["image"]) for c in pulls] == [("node1", f"docker://{IMAGE}")], got
    sif = pulls[0]["dest"].rsplit(".part-", 1)[0]
    assert Path(sif).parent == Path(submit) and Path(sif).is_file() and not list(Path(submit).glob("*.part-*"))
    assert sorted(c["host"] for c in check) == ["node1", "node2"], got  # the check on every node
    assert sorted(c["host"] for c in train) == ["node1", "node2"], got
    for c in execs:
        assert c["image"] == sif and c["nv"] == "0"  # a CPU job: no --nv
        assert c["bind"] == mounts(submit, tmp_path)
        assert c["pwd"] == submit
        assert c["envfile"].startswith(f"{submit}/jobs/{job}/env-")  # the job's values over the image's
        assert_wheel_first(c, submit)
        assert c["master_port"] != "99999"
    assert check[0]["cmd"].startswith("python3 -m launcher.runtime.train --plan ")  # the image's python3, by name
    assert (shared_dir(tmp_path) / "ckpt-root" / job).is_dir()  # created before mounting; the checkpoints are there
    assert any((shared_dir(tmp_path) / "ckpt-root" / job).iterdir())
    assert (out / "cache" / "torch_extensions").is_dir()  # writable caches under the submit directory


def test_a_requeued_apptainer_job_pulls_no_second_time(tmp_path, stubs):
    """The SIF is the submit directory's: a requeue (or another job from there) runs it without pulling again.
    The batch script's pull block, run twice in a shell as the job runs it."""
    out = tmp_path / "job"
    render_to(out, "tiny", container_overrides("debug", tmp_path, "apptainer"))
    text = (out / "job.sbatch").read_text()
    block = text[text.index("SIF=") : text.index("fi\n", text.index("SIF=")) + 3]
    script = f'fail() {{ echo "fail $*"; exit 9; }}\nSUBMIT_DIR={shlex.quote(str(out))}\nSLURM_JOB_ID=7\n{block}'
    for _ in range(2):
        sh("bash", "-c", script)
    assert [c["op"] for c in calls(stubs)] == ["pull"]


@pytest.mark.slow
def test_pyxis_runs_the_step_in_the_image_on_every_node(tmp_path, partition, stubs):
    out = tmp_path / "job"
    render_to(out, "tiny", container_overrides(partition, tmp_path, "pyxis"))
    job = run_job(out)
    log_text = (out / f"tiny-{job}.out").read_text()
    assert_trained(out, job, log_text)  # despite the image's PYTHONPATH and MASTER_PORT
    got = calls(stubs)
    sruns = [c for c in got if c["op"] == "srun"]
    assert len(sruns) == 2, got  # srun runs twice in the image: the check, then the training step, on both nodes
    check, train = sruns
    submit = str(out.resolve())
    for c in sruns:
        assert c["image"] == "nvcr.io#nvidia/pytorch:24.05-py3"  # enroot's spelling of the registry
        assert c["mounts"] == mounts(submit, tmp_path)
        assert c["workdir"] == submit and c["name"] == f"dtlaunch-{job}"  # one name: the check's import is reused
    assert check["cmd"].startswith("--nodes=2 --ntasks=2 --ntasks-per-node=1")
    assert check["cmd"].endswith(f"bash {submit}/step.sh --check")
    assert "--nodes=2 --ntasks=2" in train["cmd"] and train["cmd"].endswith(f"bash {submit}/step.sh")
    assert any((shared_dir(tmp_path) / "ckpt-root" / job).iterdir())
    # the job ended for good: its named container removed on every node (pyxis's global scope keeps it)
    removed = sorted((c["host"], c["name"]) for c in got if c["op"] == "remove")
    assert removed == [("node1", f"pyxis_dtlaunch-{job}"), ("node2", f"pyxis_dtlaunch-{job}")], got


def test_a_broken_image_fails_once_before_training(tmp_path, partition, stubs, monkeypatch):
    """The image's interpreter cannot run the plan: exit 2 from the check, no rank started, no requeue."""
    monkeypatch.setenv("DTLAUNCH_PYTHON", "/nonexistent/python3")  # the interpreter the "image" would have
    out = tmp_path / "job"
    render_to(out, "tiny", container_overrides(partition, tmp_path, "pyxis", "targets.slurm.max_failures=3"))
    job = run_job(out)
    log_text = (out / f"tiny-{job}.out").read_text()
    assert "the container image cannot run this plan" in log_text, log_text[-3000:]
    assert (out / "jobs" / job / "state").read_text().strip() == "FAILED"
    assert [c for c in calls(stubs) if "--check" in c["cmd"]] and not [
        c for c in calls(stubs) if c["cmd"].endswith("step.sh")
    ]
    # failed for good: the named container is removed too
    assert sorted(c["host"] for c in calls(stubs) if c["op"] == "remove") == ["node1", "node2"]
    sacct = sacct_rows(job, "JobID,State,ExitCode")
    assert [r[1:] for r in sacct if r[0] == job] == [["FAILED", "2:0"]], sacct


@pytest.mark.slow
def test_submitit_runs_the_same_container_step(tmp_path, partition, stubs):
    """submitit's python runs on the host (it needs submitit there); the check and the steps go through the
    same srun with pyxis's options, expanded from the preamble's environment."""
    import launcher

    job = launcher.submit(
        REPO / "recipes" / "tiny.yaml",
        target_dir=tmp_path / "out",
        overrides=container_overrides(partition, tmp_path, "pyxis"),
    )
    summary = result(job)
    assert summary["state"] == "COMPLETED" and summary["step"] == STEPS, summary
    got = calls(stubs)
    submit = str((tmp_path / "out").resolve())
    sruns = [c for c in got if c["op"] == "srun"]
    assert [c["cmd"].rsplit(" ", 1)[-1] for c in sruns] == ["--check", f"{submit}/step.sh"], got
    assert {c["name"] for c in sruns} == {f"dtlaunch-{job.job_id}"} and {c["workdir"] for c in sruns} == {submit}
    assert sruns[1]["mounts"].startswith(f"{submit}:{submit},")
    assert sorted(c["host"] for c in got if c["op"] == "remove") == ["node1", "node2"], got


def test_stubs_are_what_the_scripts_meet(tmp_path, stubs):
    """Guard: the stubs are first on the PATH the job inherits (a real srun first would skip the checks)."""
    assert sh("bash", "-c", "command -v srun apptainer enroot").stdout.split() == [
        str(tmp_path / "stub-bin" / name) for name in ("srun", "apptainer", "enroot")
    ]
    assert Path(sys.executable).parent.joinpath("python3").exists()
