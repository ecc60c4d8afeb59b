"""The SLURM knobs against the real local cluster: sbatch accepts every line dtlaunch renders for them (and
records what they mean: `scontrol show job` on held jobs), submitit's batch script from the same recipe is
accepted too, and `dtlaunch up --after` chains an evaluation behind a training run that really runs.

The cluster's nodes claim 2 GPUs each as counted GRES without devices (see conftest.py), so the GPU options
(--gpus-per-node, --gres, --mem-per-gpu, --cpus-per-gpu) are checked by the real sbatch and scheduler; no job
here uses a GPU. Node names (node1, node2), the reservation and the held job are real.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest

from launcher.errors import BackendError
from launcher.targets.slurm.request import SubmititSpec
from slurmkit import REPO, VENV_ACTIVATE, render_to, sh, wait_for, wait_gone

GPU = ["resources.accelerator=H100:2", "resources.nodes=2", "training.global_batch=8"]


def sbatch_test_only(out: Path, script: str = "job.sbatch") -> str:
    p = sh("sbatch", "--test-only", script, cwd=out, check=False)
    assert p.returncode == 0, p.stderr
    m = re.search(r"Job \d+ to start at \S+ using \d+ processors on nodes (\S+) in partition (\S+)", p.stderr)
    assert m, p.stderr
    return m.group(1)


def held(out: Path) -> tuple[str, str]:
    """Submit job.sbatch held: (job id, `scontrol show job` of it)."""
    job = sh("sbatch", "--parsable", "--hold", "job.sbatch", cwd=out).stdout.strip().split(";")[0]
    return job, sh("scontrol", "show", "job", job).stdout


@pytest.fixture
def reservation(slurm):
    name = f"dtl-{uuid.uuid4().hex[:6]}"
    sh(
        "scontrol",
        "create",
        "reservation",
        f"ReservationName={name}",
        "Users=root",
        "StartTime=now",
        "Duration=30",
        "Nodes=node[1-2]",
        "Flags=IGNORE_JOBS",
    )
    try:
        yield name
    finally:
        sh("scontrol", "delete", f"ReservationName={name}", check=False)


@pytest.fixture
def held_job(tmp_path, partition):
    """A real job that never starts, to depend on."""
    render_to(tmp_path / "held", "tiny", [f"targets.slurm.partition={partition}"])
    job, _ = held(tmp_path / "held")
    try:
        yield job
    finally:
        sh("scancel", job, check=False)


def test_gpu_knobs_are_accepted_and_mean_what_they_say(tmp_path, partition, reservation, held_job):
    out = tmp_path / "gpu"
    render_to(
        out,
        "tiny",
        [
            f"targets.slurm.partition={partition}",
            *GPU,
            "targets.slurm.gpu_type=local",
            "targets.slurm.mem_per_gpu=1G",
            "targets.slurm.cpus_per_gpu=1",
            "targets.slurm.nodelist=node[1-2]",
            f"targets.slurm.reservation={reservation}",
            f"targets.slurm.dependency=afterok:{held_job}",
            "targets.slurm.mail_type=[END, FAIL]",
            "targets.slurm.mail_user=trainer@example.org",
        ],
    )
    script = (out / "job.sbatch").read_text()
    for line in ("--gpus-per-node=local:2", "--mem-per-gpu=1G", "--cpus-per-gpu=1", f"--dependency=afterok:{held_job}"):
        assert f"#SBATCH {line}\n" in script
    # --test-only ignores the dependency (it asks "could this run"), the rest must be satisfiable as written.
    assert sbatch_test_only(out) == "node[1-2]"
    job, info = held(out)
    try:
        for want in (
            f"Reservation={reservation}",
            f"Dependency=afterok:{held_job}(unfulfilled)",
            "MailUser=trainer@example.org",
            "MailType=END,FAIL",
            "ReqNodeList=node[1-2]",
            "TresPerNode=gres:gpu:local:2",
            "MemPerTres=gres:gpu:1024",
            "CpusPerTres=gres:gpu:1",
        ):
            assert want in info, (want, info)
    finally:
        sh("scancel", job, check=False)


def test_gres_for_clusters_without_cons_tres_and_exclude(tmp_path, partition):
    out = tmp_path / "gres"
    render_to(
        out,
        "tiny",
        [
            f"targets.slurm.partition={partition}",
            "resources.accelerator=H100:2",
            "training.global_batch=8",
            "targets.slurm.gpu_request=gres",
            "targets.slurm.gpu_type=local",
            "targets.slurm.exclude=node1",
        ],
    )
    assert "#SBATCH --gres=gpu:local:2\n" in (out / "job.sbatch").read_text()
    assert sbatch_test_only(out) == "node2"  # node1 excluded
    job, info = held(out)
    try:
        assert "TresPerNode=gres:gpu:local:2" in info and "ExcNodeList=node1" in info
    finally:
        sh("scancel", job, check=False)


def test_cpu_job_on_a_named_node(tmp_path, partition):
    render_to(
        tmp_path,
        "tiny",
        [f"targets.slurm.partition={partition}", "targets.slurm.nodelist=node2", "targets.slurm.dependency=singleton"],
    )
    assert sbatch_test_only(tmp_path) == "node2"


def test_what_sbatch_refuses_validate_refuses_first(tmp_path, partition):
    """The rules that stand for sbatch's own refusals: the real sbatch does refuse those scripts."""
    from launcher.plan import make_plan
    from launcher.recipe import load
    from launcher.validate import validate

    cases = {
        "slurm-nodelist-count": (["targets.slurm.nodelist=node[1-2]"], "invalid number of nodes"),
        "slurm-nodelist-excluded": (
            [
                "resources.nodes=2",
                "training.global_batch=8",
                "targets.slurm.nodelist=node1",
                "targets.slurm.exclude=node1",
            ],
            "Invalid node name specified",
        ),
        "slurm-extra-sbatch-field": (['targets.slurm.extra_sbatch=["--mem-per-gpu=1G"]', *GPU], "mutually exclusive"),
    }
    for rule, (over, sbatch_says) in cases.items():
        out = tmp_path / rule
        r = load(REPO / "recipes" / "tiny.yaml", [f"targets.slurm.partition={partition}", *over])
        assert rule in {f.rule for f in validate(r, make_plan(r), "slurm")}, rule
        render_to(out, "tiny", [f"targets.slurm.partition={partition}", *over])
        p = sh("sbatch", "--test-only", "job.sbatch", cwd=out, check=False)
        assert p.returncode != 0 and sbatch_says in p.stderr, (rule, p.stderr)


def test_submitits_batch_script_from_the_knobs_is_accepted(tmp_path, partition, reservation):
    """submitit writes the #SBATCH lines itself, from the parameters render mapped the knobs to."""
    from submitit.slurm.slurm import _make_sbatch_string

    _, art = render_to(
        tmp_path,
        "tiny",
        [
            f"targets.slurm.partition={partition}",
            *GPU,
            "targets.slurm.submit=submitit",
            "targets.slurm.mem_per_gpu=1G",
            "targets.slurm.cpus_per_gpu=1",
            "targets.slurm.gpu_request=gres",
            "targets.slurm.gpu_type=local",
            "targets.slurm.nodelist=node[1-2]",
            f"targets.slurm.reservation={reservation}",
            "targets.slurm.dependency=singleton",
            "targets.slurm.mail_type=[ALL]",
            "targets.slurm.mail_user=me",
        ],
    )
    params = dict(SubmititSpec.from_json(art.files["submitit.json"]).parameters)
    text = _make_sbatch_string(command="true", folder=str(tmp_path / "submitit"), **params)
    for line in (
        "--gres=gpu:local:2",
        "--mem-per-gpu=1G",
        "--cpus-per-gpu=1",
        f"--reservation={reservation}",
        "--nodelist='node[1-2]'",
        "--dependency=singleton",
        "--mail-type=ALL",
        "--mail-user=me",
    ):
        assert f"#SBATCH {line}\n" in text, (line, text)
    (tmp_path / "submitit.sbatch").write_text(text)
    assert sbatch_test_only(tmp_path, "submitit.sbatch") == "node[1-2]"


@pytest.mark.slow
def test_up_after_chains_an_evaluation_behind_training(tmp_path, partition, run_cli, monkeypatch):
    """A real chain: the evaluation waits (PENDING, Dependency) while the training is held, then both run."""
    base = [
        "--set",
        f"targets.slurm.partition={partition}",
        "--set",
        "resources.accelerator=cpu:1",
        "--set",
        "training.steps=3",
        "--set",
        "checkpoint.every=3",
        "--set",
        "targets.slurm.max_failures=0",
        "--set",
        f'targets.slurm.setup=["source {VENV_ACTIVATE}"]',
    ]
    tiny = REPO / "recipes" / "tiny.yaml"
    code, out, err = run_cli(
        "up",
        tiny,
        "-t",
        "slurm",
        "-o",
        tmp_path / "train",
        "--detach",
        *base,
        "--set",
        "name=chain-train",
        "--set",
        "targets.slurm.extra_sbatch=['--hold']",
    )
    assert code == 0, err
    train = re.search(r"slurm job (\d+)", out).group(1)
    code, out, err = run_cli(
        "up",
        tiny,
        "-t",
        "slurm",
        "-o",
        tmp_path / "eval",
        "--detach",
        *base,
        "--set",
        "name=chain-eval",
        "--after",
        "chain-train",
    )
    assert code == 0, err
    ev = re.search(r"slurm job (\d+)", out).group(1)
    try:
        info = sh("scontrol", "show", "job", ev).stdout
        assert f"Dependency=afterok:{train}(unfulfilled)" in info, info
        # slurmctld sets the pending reason on its next scheduling pass (right after submission it may still
        # read Resources or None), so the status is asked until it says Dependency
        wait_for(lambda: "(Dependency)" in run_cli("status", "chain-eval")[1], 60, "the reason Dependency")
        code, out, _ = run_cli("status", "chain-eval")
        assert "PENDING" in out and f"after afterok:{train}" in out and "(Dependency)" in out, out
        # a job that has not started has no records of its own: no other run's are shown for it
        for cmd in (("logs", "chain-eval", "--diagnose"), ("status", "chain-eval", "--goodput")):
            code, out, err = run_cli(*cmd)
            assert code == 0 and f"chain-eval (slurm:{ev}) has no training records yet" in out, (cmd, out + err)
        # while the held job waits, its directory is its own: a second `up` there would rewrite the plan it runs
        plan = (tmp_path / "train" / "plan.json").read_bytes()
        code, out, err = run_cli(
            "up", tiny, "-t", "slurm", "-o", tmp_path / "train", "--detach", *base, "--set", "name=chain-train"
        )
        assert code == BackendError.exit_code, out + err
        assert f"is in use by job chain-train (slurm {train}, PENDING" in err and "nothing was changed" in err, err
        assert (tmp_path / "train" / "plan.json").read_bytes() == plan
        sh("scontrol", "release", train)
        wait_gone(train, 120)
        wait_for(
            lambda: (
                sh("squeue", "-h", "-j", ev, "-o", "%T", check=False).stdout.strip() in ("", "RUNNING", "COMPLETING")
            ),
            60,
            "the evaluation to start after the training",
        )
        wait_gone(ev, 120)
    finally:
        sh("scancel", train, ev, check=False)
    for name, job in (("train", train), ("eval", ev)):
        assert (tmp_path / name / "jobs" / job / "state").read_text().strip() == "COMPLETED", name
    code, out, _ = run_cli("status", "chain-eval")
    assert "COMPLETED" in out, out
    # status, --goodput and plot read each job's own run: runs/RUN_ID/ in its directory, named by its job script
    run = (tmp_path / "train" / "runs" / train).resolve()
    code, out, _ = run_cli("status", "chain-train", "--json")
    (row,) = json.loads(out)
    assert row["last_step"]["step"] == 3 and row["total_steps"] == 3, row
    code, out, err = run_cli("status", "chain-train", "--goodput")
    assert code == 0 and f"goodput of {run} (1 attempt(s)):" in out, out + err
    code, out, err = run_cli("plot", "chain-train")
    assert code == 0 and f"wrote {run / 'loss.png'}" in out, out + err
    code, out, err = run_cli("plot", tmp_path / "eval")  # a job's directory: its newest run
    assert code == 0 and f"wrote {tmp_path / 'eval' / 'runs' / ev / 'loss.png'}" in out, out + err
