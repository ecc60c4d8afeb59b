"""CI smoke test of the benchmarks: `bench/run.py --quick` runs each benchmark of run.SMOKE end to end (all but the
local chaos run, whose faults chaos_slurm drives through the SLURM job script, and chaos_sky).

It checks that each one produced a ratio, a target and a verdict - never how fast anything was
(the machine is shared and noisy; `meets` may be either value here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # the repository
sys.path.insert(0, str(ROOT / "bench"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_quick(tmp_path: Path) -> None:
    from run import SMOKE

    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert (tmp_path / "results.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["quick"] is True
    for name in SMOKE:
        r = results["benchmarks"].get(name)
        assert r is not None, f"{name} missing from results.json"
        assert "error" not in r, f"{name}: {r.get('error')}\n{proc.stderr[-3000:]}"
        assert isinstance(r["ratio"], (int, float)) and r["ratio"] == r["ratio"], (
            name,
            r["ratio"],
        )  # a number, not NaN
        assert "target" in r and isinstance(r["meets"], bool), (name, r)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "results.md").exists()
