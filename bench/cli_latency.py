"""CLI latency: `dtlaunch --help`, `plan`, `render --target slurm` against `python -c "import yaml"`.

Target: each <= 3x the bare interpreter + yaml import (the floor any Python CLI that reads YAML pays).
"""
from __future__ import annotations

import os
import tempfile

from common import PY, ROOT, interleaved, result, stats, time_command

TARGET = 3.0


def run(quick: bool = False) -> dict:
    repeat = 3 if quick else 9
    out = tempfile.mkdtemp()
    dtl = str(ROOT / ".venv" / "bin" / "dtlaunch") if (ROOT / ".venv/bin/dtlaunch").exists() else "dtlaunch"
    cmds = {
        "baseline": [PY, "-c", "import yaml"],
        "help": [dtl, "--help"],
        "plan": [dtl, "plan", "recipes/llama70b.yaml"],
        "render_slurm": [dtl, "render", "recipes/llama70b.yaml", "--target", "slurm", "-o", out, "-q"],
    }
    env = dict(os.environ)
    times = interleaved({k: (lambda c=c: time_command(c, 1, env)[0]) for k, c in cmds.items()}, repeat)
    base = stats(times["baseline"])["median"]
    detail = {k: stats(v) for k, v in times.items()}
    ratios = {k: stats(v)["median"] / base for k, v in times.items() if k != "baseline"}
    worst = max(ratios.values())
    print(f"cli_latency: baseline {base * 1000:.0f} ms; " + ", ".join(f"{k} {r:.1f}x" for k, r in ratios.items())
          + f" (target <= {TARGET}x)")
    return result(worst, TARGET, worst <= TARGET, ratios=ratios, seconds=detail)
