"""Issue 34, `dtlaunch rehearse`: the recipe's layout scaled down and trained here for real (local jobs under
torchrun, gloo ranks), checked against one rank, through a preemption, a reshard and back, and a hang.

The scale-down is checked on the shipped recipes' plans (pure); the rehearsals run for real: the 405B layout
(tensor 8 on 8 ranks) passes every check, the ZeRO-3 recipe's memory is the plan's, and a layout broken on
purpose (one rank's gradient shard lost before an update, the test-only DTLAUNCH_REHEARSAL_FAULT) fails parity,
the check that must catch it. The README runs the 70B layout's parity.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.plan import make_plan
from launcher.plan.rehearsal import scale_down
from launcher.recipe import load
from launcher.recipe.loading import load_data

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


def degrees(data: dict) -> tuple:
    p = make_plan(load_data(json.loads(json.dumps(data))))
    return p.strategy, p.layout.tp, p.layout.pp, p.layout.dp, p.global_batch, p.world_size


@pytest.mark.parametrize(
    "recipe, overrides, expect",
    [
        ("llama3-405b.yaml", [], ("fsdp", 8, 1, 1)),  # tensor 8 kept, dp 16 -> 1 to fit 8 ranks
        ("llama70b.yaml", [], ("fsdp", 1, 1, 2)),
        ("llama70b.yaml", ["parallelism.tensor=2", "parallelism.pipeline=2"], ("fsdp", 2, 2, 2)),
        (
            "llama70b.yaml",
            ["parallelism.tensor=4", "parallelism.pipeline=4", "parallelism.pipeline_schedule=interleaved_1f1b"],
            ("fsdp", 2, 4, 1),  # 16 ranks: dp first, then tensor 4 -> 2
        ),
    ],
)
def test_the_rehearsal_keeps_the_layouts_degrees_and_its_control_sees_the_same_batch(recipe, overrides, expect):
    rec = load(RECIPES / recipe, ["parallelism.strategy=fsdp", *overrides])
    plan = make_plan(rec)
    r = scale_down(rec, plan)
    strategy, tp, pp, dp, batch, world = degrees(r.layout)
    assert (strategy, tp, pp, dp) == expect and world == r.nproc <= 8
    assert (
        pp == 1 or make_plan(load_data(json.loads(json.dumps(r.layout)))).layout.pp_schedule == plan.layout.pp_schedule
    )
    c_strategy, c_tp, c_pp, c_dp, c_batch, c_world = degrees(r.control)
    assert (c_tp, c_pp, c_dp, c_world) == (1, 1, 1, 1) and c_batch == batch
    o_strategy, o_tp, o_pp, o_dp, o_batch, o_world = degrees(r.other)
    assert (o_tp, o_pp, o_world, o_batch) == (1, 1, r.nproc, batch) and o_dp == r.nproc
    assert any("data parallel" in c for c in r.changes) == (dp != plan.layout.dp)


def rehearse(run_cli, recipe: Path, *args: str) -> tuple[int, dict]:
    code, out, err = run_cli("rehearse", recipe, "--json", *args)
    assert out.strip(), err
    return code, json.loads(out)


@pytest.mark.slow
def test_the_zero3_recipes_memory_is_the_plans_on_real_tensors(run_cli, tmp_path):
    """DeepSpeed's ZeRO-3 on CPU ranks: every rank's tensors counted (MemTracker) against the plan. This found
    the reduce bucket ZeRO-3 allocates whole at start-up (reduce_bucket_size elements), which the plan left out."""
    code, doc = rehearse(run_cli, RECIPES / "llama2-13b-zero3.yaml", "--only", "memory", "-o", str(tmp_path))
    (memory,) = doc["checks"]
    assert code == 0 and memory["ok"], json.dumps(doc, indent=2)
    assert len(list((tmp_path / "layout" / "memtrack").glob("rank-*.json"))) == doc["ranks"] == 2


@pytest.mark.slow
def test_a_layout_that_loses_a_gradient_shard_fails_parity(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("DTLAUNCH_REHEARSAL_FAULT", "drop_grads:rank=1:step=2")
    code, doc = rehearse(run_cli, RECIPES / "llama70b.yaml", "--only", "parity", "-o", str(tmp_path))
    (parity,) = doc["checks"]
    assert code == 1 and not doc["ok"] and parity["name"] == "parity" and not parity["ok"], doc
    worst = float(parity["detail"].split("one rank ")[1].split(" ")[0])
    assert worst > 1e-3, parity  # far beyond rounding: the fault, not noise, is what failed it
    (log,) = (tmp_path / "layout" / "logs").glob("*.log")
    assert "FAULT INJECTION rank 1: drop_grads at step 2" in log.read_text()


@pytest.mark.slow
def test_the_405b_layout_trains_like_one_rank_on_8_ranks_and_its_memory_is_the_plans(run_cli, tmp_path):
    """Tensor parallel 8 with sequence parallelism, kept at its degree; parity and memory share one 8-rank run
    (the whole rehearsal, with the reshard and the hang, takes about 4 minutes here: the README quotes it)."""
    code, doc = rehearse(
        run_cli, RECIPES / "llama3-405b.yaml", "--only", "parity", "--only", "memory", "-o", str(tmp_path)
    )
    assert doc["degrees"] == {"tp": 8, "pp": 1, "dp": 1} and doc["full"]["world"] == 128
    assert [c["name"] for c in doc["checks"]] == ["parity", "memory"], doc
    assert code == 0 and doc["ok"], json.dumps(doc, indent=2)


def test_the_rehearsal_says_when_it_does_not_run_the_users_script():
    rec = load(RECIPES / "tiny.yaml", ["entrypoint.script=train.py"])
    r = scale_down(rec, make_plan(rec))
    assert "entrypoint" not in r.layout and "entrypoint" not in r.control
    assert any("the recipe's script is not run" in c for c in r.changes), r.changes


@pytest.mark.slow
def test_the_world_check_runs_the_recipes_whole_world_on_a_fake_process_group(run_cli, tmp_path):
    """The tiny model at tensor 2 over 4 nodes of 4 GPUs: 16 ranks, more than the rehearsal starts, each placed in
    the mesh and one step traced at full size. FSDP2 reduce-scatters each of its units' gradients once per
    micro-step over the data-parallel ranks: the tiny preset's blocks, its embedding and its head (units of their
    own in a tensor-parallel layout) and the root (the final norm)."""
    from launcher.catalog import PRESETS

    code, doc = rehearse(
        run_cli,
        RECIPES / "tiny.yaml",
        *("--set", "parallelism.tensor=2", "--set", "resources.nodes=4", "--set", "resources.accelerator=H100:4"),
        *("--only", "world", "-o", str(tmp_path)),
    )
    (world,) = doc["checks"]
    assert code == 0 and world["ok"], json.dumps(doc, indent=2)
    detail = world["detail"]
    assert detail.startswith("16 ranks as pp 1 x dp_replicate 1 x dp_shard 8 x tp 2: each rank once"), detail
    units = PRESETS["tiny"].layers + 3
    assert f"{units} reduce-scatter over 8 ranks (dp_shard)" in detail, detail
    assert "all-reduce over 2 ranks (tp)" in detail, detail
    ratio = float(detail.rsplit("(", 1)[1].rstrip(")"))
    assert abs(ratio - 1) < 0.1, detail


def test_a_mesh_that_places_ranks_elsewhere_fails_the_world_check():
    """The 405B layout's 128 ranks: the check fails when the runtime's coordinates (its data shards, its checkpoint
    files) disagree with the mesh torch builds, and when a tensor group would span nodes."""
    from launcher.trace.world import check_mesh

    recipe = load(RECIPES / "llama3-405b.yaml")
    layout, _ = make_plan(recipe).layout.for_world(128)
    assert check_mesh(layout, 128, 8).ok
    swapped = check_mesh(layout, 128, 8, coords=lambda r: (0, r % 16, r // 16))  # dp innermost instead of tp
    assert not swapped.ok
    assert swapped.problems[0] == (
        "rank 1 is at (pp 0, dp 0, tp 1) in the mesh, but the runtime places it at (pp 0, dp 1, tp 0)"
    )
    small_nodes = check_mesh(layout, 128, 4)
    assert "tensor group [0, 1, 2, 3, 4, 5, 6, 7] spans nodes [0, 1]" in small_nodes.problems


def test_a_steps_collectives_are_its_micro_steps_and_its_optimizer_step():
    from launcher.trace.report import per_step

    traced = {
        "micro-step|all-gather|16": 4,
        "last micro-step|all-gather|16": 4,
        "last micro-step|reduce-scatter|16": 2,
        "optimizer step|all-reduce|16": 1,
    }
    assert per_step(traced, 8) == {("all-gather", 16): 32, ("all-reduce", 16): 1, ("reduce-scatter", 16): 2}
    assert per_step({"last micro-step|all-gather|2": 3}, 1) == {("all-gather", 2): 3}
