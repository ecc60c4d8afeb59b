"""Every strategy trains the tiny Llama for real on 2 gloo ranks under torchrun, loss going down.

fp32 for every strategy, bf16 for the main ones (activation checkpointing variants are folded into
these cases so recomputation runs in real worlds without extra runs), fp16 with the torch loss
scalers (GradScaler for DDP, ShardedGradScaler for FSDP2) on the smaller `micro` preset because fp16
matmuls are slow on CPU. DeepSpeed's fp16 needs a GPU: that case must be a clear CONFIG error.

The matrix runs in ONE torchrun world (tests/runtime/multi_train.py, the public library API);
`python -m launcher.runtime.train` itself is exercised by every other multi-process test and by the
ZeRO/fp16 error case below.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest

from launcher import catalog
from launcher.jobenv import ExitCode
from launcher.plan.params import count_params
from launcher.runtime.checkpoint import disk
from rt_harness import (
    TORCHRUN,
    deep_merge,
    free_port,
    kill_tree,
    load_safetensors,
    recipe_dict,
    run_torchrun,
    torchrun_env,
    write_plan,
)

STEPS = 12
# the loss's fall over STEPS, at least: every strategy falls ~1.35 (6.25 -> 4.9); an update lost or mis-scaled
# leaves it near ln(512)
FALL = 1.0
CASES = [
    # (strategy, precision, activation checkpointing, offload)
    ("ddp", "fp32", "none", "none"),
    ("fsdp", "fp32", "none", "none"),
    ("fsdp_grad_op", "fp32", "selective", "none"),
    ("hybrid", "fp32", "full", "none"),
    # ZeRO-3 first of the DeepSpeed cases: it meets DeepSpeed's comm not yet set up, as in a fresh world
    # (test_zero3_is_the_first_deepspeed_case_of_the_shared_world)
    ("zero3", "fp32", "none", "params"),
    ("zero1", "fp32", "none", "none"),
    ("zero2", "fp32", "none", "optimizer"),
    ("ddp", "bf16", "selective", "none"),
    ("fsdp", "bf16", "full", "none"),
    ("zero2", "bf16", "none", "none"),
    ("zero3", "bf16", "selective", "none"),
]
FP16 = ["ddp", "fsdp"]
FP16_STEPS = 10


def _case_recipe(name: str) -> dict:
    kind, strategy, precision, ac, offload = name.split(":")
    if kind == "every-micro":  # the main case, but reduce-scattering on each of its 2 micro-steps
        return deep_merge(
            _case_recipe(f"main:{strategy}:{precision}:{ac}:{offload}"),
            {"parallelism": {"grad_reduce": "every_micro_batch"}},
        )
    if kind in STEPWISE:  # the main case, driven through Trainer.steps()
        return _case_recipe(f"main:{strategy}:{precision}:{ac}:{offload}")
    if kind == "fp16":
        return recipe_dict(
            model={"preset": "micro", "seq_len": 64},
            parallelism={"strategy": strategy, "precision": "fp16", "loss_scaling": "dynamic"},
            training={"steps": FP16_STEPS},
            checkpoint={"every": FP16_STEPS},
        )
    return recipe_dict(
        parallelism={"strategy": strategy, "precision": precision, "activation_checkpointing": ac, "offload": offload},
        training={"steps": STEPS},
        checkpoint={"every": STEPS // 2},
    )


STEPWISE = {"stepwise": {}, "stepwise-closed": {"close_after": 3}}  # kind -> how multi_train drives steps()
NAMES = (
    [f"main:{s}:{p}:{a}:{o}" for s, p, a, o in CASES]
    + [f"fp16:{s}:fp16:none:none" for s in FP16]
    + ["every-micro:fsdp:fp32:none:none"]
    + [f"{k}:ddp:fp32:none:none" for k in STEPWISE]
)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Run every case in one 2-rank torchrun world; returns {name: run_dir} and the log."""
    root = tmp_path_factory.mktemp("matrix")
    cases, dirs = [], {}
    for i, name in enumerate(NAMES):
        d = root / f"case{i:02d}"
        cases.append({"plan": str(write_plan(d, _case_recipe(name))), "run_dir": str(d)})
        if name.split(":")[0] in STEPWISE:
            cases[-1]["stepwise"] = STEPWISE[name.split(":")[0]]
        dirs[name] = d
    (root / "cases.json").write_text(json.dumps(cases))
    port = free_port()
    cmd = [
        TORCHRUN,
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--max-restarts=0",
        str(Path(__file__).with_name("multi_train.py")),
        str(root / "cases.json"),
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=torchrun_env())
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
    proc = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    secs = time.monotonic() - t0
    (root / "torchrun.log").write_text(proc.stdout + "\n----- stderr -----\n" + proc.stderr)
    print(f"\nstrategy matrix: {len(NAMES)} cases in one torchrun world, {secs:.1f}s, rc {proc.returncode}")
    return dirs, proc


def _result(matrix, name):
    dirs, proc = matrix
    d = dirs[name]
    r = d / "result-rank0.json"
    assert r.exists(), f"case not run (the world died earlier):\n{proc.stderr[-3000:]}"
    res = json.loads(r.read_text())
    assert res["code"] == 0, res["error"]
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    return d, res, [m for m in rows if "loss" in m]


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,precision,ac,offload",
    CASES,
    ids=[f"{s}-{p}-ac_{a}" + (f"-offload_{o}" if o != "none" else "") for s, p, a, o in CASES],
)
def test_strategy_trains(matrix, strategy, precision, ac, offload):
    d, res, rows = _result(matrix, f"main:{strategy}:{precision}:{ac}:{offload}")
    losses = {m["step"]: m["loss"] for m in rows}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in losses.values())
    first, last = losses[1], sum(losses[s] for s in (STEPS - 2, STEPS - 1, STEPS)) / 3
    assert first > 6.0  # ~ln(512): an untrained model
    assert last < first - FALL, f"loss did not fall enough: {first:.3f} -> {last:.3f}"
    assert disk.complete_steps(d / "checkpoints") == [STEPS // 2, STEPS]
    weights = load_safetensors(d / "model.safetensors")
    assert sum(t.numel() for t in weights.values()) == count_params(catalog.PRESETS["tiny"])
    assert all(str(t.dtype) == "torch.float32" for t in weights.values())
    record = rows[-1]  # what a GPU user watches, here on CPU: the host's figures, the GPU's null (never invented)
    assert record["host_rss_mb"] > 50 and record["peak_rank"] in (0, 1) and record["tokens_per_s"] > 0
    assert record["mfu"] is None and record["active_peak_mb"] is None and record["reserved_peak_mb"] is None
    start = [m for m in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if m.get("event") == "start"]
    # ZeRO-3 builds under deepspeed.zero.Init (no rank ever holds the whole model); sharded torch strategies on meta
    assert start[0]["init"] == {"ddp": "eager", "zero1": "eager", "zero2": "eager", "zero3": "partitioned"}.get(
        strategy, "meta"
    ), start
    if strategy.startswith("zero"):
        zero = json.loads((d / "deepspeed_config.json").read_text())["zero_optimization"]
        assert zero["stage"] == int(strategy[-1])
        assert ("offload_optimizer" in zero) == (offload != "none")
        assert ("offload_param" in zero) == (offload == "params")
    print(f"\n{strategy}/{precision}/ac={ac}/offload={offload}: loss {first:.3f} -> {last:.3f} ({res['seconds']}s)")


@pytest.mark.slow
def test_every_strategy_starts_from_the_same_weights(matrix):
    """Built eagerly (DDP, ZeRO-1/2), on meta and materialised shard by shard (FSDP2, HSDP), or partitioned from
    the start (ZeRO-3, each rank filling only its own partitions), the model starts from the same weights: the
    first step's loss, computed before any update on the same data, is DDP's (fp32; the sums differ in order)."""
    _, _, ref = _result(matrix, "main:ddp:fp32:none:none")
    for s, p, a, o in CASES:
        if p != "fp32":
            continue
        _, _, rows = _result(matrix, f"main:{s}:{p}:{a}:{o}")
        assert rows[0]["step"] == 1 and rows[0]["loss"] == pytest.approx(ref[0]["loss"], abs=1e-5), (s, rows[0])


@pytest.mark.slow
def test_no_step_leaves_tensors_in_reference_cycles(matrix):
    """The trainer runs Python's collector only every 50 steps (launcher/runtime/stepgc.py). That is safe only
    if no step makes a reference cycle holding a tensor: on a GPU, such a cycle would keep its memory for up
    to 50 steps, beyond the planner's peak. The driver collects after every step of every case (checkpoints,
    activation checkpointing, offload, HSDP, DeepSpeed and the fp16 scalers included) and counts the
    tensors that only the collector could free."""
    seen = 0
    for name in NAMES:
        _, res, _ = _result(matrix, name)
        gc_found = res["gc"]
        steps = STEPWISE.get(name.split(":")[0], {}).get("close_after", FP16_STEPS)  # the fewest a case runs
        assert gc_found["collections"] >= steps, (name, gc_found)
        assert gc_found["tensors"] == 0, (
            f"{name}: {gc_found['tensors']} tensors ({gc_found['tensor_bytes']} bytes) "
            "were held only by reference cycles"
        )
        seen += gc_found["objects"]
    assert seen > 0  # the probe does find the cycles a run makes (of plain Python objects)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", FP16)
def test_fp16_with_loss_scaling_trains_without_nan(matrix, strategy):
    d, res, rows = _result(matrix, f"fp16:{strategy}:fp16:none:none")
    assert len(rows) == FP16_STEPS
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert all(r.get("loss_scale") for r in rows)  # the scaler was active
    weights = load_safetensors(d / "model.safetensors")
    assert all(bool(t.isfinite().all()) for t in weights.values())
    print(f"\nfp16 {strategy}: loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, scale {rows[-1]['loss_scale']}")


@pytest.mark.slow
def test_deepspeed_fp16_on_cpu_is_a_config_error(run_dir):
    """DeepSpeed's CPU accelerator has no fp16: the job must say so (exit CONFIG), not crash."""
    rec = recipe_dict(parallelism={"strategy": "zero2", "precision": "fp16"}, training={"steps": 2})
    res = run_torchrun(write_plan(run_dir, rec), run_dir)
    assert ExitCode.CONFIG in res.worker_codes, res.output[-3000:]
    assert "DeepSpeed does not support fp16" in res.stderr
    assert res.stderr.count("Traceback (most recent call last)") == 1  # torchrun's own report, none from workers
    assert not (run_dir / "metrics.jsonl").exists() or not res.losses()


def test_zero3_is_the_first_deepspeed_case_of_the_shared_world():
    """ZeRO-3 builds its model under zero.Init before deepspeed.initialize: DeepSpeed's comm must already see both
    ranks, or its batch check fails ("16 != 4 * 2 * 1"; it did in a fresh world). The comm is set up once per
    process, by the first DeepSpeed case: the matrix's world meets ZeRO-3 as a fresh one does only while ZeRO-3
    comes before every other DeepSpeed case (nothing else in the runtime sets DeepSpeed's comm up); its
    test_strategy_trains case is then the fresh world's check (with the fix of 52935c6 undone, it fails there)."""
    deepspeed_cases = [n for n in NAMES if n.split(":")[1].startswith("zero")]
    assert deepspeed_cases[0].split(":")[1] == "zero3", deepspeed_cases


@pytest.mark.slow
def test_fsdp_reducing_once_per_step_trains_as_reducing_every_micro_step(matrix):
    """The plan has the tiny FSDP run reduce-scatter once per step (its unsharded gradients fit): the same run
    reducing on each of its 2 micro-steps must follow the same loss curve, since only the order of the sums
    changes (fp32 rounding: agreement to 1e-4, not bit-for-bit)."""
    d_once, _, once = _result(matrix, "main:fsdp:fp32:none:none")
    d_every, _, every = _result(matrix, "every-micro:fsdp:fp32:none:none")
    assert json.loads((d_once / "plan.json").read_text())["plan"]["layout"]["grad_reduce"] == "once_per_step"
    assert json.loads((d_every / "plan.json").read_text())["plan"]["layout"]["grad_reduce"] == "every_micro_batch"
    a, b = [r["loss"] for r in once], [r["loss"] for r in every]
    assert len(a) == len(b) == STEPS
    assert a == pytest.approx(b, rel=1e-4)
    assert a[-1] < a[0] - FALL


@pytest.mark.slow
def test_a_run_driven_step_by_step_trains_as_run_does(matrix):
    """`Trainer.steps()` with foreign collectives between its steps (how the overhead benchmark interleaves a
    hand-written loop) yields each step once, follows run()'s loss curve and checkpoints, and restores the
    signal handlers at its end; closed after 3 steps, it stops there, saves nothing and still restores them."""
    d_run, res_run, by_run = _result(matrix, "main:ddp:fp32:none:none")
    d, res, stepped = _result(matrix, "stepwise:ddp:fp32:none:none")
    assert res["stepwise"]["yielded"] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in stepped] == pytest.approx([r["loss"] for r in by_run], rel=1e-6)
    assert disk.complete_steps(d / "checkpoints") == [STEPS // 2, STEPS]
    assert (d / "model.safetensors").exists()
    assert res["stepwise"]["handlers_restored"] and res_run["stepwise"]["handlers_restored"]

    d, res, closed = _result(matrix, "stepwise-closed:ddp:fp32:none:none")
    assert res["stepwise"]["yielded"] == [1, 2, 3]
    assert [r["step"] for r in closed] == [1, 2, 3]
    assert disk.complete_steps(d / "checkpoints") == []
    assert not (d / "model.safetensors").exists()
    assert res["stepwise"]["handlers_restored"]
