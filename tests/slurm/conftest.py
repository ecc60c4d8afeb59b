"""A real SLURM 22.05 cluster (2 nodes on this machine) for the whole tests/slurm session.

Nothing is skipped: if the packages are missing, `scripts/slurm-local.sh start` fails and so does every
test here, loudly (CI installs them with scripts/install-system.sh). The cluster gets its own state dir
and ports, so it never collides with a developer's default instance (/tmp/dtlaunch-slurm, 6817...);
DTLAUNCH_TEST_SLURM_ROOT, _CTLD_PORT, _DBD_PORT, _SLURMD_PORT_BASE and _DB_PORT move it elsewhere.
Each node claims 2 GPUs (counted GRES, no devices; DTLAUNCH_TEST_SLURM_GPUS), so the real sbatch checks
GPU options (--gpus-per-node, --gres, --mem-per-gpu, --cpus-per-gpu) too; a job that asks for none gets
none, except that an --exclusive job's batch shell sees CUDA_VISIBLE_DEVICES (its steps do not).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm-local.sh"
# Two test sessions on one machine need distinct state dirs and ports: each can be set from the environment.
KNOBS = {
    "SLURM_LOCAL_ROOT": os.environ.get("DTLAUNCH_TEST_SLURM_ROOT", "/tmp/dtlaunch-slurm-pytest"),
    "SLURM_LOCAL_CTLD_PORT": os.environ.get("DTLAUNCH_TEST_SLURM_CTLD_PORT", "8817"),
    "SLURM_LOCAL_DBD_PORT": os.environ.get("DTLAUNCH_TEST_SLURM_DBD_PORT", "8819"),
    "SLURM_LOCAL_SLURMD_PORT_BASE": os.environ.get("DTLAUNCH_TEST_SLURM_SLURMD_PORT_BASE", "8830"),
    "SLURM_LOCAL_DB_PORT": os.environ.get("DTLAUNCH_TEST_SLURM_DB_PORT", "3507"),
    "SLURM_LOCAL_GPUS": os.environ.get("DTLAUNCH_TEST_SLURM_GPUS", "2"),
}


def _env_sh(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            k, _, v = line[len("export ") :].partition("=")
            out[k] = shlex.split(v)[0] if v else ""
    return out


@pytest.fixture(scope="session")
def slurm():
    """Start the cluster, export its env.sh into os.environ, yield the env; stop --purge at the end."""
    # A private TMPDIR: MariaDB's bootstrap puts temp tables in $TMPDIR (default /tmp), and a concurrent
    # cluster start on this machine once removed ours mid-bootstrap ("Unknown table mysql.tmp_user_sys").
    tmp = Path(KNOBS["SLURM_LOCAL_ROOT"] + ".tmp")
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, **KNOBS, "TMPDIR": str(tmp)}
    subprocess.run(["bash", str(SCRIPT), "stop", "--purge"], env=env, capture_output=True, timeout=120)
    t0 = time.time()
    p = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (
        f"slurm-local.sh start failed (install with scripts/install-system.sh):\n{p.stdout}\n{p.stderr}"
    )
    vars_ = _env_sh(Path(KNOBS["SLURM_LOCAL_ROOT"]) / "env.sh")
    saved = {k: os.environ.get(k) for k in vars_}
    os.environ.update(vars_)
    print(f"\nslurm-local start: {time.time() - t0:.1f}s")
    try:
        yield vars_
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        subprocess.run(["bash", str(SCRIPT), "stop", "--purge"], env=env, capture_output=True, timeout=180)


@pytest.fixture
def partition(slurm) -> str:
    return slurm["SLURM_LOCAL_PARTITION"]


@pytest.fixture(scope="session", autouse=True)
def _shared_root():
    """The stand-in for a shared filesystem (slurmkit.SHARED_ROOT): this worker's directories go at its end."""
    from slurmkit import clean_shared_root

    yield
    clean_shared_root()
