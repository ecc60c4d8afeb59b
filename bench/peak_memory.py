"""Peak memory: peak RSS (VmHWM, read from /proc/self/status at the end of each rank) of
`launcher.runtime.train` vs the minimal loop, on the workload of bench/trainer_overhead.py, each run its own torchrun
(a process's peak is its whole life's, so these cannot share the overhead benchmark's long-lived world). Ours is
read by the bench/_torchrun.py wrapper after `launcher.runtime.train`'s main() returns (so it includes the final
checkpoint our run always writes); the minimal loop reads its own. Ratio = max over ranks and strategies of
median(ours)/median(minimal); target <= 1.05.
"""

from __future__ import annotations

import json

from trainer_overhead import STRATEGIES

import _torchrun as T
from common import abba, result, scratch, stats

TARGET = 1.05


def collect(quick: bool) -> dict:
    """`repeat` runs of each arm per strategy, alternating which goes first."""
    strategies, steps, repeat = (["ddp"], 6, 1) if quick else (STRATEGIES, 20, 2)
    base = scratch("bench-memory-")
    runs = {s: {"ours": [], "minimal": []} for s in strategies}
    for i in range(repeat):
        for s in strategies:
            rec = T.recipe(parallelism={"strategy": s}, training={"steps": steps, "log_every": 5})
            args = ["--strategy", s, "--steps", str(steps), "--log-every", "5"]
            for arm in abba(i):
                run = T.ours(rec, base / f"{s}-ours-{i}") if arm == "ours" else T.minimal(args, base / f"{s}-min-{i}")
                runs[s][arm].append(run.check())
    return {"runs": runs}


def _minimal_hwm(run) -> dict[int, float]:
    return {
        int(p.stem.split("-")[1]): json.loads(p.read_text())["vmhwm_mb"] for p in run.run_dir.glob("minimal-*.json")
    }


def run(quick: bool = False) -> dict:
    data = collect(quick)
    per = {}
    for s, rr in data["runs"].items():
        ours = [r.hwm() for r in rr["ours"]]
        mine = [_minimal_hwm(r) for r in rr["minimal"]]
        ranks = sorted(set().union(*ours) & set().union(*mine))
        by_rank = {}
        for k in ranks:
            so = stats([h[k] for h in ours if k in h])
            sm = stats([h[k] for h in mine if k in h])
            by_rank[k] = {"ours_mb": so, "minimal_mb": sm, "ratio": so["median"] / sm["median"]}
        per[s] = {"ratio": max(v["ratio"] for v in by_rank.values()), "ranks": by_rank}
        print(
            f"peak_memory[{s}]: "
            + "; ".join(
                f"rank {k}: ours {v['ours_mb']['median']:.0f} MB vs minimal "
                f"{v['minimal_mb']['median']:.0f} MB ({v['ratio']:.3f}x)"
                for k, v in by_rank.items()
            )
        )
    worst = max(v["ratio"] for v in per.values())
    print(f"peak_memory: worst ours/minimal peak RSS {worst:.3f} (target <= {TARGET})")
    return result(worst, TARGET, worst <= TARGET, strategies=per, note="VmHWM per rank, MiB; one torchrun per run")
