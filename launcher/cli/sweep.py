"""Sweeps: `--sweep KEY=V1,V2` options expanded into override sets (their cartesian product).

Used by `plan --sweep` (compare layouts in one call) and by SLURM array jobs (one task per set). The
product is counted before it is built, and capped: a sweep is a handful of experiments, not a search.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from ..errors import DtlaunchError

MAX_COMBINATIONS = 1000


def expand(sweeps: Sequence[str]) -> list[list[str]]:
    """["a=1,2", "b=x,y"] -> [["a=1","b=x"], ["a=1","b=y"], ["a=2","b=x"], ["a=2","b=y"]]."""
    axes = []
    for item in sweeps:
        key, sep, values = item.partition("=")
        vals = _split(values, item) if sep else []
        if not key.strip() or not vals or any(v == "" for v in vals):
            raise DtlaunchError(
                f"--sweep {item[:200]!r}: expected KEY=V1,V2,...", fix="e.g. --sweep resources.nodes=1,2,4"
            )
        axes.append([f"{key.strip()}={v}" for v in vals])
    n = math.prod(len(a) for a in axes)
    if n > MAX_COMBINATIONS:
        raise DtlaunchError(
            f"the sweep has {n:,} combinations; at most {MAX_COMBINATIONS:,} are allowed",
            fix="sweep fewer values, or split the sweep into several runs",
        )
    return [list(combo) for combo in itertools.product(*axes)] if axes else [[]]


_CLOSE = {"[": "]", "{": "}"}


def _split(values: str, item: str) -> list[str]:
    """V1,V2,... split at the commas outside brackets, braces and quotes: a value is what --set takes (YAML), so
    `[0.9,0.95],[0.8,0.9]` is two lists and `'a,b',c` two strings."""
    cur: list[str] = []  # the value being read
    out, stack, quote, last = [], [], None, ","  # last: the previous character that is not a space
    for ch in values:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"" and last in "[{,:":
            quote = ch  # YAML quotes a scalar only where it starts (it's is plain text)
        elif ch in _CLOSE:
            stack.append(_CLOSE[ch])
        elif ch in "]}":
            if not stack or stack.pop() != ch:
                break  # closes nothing, or the wrong bracket
        elif ch == "," and not stack:
            out.append("".join(cur).strip())
            cur, last = [], ","
            continue
        cur.append(ch)
        last = ch if not ch.isspace() else last
    else:
        if not stack and not quote:
            return [*out, "".join(cur).strip()]
    raise DtlaunchError(
        f"--sweep {item[:200]!r}: unbalanced brackets or quotes",
        fix="close each [ ], { } and quote in the value, e.g. --sweep training.betas=[0.9,0.95],[0.8,0.9]",
    )
