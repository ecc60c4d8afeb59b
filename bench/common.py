"""Shared pieces of the benchmarks: repeated timing, summary statistics and the result record.

This machine is shared and noisy, so every benchmark compares two things measured side by side in
one run and reports their ratio; absolute seconds are kept in `detail` for reference only.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def time_command(cmd: list[str], repeat: int, env: dict | None = None, cwd: Path = ROOT) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        out.append(time.perf_counter() - t)
    return out


def interleaved(fns: dict[str, Callable[[], float]], repeat: int) -> dict[str, list[float]]:
    """Run the contenders alternately (A B A B ...) so drift in machine load hits both alike."""
    res = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            res[k].append(fn())
    return res


def result(ratio: float, target: float, meets: bool, **detail) -> dict:
    return {"ratio": round(ratio, 4), "target": target, "meets": bool(meets), "detail": detail}


def machine() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(), "commit": commit,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def save(results: dict, path: Path) -> None:
    path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
