"""SLURM's time-limit syntax (sbatch --time), parsed strictly so a typo fails before the queue does."""

from __future__ import annotations

import re

FORMS = "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 90, 24:00:00, 2-00:00:00)"
_PATTERNS = (
    (re.compile(r"(\d{1,7})", re.ASCII), ("m",)),
    (re.compile(r"(\d{1,7}):(\d{2})", re.ASCII), ("m", "s")),
    (re.compile(r"(\d{1,5}):(\d{2}):(\d{2})", re.ASCII), ("h", "m", "s")),
    (re.compile(r"(\d{1,4})-(\d{1,2})", re.ASCII), ("d", "h")),
    (re.compile(r"(\d{1,4})-(\d{1,2}):(\d{2})", re.ASCII), ("d", "h", "m")),
    (re.compile(r"(\d{1,4})-(\d{1,2}):(\d{2}):(\d{2})", re.ASCII), ("d", "h", "m", "s")),
)
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
# A field's upper bound when a larger unit precedes it ("minutes" alone, or leading hours, may be any size).
_MAX = {"h": 23, "m": 59, "s": 59}
_NAMES = {"h": "hours", "m": "minutes", "s": "seconds"}


def parse_time(text: str) -> int:
    """Seconds of a SLURM time limit; ValueError naming the accepted forms otherwise. 0 = no limit."""
    t = text.strip()
    if t.upper() in ("UNLIMITED", "INFINITE"):
        return 0
    for pattern, units in _PATTERNS:
        m = pattern.fullmatch(t)
        if not m:
            continue
        values = [int(g) for g in m.groups()]
        for i, (unit, v) in enumerate(zip(units, values, strict=True)):
            bounded = i > 0 or (unit == "h" and len(units) > 1 and units[0] == "d")
            if bounded and unit in _MAX and v > _MAX[unit]:
                raise ValueError(
                    f"{text!r}: {v} is out of range for {_NAMES[unit]} (at most {_MAX[unit]}); use {FORMS}"
                )
        return sum(_SECONDS[u] * v for u, v in zip(units, values, strict=True))
    raise ValueError(f"{text!r} is not a SLURM time limit; use {FORMS}")
