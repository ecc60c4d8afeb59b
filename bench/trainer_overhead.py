"""Trainer overhead: steady-state tokens/s of `launcher.train` vs the hand-written minimal loop
(bench/minimal_loops.py) on the same tiny Llama, data, batch and optimizer; 2 ranks, gloo, fp32.

Strategies: DDP, FSDP2 and DeepSpeed ZeRO-2, each against its own minimal loop. Runs are interleaved
(ours, minimal, ours, minimal, ...) so machine load hits both. Our run has preflight off and no
interval checkpoint (checkpoint.every huge), and logs at the same frequency as the minimal loop.
Throughput = tokens / wall-clock seconds between the end of the warm-up steps and the end of the
last step (so everything the loop does between steps counts). Target: ours/minimal >= 0.97 for every
strategy; the ratio reported is the worst strategy's median.

The runs are cached for bench/peak_memory.py, which reads the same processes' peak RSS.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import _torchrun as T
from common import result, stats

TARGET = 0.97
STRATEGIES = {"ddp": "ddp", "fsdp": "fsdp", "zero2": "zero2"}  # recipe strategy -> minimal_loops --strategy
CACHE: dict = {}  # quick -> {"runs": {strategy: {"ours": [Run], "minimal": [Run]}}, "config": {...}}


def _config(quick: bool) -> dict:
    steps, warm = (12, 4) if quick else (50, 10)
    return {"steps": steps, "warmup_skip": warm, "repeat": 1 if quick else 3,
            "strategies": ["ddp"] if quick else list(STRATEGIES), "log_every": 2 if quick else 5}


def collect(quick: bool) -> dict:
    """Run (or reuse) the interleaved ours/minimal runs of every strategy."""
    if quick in CACHE:
        return CACHE[quick]
    cfg = _config(quick)
    base = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    runs = {s: {"ours": [], "minimal": []} for s in cfg["strategies"]}
    for i in range(cfg["repeat"]):
        for s in cfg["strategies"]:
            rec = T.recipe(parallelism={"strategy": s}, training={"steps": cfg["steps"], "log_every": cfg["log_every"]})
            runs[s]["ours"].append(T.ours(rec, base / f"{s}-ours-{i}").check())
            args = ["--strategy", STRATEGIES[s], "--steps", str(cfg["steps"]), "--log-every", str(cfg["log_every"])]
            runs[s]["minimal"].append(T.minimal(args, base / f"{s}-min-{i}").check())
    CACHE[quick] = {"runs": runs, "config": cfg, "dir": str(base)}
    return CACHE[quick]


def _tps_ours(run: T.Run, warm: int) -> tuple[float, float]:
    recs = {m["step"]: m for m in run.metrics() if "step" in m and "loss" in m}
    last = max(recs)
    tokens = T.BASE_RECIPE["training"]["global_batch"] * T.BASE_RECIPE["model"]["seq_len"]  # per optimizer step
    tps = tokens * (last - warm) / (recs[last]["time"] - recs[warm]["time"])
    return tps, recs[last]["loss"]


def _tps_minimal(run: T.Run, warm: int) -> tuple[float, float]:
    import json

    r = json.loads((run.run_dir / "minimal-0.json").read_text())
    times = {int(k): v for k, v in r["times"].items()}
    last = max(times)
    losses = {int(k): v for k, v in r["losses"].items()}
    return r["tokens_per_step"] * (last - warm) / (times[last] - times[warm]), losses[max(losses)]


def run(quick: bool = False) -> dict:
    data = collect(quick)
    warm = data["config"]["warmup_skip"]
    per = {}
    for s, rr in data["runs"].items():
        o = [_tps_ours(r, warm) for r in rr["ours"]]
        m = [_tps_minimal(r, warm) for r in rr["minimal"]]
        so, sm = stats([x[0] for x in o]), stats([x[0] for x in m])
        pair = [a[0] / b[0] for a, b in zip(o, m)]  # ratio of each interleaved pair
        per[s] = {"ratio": so["median"] / sm["median"], "ours_tokens_per_s": so, "minimal_tokens_per_s": sm,
                  "pair_ratios": pair, "final_loss_ours": [x[1] for x in o], "final_loss_minimal": [x[1] for x in m]}
        print(f"trainer_overhead[{s}]: ours {so['median']:.0f} tok/s (min {so['min']:.0f}, max {so['max']:.0f}) vs minimal "
              f"{sm['median']:.0f} tok/s (min {sm['min']:.0f}, max {sm['max']:.0f}) -> ratio {per[s]['ratio']:.3f}")
    worst = min(v["ratio"] for v in per.values())
    print(f"trainer_overhead: worst ours/minimal tokens/s {worst:.3f} (target >= {TARGET})")
    return result(worst, TARGET, worst >= TARGET, strategies=per, config=data["config"],
                  note="tokens/s over steps warmup_skip+1..steps (wall clock); 2 ranks gloo fp32, tiny preset seq 128")
