"""Helpers for the SLURM tests: render a recipe into a directory, submit, poll squeue."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

from launcher.plan import make_plan
from launcher.recipe import load
from launcher.render import render

REPO = Path(__file__).resolve().parents[2]


def render_to(out: Path, recipe: str = "tiny", overrides=(), python=None):
    """Render recipes/<recipe>.yaml for slurm into out; returns (recipe, artifacts)."""
    r = load(REPO / "recipes" / f"{recipe}.yaml", list(overrides))
    art = render(r, make_plan(r), "slurm")
    art.write(out)
    return r, art


def sbatch(out: Path, *extra) -> str:
    p = sh("sbatch", "--parsable", *extra, "job.sbatch", cwd=out)
    return p.stdout.strip().split(";")[0]


def sh(*argv, check=True, timeout=60, cwd=None, env=None) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"{argv} failed ({p.returncode}): {p.stdout}\n{p.stderr}")
    return p


def squeue_state(job_id: str) -> str:
    return sh("squeue", "-h", "-j", job_id, "-o", "%T", check=False).stdout.strip()


def wait_gone(job_id: str, timeout: float) -> float:
    """Poll squeue until the job has left it (finished); returns the seconds waited."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if squeue_state(job_id) == "":
            return time.time() - t0
        time.sleep(0.5)
    sh("scancel", job_id, check=False)
    raise AssertionError(f"job {job_id} still in squeue after {timeout}s")


def wait_for(pred, timeout: float, what: str, interval: float = 0.3):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
