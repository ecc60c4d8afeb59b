"""Issue 34: `dtlaunch calibrate -t slurm` as a real job on the local SLURM cluster: the calibration run is
submitted like `up`, waited for, and its run directory (runs/<job id>/ under the job's files) gets the ledger and
the calibration file, which `plan --calibration` then uses."""

from __future__ import annotations

import json

import pytest

from slurmkit import REPO, VENV_ACTIVATE


@pytest.mark.slow
def test_calibrate_as_a_slurm_job(tmp_path, partition, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "cal"
    code, text, err = run_cli(
        "calibrate",
        REPO / "recipes" / "tiny.yaml",
        "-t",
        "slurm",
        "-o",
        out,
        "--steps",
        "6",
        "--set",
        f"targets.slurm.partition={partition}",
        "--set",
        "targets.slurm.max_failures=0",
        "--set",
        f'targets.slurm.setup=["source {VENV_ACTIVATE}"]',
    )
    assert code == 0, (text, err)
    (path,) = out.glob("runs/*/calibration.json")
    cal = json.loads(path.read_text())
    assert cal["recipe"] == "tiny-calibrate" and cal["world_size"] == 2 and cal["measured"]["logged_steps"] == 5
    assert f"wrote {path}" in text
    code, text, err = run_cli("plan", REPO / "recipes" / "tiny.yaml", "--calibration", path, "--json")
    assert code == 0, err
    assert json.loads(text)["time"]["step_seconds"] == pytest.approx(cal["measured"]["step_seconds"], rel=1e-6)
