"""Sweeps: `--sweep KEY=V1,V2` options expanded into override sets (their cartesian product).

Used by `plan --sweep` (compare layouts in one call) and by SLURM array jobs (one task per set).
"""
from __future__ import annotations

import itertools

from .errors import DtlaunchError


def expand(sweeps: list[str] | tuple[str, ...]) -> list[list[str]]:
    """["a=1,2", "b=x,y"] -> [["a=1","b=x"], ["a=1","b=y"], ["a=2","b=x"], ["a=2","b=y"]]."""
    axes = []
    for item in sweeps:
        key, sep, values = item.partition("=")
        vals = [v.strip() for v in values.split(",")] if sep else []
        if not key.strip() or not vals or any(v == "" for v in vals):
            raise DtlaunchError(f"--sweep {item!r}: expected KEY=V1,V2,..., e.g. --sweep resources.nodes=1,2,4")
        axes.append([f"{key.strip()}={v}" for v in vals])
    return [list(combo) for combo in itertools.product(*axes)] if axes else [[]]
