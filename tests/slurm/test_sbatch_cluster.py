"""Rendered scripts against the real local SLURM: sbatch accepts them, quoting holds, errors are clear."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest

from launcher.errors import BackendError
from launcher.targets.slurm.backend import SlurmBackend
from slurmkit import REPO, VENV_ACTIVATE, render_to, sbatch, sh, wait_gone

RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("name", RECIPES)
def test_sbatch_test_only_accepts_every_recipe(name, tmp_path, partition):
    r, _ = render_to(tmp_path, name, [f"targets.slurm.partition={partition}"])
    # The local cluster has 2 nodes and no GPUs (no GRES): only those two are overridden on the command
    # line; every other #SBATCH line of the script is parsed and checked by the real sbatch.
    fit = [] if name == "tiny" else ["--nodes=2", "--gpus-per-node=0"]
    p = sh("sbatch", "--test-only", *fit, "job.sbatch", cwd=tmp_path, check=False)
    assert p.returncode == 0, p.stderr
    assert re.search(r"Job \d+ to start at .* in partition " + partition, p.stderr), p.stderr


def test_sbatch_line_quoting_round_trips(tmp_path, partition):
    """sbatch parses #SBATCH lines itself: a hostile value arrives intact, as data."""
    marker = Path(f"/tmp/pwned-comment-{uuid.uuid4().hex[:8]}")
    comment = f"a b \"c\" #d $(touch {marker}) 'e'"
    render_to(
        tmp_path,
        "tiny",
        [f"targets.slurm.partition={partition}", f"targets.slurm.extra_sbatch=[{json.dumps('--comment=' + comment)}]"],
    )
    job = sbatch(tmp_path, "--hold")
    try:
        info = sh("scontrol", "show", "job", job).stdout
        assert f"Comment={comment}" in info, info
    finally:
        sh("scancel", job, check=False)
    assert not marker.exists()


def test_hostile_recipe_runs_quoted_never_executed(tmp_path, partition, monkeypatch):
    """A real job: the name, env values and quotes stay strings; secrets arrive by name only."""
    tag = uuid.uuid4().hex[:8]
    markers = [Path(f"/tmp/pwned-{tag}-{i}") for i in range(3)]
    monkeypatch.setenv("MY_TOKEN", f"s3cr3t-{tag}")
    r, _ = render_to(
        tmp_path,
        "tiny",
        [
            f"name=x; touch {markers[0]}",
            f"env.EVIL=$(touch {markers[1]}) `touch {markers[2]}` ' \" ; exit 7",
            "secrets=[MY_TOKEN]",
            f"targets.slurm.partition={partition}",
            "targets.slurm.max_failures=0",
            "training.steps=2",
            f"targets.slurm.setup=['echo \"secret-length=${{#MY_TOKEN}} evil=$EVIL\"', 'source {VENV_ACTIVATE}']",
        ],
    )
    job = sbatch(tmp_path)
    wait_gone(job, 120)
    assert r.job_name.startswith(f"x-touch-tmp-pwned-{tag}-0-")  # scheduler-safe, and distinct from plain "x"
    out = (tmp_path / f"{r.job_name}-{job}.out").read_text()
    assert f"secret-length={len('s3cr3t-') + 8}" in out
    assert f"evil=$(touch {markers[1]}) `touch {markers[2]}` ' \" ; exit 7" in out
    assert f"dtlaunch: job {job} attempt 0" in out
    for m in markers:
        assert not m.exists(), m
    for f in tmp_path.rglob("*"):
        if f.is_file() and f.suffix != ".out" and "logs" not in f.parts:
            assert f"s3cr3t-{tag}" not in f.read_text(errors="replace"), f


def test_missing_sbatch_is_a_clear_error_and_records_nothing(tmp_path, run_cli, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    code, out, err = run_cli("up", REPO / "recipes/tiny.yaml", "-t", "slurm", "-o", tmp_path / "r", "--detach")
    assert code == BackendError.exit_code
    assert "sbatch not found" in err and "install the SLURM client" in err and "ssh" in err
    code, out, _ = run_cli("status")
    assert "no jobs recorded" in out


def test_sbatch_without_a_configuration_says_to_set_slurm_conf(tmp_path, run_cli, monkeypatch):
    """The real sbatch with no slurm.conf to find (no SLURM_CONF, none in /etc/slurm, no DNS record): its
    "Could not establish a configuration source" gets a fix that says what is missing."""
    monkeypatch.delenv("SLURM_CONF", raising=False)
    code, out, err = run_cli("up", REPO / "recipes/tiny.yaml", "-t", "slurm", "-o", tmp_path / "r", "--detach")
    assert code == BackendError.exit_code
    assert "Could not establish a configuration source" in err, err
    assert "set SLURM_CONF to the cluster's slurm.conf, or source the cluster's environment" in err, err
    code, out, _ = run_cli("status")
    assert "no jobs recorded" in out


def test_sbatch_rejection_shows_its_stderr_and_records_nothing(tmp_path, run_cli, slurm):
    code, out, err = run_cli(
        "up",
        REPO / "recipes/tiny.yaml",
        "-t",
        "slurm",
        "-o",
        tmp_path / "r",
        "--detach",
        "--set",
        "targets.slurm.partition=nope",
    )
    assert code == BackendError.exit_code
    assert "sbatch rejected the job" in err and "invalid partition" in err.lower()
    code, out, _ = run_cli("status")
    assert "no jobs recorded" in out


def test_backend_submit_status_logs_cancel(tmp_path, partition):
    """The backend on a held job: submit -> PENDING via squeue -> cancel -> CANCELLED via sacct."""
    _, art = render_to(
        tmp_path, "tiny", [f"targets.slurm.partition={partition}", "targets.slurm.extra_sbatch=['--hold']"]
    )
    be = SlurmBackend(poll_seconds=0.5)
    rec = be.submit(art, str(tmp_path))
    assert rec.job_id.isdigit() and rec.run_dir == str(tmp_path.resolve())
    st = be.status(rec).to_dict()
    assert st["state"] == "PENDING" and st["source"] == "squeue"
    be.cancel(rec)
    wait_gone(rec.job_id, 30)
    st = be.status(rec).to_dict()
    assert st["state"] == "CANCELLED" and st["source"] == "sacct", st
    assert list(be.logs(rec, follow=True)) == []  # never ran: no output file, and follow ends


def test_status_falls_back_to_job_files_without_accounting(tmp_path, partition):
    """Without squeue/sacct records (sacct off, job aged out), the script's own state files answer."""
    from launcher.targets.registry import JobRecord
    from launcher.targets.slurm.request import SlurmHandle

    run = tmp_path / "jobs" / "999999"
    run.mkdir(parents=True)
    (run / "state").write_text("COMPLETED\n")
    (run / "attempts").write_text("0 1 node1 node[1-2]\n1 2 node1 node[1-2]\n")
    (run / "exit_codes").write_text("0 42 USR2\n1 0 none\n")
    rec = JobRecord("tiny", "slurm", "999999", str(tmp_path), SlurmHandle(str(tmp_path), "tiny"))
    st = SlurmBackend().status(rec).to_dict()
    assert st == {
        "state": "COMPLETED",
        "exit_code": 0,
        "detail": None,
        "source": "job files",
        "job_state": "COMPLETED",
        "attempts": 2,
        "last_exit_code": 0,
    }
