"""A calibration file (`dtlaunch calibrate` writes it) as a recipe reads it: `resources.calibration: FILE`, or
`plan --calibration FILE`, replaces the assumed `resources.mfu` and `storage_gbps_per_node` with what a short run
of this recipe measured on its hardware. Read when the recipe is loaded, so that plan, validate, render and the
shipped plan all use the same figures. The file's other half (how it is made) is launcher.plan.ledger.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import DtlaunchError

FORMAT = 1
KIND = "dtlaunch-calibration"
MAX_BYTES = 1 << 20
MAKE_ONE = "write one with `dtlaunch calibrate RECIPE` (it prints the file's path)"


class CalibrationError(DtlaunchError):
    """A calibration file that cannot be used (or made): the message says why, `fix` what to do."""

    def __init__(self, message: str, fix: str = MAKE_ONE):
        super().__init__(message, fix)


def read_calibration(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
        doc = json.loads(raw) if len(raw) <= MAX_BYTES else None
    except FileNotFoundError:
        raise CalibrationError(f"{p}: no such calibration file") from None
    except IsADirectoryError:
        raise CalibrationError(f"{p}: a directory, not a calibration file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CalibrationError(f"{p}: not a calibration file ({e})") from None
    if isinstance(doc, dict) and doc.get("kind") == KIND and doc.get("format") == FORMAT:
        cal = doc.get("calibrated")
        mfu = cal.get("mfu") if isinstance(cal, dict) else None
        if isinstance(mfu, (int, float)) and mfu > 0 and isinstance(doc.get("accelerator"), str):
            return doc
    raise CalibrationError(f"{p}: not a dtlaunch calibration file (format {FORMAT}) with a measured MFU")


def calibrated_values(doc: dict, accelerator: str, source: str) -> dict[str, float]:
    """The resources fields a calibration replaces. One made on another accelerator is refused: its MFU says
    nothing about this one."""
    if doc["accelerator"] != accelerator:
        raise CalibrationError(
            f"{source}: calibrated on {doc['accelerator']}, but the recipe runs on {accelerator}",
            f"calibrate on {accelerator}: dtlaunch calibrate RECIPE",
        )
    c = doc["calibrated"]
    out = {"mfu": min(1.0, float(c["mfu"]))}
    rate = c.get("storage_gbps_per_node")
    if isinstance(rate, (int, float)) and rate > 0:
        out["storage_gbps_per_node"] = float(rate)
    return out


def resolve(path: str, base_dir: str | None) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base_dir or ".") / p
