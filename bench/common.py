"""Shared pieces of the benchmarks: repeated timing, summary statistics and the result record.

This machine is shared and noisy, so every benchmark compares two things measured side by side in
one run and reports their ratio; absolute seconds are kept in `detail` for reference only.
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def scratch(prefix: str) -> Path:
    """A directory for a benchmark's runs, removed when its process exits: the figures go to results.json, and
    the runs' checkpoints and logs would otherwise pile up in the temp directory at every `make bench`."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, d, True)
    return d


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (q=0.5 is the median)."""
    ys = sorted(xs)
    if not ys:
        return float("nan")
    pos = q * (len(ys) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def bootstrap_band(
    pairs: list, statistic: Callable[[list], float], n: int = 2000, lo: float = 0.05, hi: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """The noise band of `statistic(pairs)`: its lo..hi quantiles over `n` resamplings of the interleaved
    pairs (with replacement). Resampling whole pairs keeps each pair's two runs together, as they ran."""
    if len(pairs) < 2:
        v = statistic(pairs)
        return v, v
    rng = random.Random(seed)
    vals = sorted(statistic([pairs[rng.randrange(len(pairs))] for _ in pairs]) for _ in range(n))
    return quantile(vals, lo), quantile(vals, hi)


def time_command(cmd: list[str], repeat: int, env: dict | None = None, cwd: Path = ROOT) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        out.append(time.perf_counter() - t)
    return out


def abba(i: int) -> tuple[str, str]:
    """The order of the two arms in pair i: ours first in even pairs, the minimal loop first in odd ones, so a
    load that drifts over a pair favours neither."""
    return ("ours", "minimal") if i % 2 == 0 else ("minimal", "ours")


def interleaved(fns: dict[str, Callable[[], float]], repeat: int) -> dict[str, list[float]]:
    """Run the contenders alternately (A B A B ...) so drift in machine load hits both alike."""
    res = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            res[k].append(fn())
    return res


def result(ratio: float, target: float, meets: bool, band: list | None = None, **detail) -> dict:
    """A benchmark's record: its ratio, the noise band around it (when it has one), target and verdict."""
    out = {"ratio": round(ratio, 4), "target": target, "meets": bool(meets), "detail": detail}
    if band is not None:
        out["band"] = [round(band[0], 4), round(band[1], 4)]
    return out


def machine() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = "unknown"
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def save(results: dict, path: Path) -> None:
    path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
