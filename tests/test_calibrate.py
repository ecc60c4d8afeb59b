"""Issue 34, calibration and the ledger: what a run measured beside what its plan said, a calibration file made
from a real short run, and plans that use it.

The pure parts are checked on hand-made metrics records (figures worked out here, not read back from the code);
the end-to-end test runs `dtlaunch calibrate` on the local target for real (2 gloo ranks under torchrun) and then
plans with the file it wrote. The same on the local SLURM cluster is in tests/slurm/test_calibrate_slurm.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launcher.cli.calibrate import fit_depth
from launcher.errors import RecipeError
from launcher.plan import make_plan
from launcher.plan.ledger import accuracy, entry, measure
from launcher.recipe import load

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"


def step(n: int, t: float, active: float | None = None, **kw) -> dict:
    return {"step": n, "step_time_s": t, "tokens_per_s": 1000 / t, "active_peak_mb": active, **kw}


def test_measure_leaves_out_each_attempts_first_step_and_counts_only_blocking_saves():
    recs = [
        {"event": "start", "attempt": 0},
        step(1, 9.0, 100),  # start-up: left out
        step(2, 1.0, 300),
        step(3, 3.0, 200),
        {"event": "checkpoint", "seconds": 2.0, "asynchronous": False},
        {"event": "checkpoint", "seconds": 50.0, "asynchronous": True},  # overlaps training: not a write time
        {"event": "start", "attempt": 1},
        step(4, 7.0, 900),  # the second attempt's start-up: left out
        step(5, 2.0, 250),
        {"event": "checkpoint", "seconds": 4.0, "asynchronous": False},
    ]
    m = measure(recs)
    assert m["logged_steps"] == 3
    assert m["step_seconds"] == 2.0  # median of 1, 3, 2
    assert m["checkpoint_write_seconds"] == 3.0 and m["checkpoints"] == 2
    assert m["peak_bytes"] == 300 * 2**20  # the largest of the measured steps, not the start-up's 900
    assert measure([step(1, 1.0)])["step_seconds"] is None  # only a start-up step: nothing measured


def test_the_ledger_inverts_the_plans_time_formula():
    """A run whose steps take exactly the planned time measures exactly the assumed MFU; one twice as slow, half."""
    recipe = load(TINY)
    plan = make_plan(recipe)
    recs = [step(i, plan.step_seconds * 2) for i in range(1, 6)]
    e = entry(recipe, plan, recs)
    assert e["measured"]["mfu"] == pytest.approx(recipe.resources.mfu / 2)
    assert e["error"]["step_seconds"] == pytest.approx(1.0)
    assert e["error"]["peak_bytes"] is None and e["measured"]["peak_bytes"] is None  # CPU: no allocator figures
    assert e["error"]["checkpoint_write_seconds"] is None  # no save in these records


def test_accuracy_is_the_median_and_the_worst_per_strategy():
    def lg(strategy, step_err, mem_err=None):
        return {"strategy": strategy, "error": {"step_seconds": step_err, "peak_bytes": mem_err}}

    rows = accuracy([lg("fsdp", 0.1, 0.02), lg("fsdp", -0.3, None), lg("fsdp", 0.2, -0.04), lg("ddp", 0.05)])
    by = {(r["strategy"], r["term"]): r for r in rows}
    assert by["fsdp", "step_seconds"]["median_error"] == pytest.approx(0.1)
    assert by["fsdp", "step_seconds"]["worst_error"] == pytest.approx(-0.3)
    assert by["fsdp", "peak_bytes"]["runs"] == 2 and by["fsdp", "peak_bytes"]["worst_error"] == pytest.approx(-0.04)
    assert by["ddp", "peak_bytes"]["runs"] == 0 and by["ddp", "peak_bytes"]["median_error"] is None


def _calibration(tmp_path: Path, mfu: float, accelerator: str = "cpu", gbps: float | None = 0.5) -> Path:
    doc = {"kind": "dtlaunch-calibration", "format": 1, "accelerator": accelerator}
    doc["calibrated"] = {"mfu": mfu, "storage_gbps_per_node": gbps}
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(doc))
    return p


def test_a_calibration_replaces_the_assumed_mfu_and_storage_rate(tmp_path):
    base = make_plan(load(TINY))
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "recipe.yaml").write_text(TINY.read_text() + "\n")
    _calibration(tmp_path / "r", 0.1)
    r = load(tmp_path / "r" / "recipe.yaml", ["resources.calibration=cal.json"])  # relative to the recipe file
    assert r.resources.calibration == str(tmp_path / "r" / "cal.json")
    assert r.resources.mfu == 0.1 and r.resources.storage_gbps_per_node == 0.5
    p = make_plan(r)
    assert p.step_seconds == pytest.approx(base.step_seconds * 0.4 / 0.1)
    assert p.checkpoint_write_seconds == pytest.approx(base.checkpoint_write_seconds * 2.0 / 0.5)


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda d: _calibration(d, 0.3, accelerator="H100"), "calibrated on H100, but the recipe runs on cpu"),
        (lambda d: d / "missing.json", "no such calibration file"),
        (lambda d: (d / "x.json").write_text("{") and d / "x.json", "not a calibration file"),
        (lambda d: _calibration(d, 0.0), "with a measured MFU"),
        (lambda d: d, "a directory, not a calibration file"),
    ],
)
def test_an_unusable_calibration_is_a_located_recipe_error(tmp_path, make, said):
    path = make(tmp_path)
    with pytest.raises(RecipeError) as e:
        load(TINY, [f"resources.calibration={path}"])
    (p,) = e.value.problems
    assert p.field == "resources.calibration" and said in p.message, p
    assert "dtlaunch calibrate" in (p.fix or "")


def test_a_model_too_large_for_one_node_is_calibrated_with_fewer_layers():
    """70B on one node of 8 x 80 GB does not fit; the calibration run keeps the layout and cuts the depth."""
    overrides = [
        "resources.nodes=1",
        "resources.accelerator=H100:8",
        "parallelism.strategy=fsdp",
        "parallelism.offload=none",
    ]
    assert not make_plan(load(REPO / "recipes" / "llama70b.yaml", overrides)).memory.fits
    sets, said = fit_depth(str(REPO / "recipes" / "llama70b.yaml"), overrides)
    (layers,) = [s for s in sets if s.startswith("model.layers=")]
    n = int(layers.split("=")[1])
    assert 1 <= n < 80 and f"{n} of its 80 layers" in said
    assert make_plan(load(REPO / "recipes" / "llama70b.yaml", sets)).memory.fits


def test_calibrate_on_the_local_target_then_plan_with_it(tmp_path, run_cli, monkeypatch):
    """The real thing: a short run under torchrun, its ledger and calibration file, then plans that use it."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "cal"
    code, text, err = run_cli("calibrate", TINY, "--steps", "6", "-o", out)
    assert code == 0, err
    cal = json.loads((out / "calibration.json").read_text())
    ledger = json.loads((out / "ledger.json").read_text())  # every run leaves one; the calibration adds to it
    assert {k: cal[k] for k in ledger if k != "written"} == {k: ledger[k] for k in ledger if k != "written"}
    m = cal["measured"]
    assert m["logged_steps"] == 5 and m["step_seconds"] > 0 and m["checkpoints"] == 2
    assert 0 < cal["calibrated"]["mfu"] == m["mfu"]
    assert cal["world_size"] == 2 and cal["strategy"] == "fsdp" and cal["accelerator"] == "cpu"
    assert re.search(r"step time\s+\d+ ms\s+\d+ ms\s+[+-][\d.]+%", text), text

    # The job's log carries the same ledger (a target whose run directory stays on its nodes hands it back so):
    # calibrating from the log alone gives the same file.
    (log,) = (out / "logs").glob("*.log")
    code, text, err = run_cli("calibrate", TINY, "--from", log)
    assert code == 0, err
    again = json.loads((log.parent / "calibration.json").read_text())
    assert {k: v for k, v in again.items() if k != "written"} == {k: v for k, v in cal.items() if k != "written"}

    # The same layout and world: the calibrated plan's step time is the measured one.
    code, text, err = run_cli("plan", TINY, "--calibration", out / "calibration.json", "--json")
    assert code == 0, err
    assert json.loads(text)["time"]["step_seconds"] == pytest.approx(m["step_seconds"], rel=1e-6)
    code, text, err = run_cli(
        "plan", TINY, "--set", "resources.usd_per_gpu_hour=3", "--calibration", out / "calibration.json"
    )
    assert code == 0, err
    assert f"at MFU {cal['calibrated']['mfu']:.3g} (measured)" in text
    assert re.search(r"this plan: step time \S+ ms at the assumed MFU 0\.4 -> \S+ ms; total .* -> .*; cost \$", text)

    code, text, err = run_cli("plan", "--accuracy", tmp_path)
    assert code == 0, err
    assert re.search(r"fsdp\s+step_seconds\s+1\s+[+-][\d.]+%\s+[+-][\d.]+%", text), text
