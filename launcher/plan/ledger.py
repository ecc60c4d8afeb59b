"""The plan beside what a run measured: the ledger every run leaves (RUN_DIR/ledger.json), the calibration file
`dtlaunch calibrate` writes, and the summary `plan --accuracy` prints. Pure functions over a plan and the
records of a metrics.jsonl; the runtime (Job.release) and the CLI do the reading and writing.

What is compared, per run:
- step time: the plan's (at its MFU) against the median logged step time, leaving out each attempt's first
  logged step (start-up, compilation, the allocator's first growth);
- checkpoint write: the plan's write time against the median of the run's blocking saves;
- peak memory per rank, the maximum over ranks: the plan's peak moment without the CUDA context and the
  fragmentation allowance against the caching allocator's active peak (what the tensors hold), and with the
  fragmentation against its reserved peak (the context is outside the allocator, so in neither). A CPU run has
  no allocator figures: its memory is not measured (`plan --trace` checks the CPU figures against the runtime's
  tensors instead).
From these, the figures a plan can reuse: the MFU this code reached on this hardware (the plan's own FLOPs
formula over the measured step time) and each node's checkpoint write rate.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..recipe.calibration import FORMAT, KIND, CalibrationError
from . import cost

LEDGER_FILE = "ledger.json"
# The ledger is also one line of the job's log, after this marker: a target whose run directory is on the nodes
# (SkyPilot's, gone with them) still hands it back through its logs, which the scheduler keeps.
LOG_MARKER = "dtlaunch-ledger: "


def log_line(ledger: dict) -> str:
    return LOG_MARKER + json.dumps(ledger, separators=(",", ":"), sort_keys=True)


def from_log(lines) -> dict | None:
    """The last ledger a job's log carries (whatever prefix the launcher put before the marker), or None."""
    found = None
    for line in lines:
        _, marker, rest = line.partition(LOG_MARKER)
        if not marker:
            continue
        try:
            doc = json.loads(rest)
        except json.JSONDecodeError:  # a line cut by the log's own limits
            continue
        if isinstance(doc, dict) and doc.get("format") == FORMAT:
            found = doc
    return found


TERMS = ("step_seconds", "checkpoint_write_seconds", "peak_bytes", "reserved_bytes")


def _median(xs: list[Any]) -> float | None:
    ok = [float(x) for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return statistics.median(ok) if ok else None


def measure(records: list[dict]) -> dict[str, Any]:
    """What a run's metrics.jsonl records say: the median step time and tokens/s (each attempt's first logged
    step left out), the blocking saves' median write time, the peak active and reserved memory over ranks."""
    steps: list[dict] = []
    first = True
    for r in records:
        if r.get("event") == "start":
            first = True
        elif "event" not in r and "step_time_s" in r:
            if not first:
                steps.append(r)
            first = False
    saves = [r["seconds"] for r in records if r.get("event") == "checkpoint" and not r.get("asynchronous")]
    mb = [float(r["active_peak_mb"]) for r in steps if r.get("active_peak_mb") is not None]
    reserved = [float(r["reserved_peak_mb"]) for r in steps if r.get("reserved_peak_mb") is not None]
    return {
        "logged_steps": len(steps),
        "step_seconds": _median([r["step_time_s"] for r in steps]),
        "tokens_per_s": _median([r.get("tokens_per_s") for r in steps]),
        "checkpoint_write_seconds": _median(saves),
        "checkpoints": len(saves),
        "peak_bytes": max(mb) * 2**20 if mb else None,
        "reserved_bytes": max(reserved) * 2**20 if reserved else None,
    }


def achieved_mfu(plan, recipe, step_seconds: float) -> float:
    """The MFU that makes the plan's own time formula give `step_seconds` (cost.step_seconds, inverted)."""
    peak = recipe.resources.device().peak_tflops
    return cost.step_seconds(plan.flops_per_step, plan.world_size, peak, 1.0, plan.layout) / step_seconds


def write_rate_gbps(plan, recipe, write_seconds: float) -> float:
    """Each node's checkpoint write rate, GB/s, that makes cost.checkpoint_write_seconds give `write_seconds`."""
    nbytes = cost.checkpoint_bytes(plan.params, recipe.training.optimizer)
    return nbytes / (plan.nodes * write_seconds * 1e9)


def entry(recipe, plan, records: list[dict], run_dir: str = "") -> dict[str, Any]:
    """One run's ledger: the plan's predictions, the measured values, their relative error (measured / planned
    - 1; None where a value was not measured)."""
    m = measure(records)
    predicted = {
        "step_seconds": plan.step_seconds,
        "checkpoint_write_seconds": plan.checkpoint_write_seconds,
        "peak_bytes": plan.memory.active,
        "reserved_bytes": plan.memory.reserved,
        "mfu": recipe.resources.mfu,
    }
    measured = dict(m)
    measured["mfu"] = achieved_mfu(plan, recipe, m["step_seconds"]) if m["step_seconds"] else None
    w = m["checkpoint_write_seconds"]
    measured["storage_gbps_per_node"] = write_rate_gbps(plan, recipe, w) if w else None
    error = {k: (measured[k] / predicted[k] - 1 if measured[k] is not None and predicted[k] else None) for k in TERMS}
    lay = plan.layout
    return {
        "format": FORMAT,
        "run_dir": run_dir,
        "recipe": recipe.name,
        "recipe_hash": recipe.digest(),
        "written": round(time.time(), 3),
        "accelerator": plan.accelerator,
        "world_size": plan.world_size,
        "nodes": plan.nodes,
        "strategy": lay.strategy,
        "layout": {
            "dp": lay.dp,
            "tp": lay.tp,
            "pp": lay.pp,
            "precision": lay.precision,
            "activation_checkpointing": lay.activation_checkpointing,
            "offload": lay.offload,
            "micro_batch": lay.micro_batch,
            "grad_accum": lay.grad_accum,
        },
        "params": plan.params,
        "tokens_per_step": plan.tokens_per_step,
        "predicted": predicted,
        "measured": measured,
        "error": error,
    }


# ------------------------------------------------------------------ calibration


def calibration(ledger: dict) -> dict[str, Any]:
    """A calibration file from a calibration run's ledger: the ledger itself, plus the figures a plan reuses."""
    m = ledger["measured"]
    if not m.get("step_seconds"):
        raise CalibrationError(
            f"the run logged {m.get('logged_steps', 0)} step(s) after its first: no step time to calibrate with",
            "calibrate with more steps (--steps 20 or more) and training.log_every=1",
        )
    return {
        "kind": KIND,
        **ledger,
        "calibrated": {"mfu": m["mfu"], "storage_gbps_per_node": m.get("storage_gbps_per_node")},
    }


# ------------------------------------------------------------------ accuracy over runs


def read_ledgers(paths: Sequence[str | Path]) -> list[dict]:
    """The ledgers under `paths` (run directories, ledger files, or directories of runs), each once."""
    found: dict[Path, dict] = {}
    for p in map(Path, paths):
        files = (
            [p]
            if p.is_file()
            else [p / LEDGER_FILE]
            if (p / LEDGER_FILE).is_file()
            else sorted(p.glob(f"*/{LEDGER_FILE}"))
        )
        for f in files:
            try:
                doc = json.loads(f.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(doc, dict) and doc.get("format") == FORMAT and "error" in doc:
                found[f.resolve()] = doc
    return list(found.values())


def accuracy(ledgers: list[dict]) -> list[dict[str, Any]]:
    """Per strategy and term: how many runs measured it, the median and the worst (largest) relative error."""
    rows = []
    for strategy in sorted({lg["strategy"] for lg in ledgers}):
        mine = [lg for lg in ledgers if lg["strategy"] == strategy]
        for term in TERMS:
            errs = [lg["error"][term] for lg in mine if lg["error"].get(term) is not None]
            rows.append(
                {
                    "strategy": strategy,
                    "term": term,
                    "runs": len(errs),
                    "median_error": statistics.median(errs) if errs else None,
                    "worst_error": max(errs, key=abs) if errs else None,
                }
            )
    return rows
