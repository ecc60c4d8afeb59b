"""Planner speed: every preset x 1..1024 nodes x every strategy, planned in one process. Plans per second."""

from __future__ import annotations

import time

from common import result
from launcher.catalog import PRESETS
from launcher.plan import make_plan
from launcher.recipe import load_text
from launcher.strategies import STRATEGY_NAMES as ALL_STRATEGIES

BASE = (
    "name: sweep\nmodel: {preset: tiny}\nresources: {accelerator: 'H100:8'}\ntraining: {steps: 1000, micro_batch: 1}\n"
)
TARGET = 1000.0  # plans/s: a 10,000-point sweep in seconds


def run(quick: bool = False) -> dict:
    nodes = [1, 4, 64] if quick else [2**i for i in range(11)]
    strategies = ("auto",) + ALL_STRATEGIES
    combos = [
        [f"model.preset={p}", f"resources.nodes={n}", f"parallelism.strategy={s}"]
        for p in PRESETS
        for n in nodes
        for s in strategies
    ]
    t = time.perf_counter()
    fits = 0
    for c in combos:
        fits += make_plan(load_text(BASE, overrides=c)).memory.fits
    dt = time.perf_counter() - t
    rate = len(combos) / dt
    print(
        f"planner_scale: {len(combos)} plans in {dt:.2f} s = {rate:,.0f} plans/s ({fits} fit); target >= {TARGET:,.0f}/s"
    )
    return result(
        rate / TARGET, 1.0, rate >= TARGET, plans=len(combos), seconds=dt, plans_per_second=rate, fitting=fits
    )
