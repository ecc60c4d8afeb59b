"""Goodput simulation: the useful fraction of a 1,000-GPU, 30-day run for different checkpoint intervals.

Failures arrive as a Poisson process (per-GPU MTBF from the Llama 3 paper, as the planner uses); each costs
the work since the last checkpoint plus a restart time; each checkpoint blocks training for its write time
(the measured sync figure unless async). The planner's choice, Young/Daly sqrt(2 * write * MTBF), is compared
with fixed intervals.
"""

from __future__ import annotations

import math
import random

from common import result
from launcher.catalog import GPU_MTBF_HOURS
from launcher.plan.cost import young_daly_interval

GPUS = 1000
DAYS = 30
RESTART_S = 600.0  # reschedule + load checkpoint + warm-up: ~10 min at this scale


def simulate(interval_s: float, write_s: float, mtbf_s: float, horizon_s: float, rng: random.Random) -> float:
    """Useful seconds / horizon for one realisation."""
    t, useful = 0.0, 0.0
    next_fail = rng.expovariate(1 / mtbf_s)
    while t < horizon_s:
        seg = interval_s + write_s  # work, then a blocking checkpoint
        if t + seg <= next_fail:
            t += seg
            useful += interval_s
            continue
        t = next_fail + RESTART_S  # lose the segment in progress
        next_fail = t + rng.expovariate(1 / mtbf_s)
    return min(useful, horizon_s) / horizon_s


def goodput(interval_s: float, write_s: float, mtbf_s: float, runs: int = 20, seed: int = 0) -> float:
    rng = random.Random(seed)
    horizon = DAYS * 86400
    return sum(simulate(interval_s, write_s, mtbf_s, horizon, rng) for _ in range(runs)) / runs


def run(quick: bool = False, write_s: float = 60.0, plot_path: str | None = None) -> dict:
    mtbf = GPU_MTBF_HOURS * 3600 / GPUS
    best_yd = young_daly_interval(write_s, mtbf)
    runs = 5 if quick else 40
    grid = sorted({*(60.0 * m for m in (2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240, 360)), best_yd})
    curve = {iv: goodput(iv, write_s, mtbf, runs) for iv in grid}
    ours = curve[best_yd]
    fixed = {f"{int(iv // 60)} min": g for iv, g in curve.items() if iv != best_yd}
    best_fixed = max(fixed.values())
    if plot_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        xs = [iv / 60 for iv in grid]
        plt.figure(figsize=(6, 4))
        plt.plot(xs, [curve[iv] for iv in grid], marker="o")
        plt.axvline(best_yd / 60, color="red", linestyle="--", label=f"Young/Daly: {best_yd / 60:.0f} min")
        plt.xscale("log")
        plt.xlabel("checkpoint interval (min)")
        plt.ylabel("goodput")
        plt.title(f"{GPUS} GPUs, {DAYS} days, MTBF {mtbf / 3600:.1f} h, write {write_s:.0f} s")
        plt.legend()
        plt.tight_layout()
        plt.savefig(plot_path, dpi=100)
        plt.close()
    print(
        f"goodput: Young/Daly interval {best_yd / 60:.1f} min -> {ours:.4f}; best fixed {best_fixed:.4f}; "
        f"ratio {ours / best_fixed:.4f} (target >= 0.99 of the best fixed interval)"
    )
    return result(
        ours / best_fixed,
        0.99,
        ours / best_fixed >= 0.99,
        job_mtbf_hours=mtbf / 3600,
        write_seconds=write_s,
        young_daly_minutes=best_yd / 60,
        goodput_young_daly=ours,
        goodput_fixed=fixed,
        restart_seconds=RESTART_S,
        analytic_waste=math.sqrt(2 * write_s / mtbf),
    )
