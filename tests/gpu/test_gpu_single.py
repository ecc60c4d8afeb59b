"""One GPU: the runtime's CUDA paths as a user's first job runs them (the review's single-GPU set, about 10 min on
an H100). Each test asserts logged metrics, placements and exit codes; numbers in the names are the GPU-path
review's findings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_harness import accelerator, gpu_recipe, result, run_cases, steps

from launcher.jobenv import ExitCode
from rt_harness import deep_merge, load_safetensors, run_torchrun, write_plan

BASELINE = Path(__file__).with_name("baseline.json")


def test_env_contract():
    """A CUDA build, NCCL, bf16, and the job's environment as the job scripts set it."""
    import torch.distributed as dist

    assert torch.version.cuda is not None and dist.is_nccl_available() and torch.cuda.is_bf16_supported()
    print(
        f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
    )


def test_7_a_gpu_plan_where_no_gpu_is_visible_is_a_preflight_error(tmp_path):
    plan = write_plan(tmp_path, gpu_recipe())
    p = subprocess.run(
        [sys.executable, "-m", "launcher.runtime.train", "--plan", str(plan), "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        timeout=300,
    )
    assert p.returncode == ExitCode.PREFLIGHT and "sees none" in p.stderr, p.stdout + p.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "launcher.runtime.train", "--plan", str(plan), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0 and torch.cuda.get_device_name(0) in ok.stdout, ok.stdout + ok.stderr


MATRIX = {
    # name: (recipe overrides, expected placement of params / grads / optimizer states)
    "ddp-bf16": ({"parallelism": {"strategy": "ddp"}}, "cuda"),
    "fsdp-bf16": ({"parallelism": {"strategy": "fsdp"}}, "cuda"),
    "fsdp-grad-op": ({"parallelism": {"strategy": "fsdp_grad_op", "activation_checkpointing": "selective"}}, "cuda"),
    "fsdp-offload": ({"parallelism": {"strategy": "fsdp", "offload": "optimizer"}}, "cpu"),  # 1, 2
    "fsdp-fp32-gqa": ({"parallelism": {"strategy": "fsdp", "precision": "fp32"}}, "cuda"),  # 16
    "ddp-fp16": ({"parallelism": {"strategy": "ddp", "precision": "fp16", "loss_scaling": "dynamic"}}, "cuda"),
    "fsdp-fp16": ({"parallelism": {"strategy": "fsdp", "precision": "fp16", "loss_scaling": "dynamic"}}, "cuda"),
    "zero1-bf16": ({"parallelism": {"strategy": "zero1"}}, None),
    "zero2-fp16": ({"parallelism": {"strategy": "zero2", "precision": "fp16", "loss_scaling": "dynamic"}}, None),
    "zero3-bf16": ({"parallelism": {"strategy": "zero3"}}, None),  # 4
    "zero2-offload-adamw": ({"parallelism": {"strategy": "zero2", "offload": "optimizer"}}, None),  # 8
    "zero2-offload-sgd": (
        {"parallelism": {"strategy": "zero2", "offload": "optimizer"}, "training": {"optimizer": "sgd", "lr": 0.05}},
        None,
    ),  # 8
}
STEPS = 6


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every case in one torchrun world, but the offloaded FSDP2 one in a world of its own: its process group
    also serves host tensors (cuda:nccl,cpu:gloo), and a world's backends are set when it starts."""
    root = tmp_path_factory.mktemp("gpu-matrix")
    cases = [
        (
            name,
            gpu_recipe(
                **deep_merge(
                    over, {"training": {"steps": STEPS, "log_every": 1}, "checkpoint": {"every": 4, "async": True}}
                )
            ),
            {},
        )
        for name, (over, _) in MATRIX.items()
    ]
    host = [c for c in cases if MATRIX[c[0]][1] == "cpu"]
    return {**run_cases(root / "device", 1, [c for c in cases if c not in host]), **run_cases(root / "host", 1, host)}


@pytest.mark.parametrize("name", list(MATRIX))
def test_every_strategy_trains_with_its_tensors_where_they_belong(matrix, name):
    d = matrix[name]
    result(d)
    rows = steps(d)
    losses = [r["loss"] for r in rows]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    placed = json.loads((d / "placement-rank0.json").read_text())
    assert placed["device"] == "cuda:0" and placed["buffers"] == ["cuda"], placed
    want = MATRIX[name][1]
    if want is not None:  # torch strategies: parameters, gradients (after the step: set to None or zeroed), states
        assert placed["params"] == [want] and placed["optimizer"] == [want], placed
        # 17: fused AdamW on GPU jobs, but under FSDP2's sharded fp16 scaler (its fused step fails after clipping)
        assert placed["fused"] is (name != "fsdp-fp16"), placed
        assert placed["backend"] == ("cuda:nccl,cpu:gloo" if want == "cpu" else "nccl")
    if name == "zero2-offload-adamw":
        assert placed["optimizer_type"] == "DeepSpeedCPUAdam", placed
    if name == "zero2-offload-sgd":
        assert placed["optimizer_type"] == "SGD", placed
    last = rows[-1]
    assert last["reserved_peak_mb"] > 0 and last["active_peak_mb"] <= last["reserved_peak_mb"]
    assert last["alloc_retries"] == 0, last  # 18: expandable segments
    assert last["mfu"] is None or 0 < last["mfu"] <= 1
    weights = load_safetensors(d / "model.safetensors")  # 5, 6: streamed export
    assert weights and all(bool(t.isfinite().all()) for t in weights.values())


def test_2_12_meta_initialisation_on_the_gpu(matrix):
    for name in ("fsdp-bf16", "fsdp-offload"):
        start = [
            m
            for m in map(json.loads, (matrix[name] / "metrics.jsonl").read_text().splitlines())
            if m.get("event") == "start"
        ][0]
        assert start["init"] == "meta"
        stds = json.loads((matrix[name] / "placement-rank0.json").read_text())["weight_std"]
        assert stds and all(0.01 < s < 0.04 for s in stds.values()), stds


def test_16_sdpa_runs_a_fused_kernel_or_says_why():
    """bf16 attention runs flash; fp32 with grouped-query heads runs the memory-efficient kernel on expanded k/v
    (the math kernel, which keeps every score, is off in a GPU job)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from launcher import catalog
    from launcher.runtime.dist import gpu_settings
    from launcher.runtime.models.llama import Attention, rope_tables

    gpu_settings()
    shape = catalog.PRESETS["tiny"]
    cos, sin = rope_tables(shape.hidden // shape.heads, 128, shape.rope_theta, device="cuda")
    att = Attention(shape).cuda()
    x = torch.randn(2, 128, shape.hidden, device="cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        att.bfloat16()(x.bfloat16(), cos, sin).sum().backward()
    att.float()(x, cos, sin).sum().backward()  # fp32 GQA: expanded, so a fused kernel takes it
    q = torch.randn(2, 4, 128, 32, device="cuda")
    kv = torch.randn(2, 2, 128, 32, device="cuda")
    with pytest.raises(RuntimeError):  # what the runtime avoids: fp32 + GQA has no fused kernel left
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)


def _single_world_trainer(tmp_path, monkeypatch, recipe: dict):
    import yaml

    from launcher.plan import make_plan
    from launcher.recipe import load_text
    from launcher.runtime.loop import Trainer

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SKYPILOT_NODE_RANK"):
        monkeypatch.delenv(k, raising=False)
    rec = load_text(yaml.safe_dump(recipe), "<gpu test>")
    return Trainer(rec, make_plan(rec), tmp_path)


def test_19_ordinary_steps_never_sync_and_step_times_are_the_gpus(tmp_path, monkeypatch):
    """torch.cuda.set_sync_debug_mode("error") around every ordinary step: any wait for the GPU raises. Log steps
    read the loss (one sync); their step time is within 5% of CUDA events' over the same steps."""
    import torch.distributed as dist

    rec = gpu_recipe(
        parallelism={"strategy": "fsdp"},
        training={"steps": 24, "log_every": 4},
        checkpoint={"every": 100, "export": "none"},
    )
    trainer = _single_world_trainer(tmp_path, monkeypatch, rec)
    it = trainer.steps()
    events = {}
    try:
        for step in range(1, 25):
            ordinary = step % 4 != 0 and step > 1
            torch.cuda.set_sync_debug_mode("error" if ordinary else 0)
            assert next(it) == step
            torch.cuda.set_sync_debug_mode(0)
            events[step] = torch.cuda.Event(enable_timing=True)
            events[step].record()
        with pytest.raises(StopIteration):
            next(it)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.cuda.synchronize()
    logged = {r["step"]: r for r in steps(tmp_path)}
    gpu = events[8].elapsed_time(events[20]) * 1e-3 / 12  # steps 9-20
    host = sum(logged[s]["step_time_s"] * 4 for s in (12, 16, 20)) / 12
    print(f"\nstep time: logged {host * 1e3:.1f} ms, CUDA events {gpu * 1e3:.1f} ms")
    assert host == pytest.approx(gpu, rel=0.05)


def test_20_async_checkpoints_resume_exactly(tmp_path):
    """Deterministic fsdp run preempted at step 5 (an async save at 4 in flight before it) and resumed: the losses
    of steps 6-8 are the uninterrupted run's, bit for bit."""
    rec = gpu_recipe(
        parallelism={"strategy": "fsdp"},
        training={"steps": 8, "deterministic": True},
        checkpoint={"every": 4, "async": True},
    )
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = run_torchrun(write_plan(ref_dir, rec), ref_dir, nproc=1, timeout=600)
    assert ref.rc == 0, ref.output[-3000:]
    first = run_torchrun(
        write_plan(run_dir, rec), run_dir, nproc=1, timeout=600, env={"DTLAUNCH_FAULT": "signal:rank=0:step=6:sig=USR2"}
    )
    assert ExitCode.PREEMPTED in first.worker_codes, first.output[-3000:]
    again = run_torchrun(run_dir / "plan.json", run_dir, nproc=1, timeout=600)
    assert again.rc == 0, again.output[-3000:]
    assert again.losses() == ref.losses()


@pytest.mark.gpus(2)
def test_9_resume_with_fewer_visible_gpus(tmp_path):
    rec = gpu_recipe(parallelism={"strategy": "fsdp"}, training={"steps": 4}, checkpoint={"every": 2})
    d = tmp_path / "run"
    plan = write_plan(d, rec)
    a = run_torchrun(
        plan,
        d,
        nproc=1,
        timeout=600,
        env={"CUDA_VISIBLE_DEVICES": "0,1", "DTLAUNCH_FAULT": "signal:rank=0:step=3:sig=USR2"},
    )
    assert ExitCode.PREEMPTED in a.worker_codes, a.output[-3000:]
    b = run_torchrun(plan, d, nproc=1, timeout=600, env={"CUDA_VISIBLE_DEVICES": "1"})
    assert b.rc == 0 and "resumed from step" in b.output, b.output[-3000:]


def test_22_data_workers_pin_and_read_the_same_tokens(tmp_path):
    import yaml

    from launcher.recipe import load_text
    from launcher.runtime.data import build_dataloader

    rec = load_text(
        yaml.safe_dump(gpu_recipe(training={"data": {"source": "synthetic", "num_tokens": 20000, "workers": 2}})),
        "<gpu test>",
    )
    kw = dict(vocab=512, seq_len=64, micro_batch=4, grad_accum=2, rank=0, world_size=1, seed=3)
    gpu = build_dataloader(rec.training.data, device=torch.device("cuda"), is_gpu=True, **kw)
    cpu = build_dataloader(rec.training.data, device=torch.device("cpu"), is_gpu=False, **kw)
    batch = next(iter(gpu.loader))
    assert batch.is_pinned()
    for _ in range(gpu.steps_per_epoch + 2):
        for (xa, _), (xb, _) in zip(gpu.next_step(), cpu.next_step(), strict=True):
            assert xa.device.type == "cuda" and torch.equal(xa.cpu(), xb)


def test_15_an_oom_is_a_config_error_with_the_gpus_memory_and_the_plans(tmp_path):
    rec = gpu_recipe(training={"steps": 6}, checkpoint={"every": 100})
    res = run_torchrun(
        write_plan(tmp_path, rec), tmp_path, nproc=1, timeout=600, env={"DTLAUNCH_FAULT": "oom:rank=0:step=3"}
    )
    assert ExitCode.CONFIG in res.worker_codes, res.output[-3000:]
    status = res.statuses()[0]
    assert "this GPU:" in status["message"] and "the plan expected" in status["message"]


def test_throughput_baseline(tmp_path):
    """A ~1.2B Llama (Llama 3.2 1B's shape, untied) with FSDP2 in bf16 on one GPU, 20 steps: tokens/s, MFU and
    the reserved peak, against the band recorded for this device in tests/gpu/baseline.json (printed, to be
    recorded there and in docs/gpu.md, when the device has none yet)."""
    model = {
        "layers": 16,
        "hidden": 2048,
        "ffn_hidden": 8192,
        "heads": 32,
        "kv_heads": 8,
        "vocab": 128256,
        "seq_len": 2048,
    }
    rec = gpu_recipe(
        model=model,
        parallelism={"strategy": "fsdp", "activation_checkpointing": "selective"},
        training={
            "steps": 20,
            "micro_batch": 4,
            "global_batch": 16,
            "log_every": 5,
            "data": {"source": "synthetic", "num_tokens": 2_000_000},
        },
        checkpoint={"every": 1000, "export": "none"},
    )
    rec["model"].pop("preset", None)
    res = run_torchrun(write_plan(tmp_path, rec), tmp_path, nproc=1, timeout=900)
    assert res.rc == 0, res.output[-3000:]
    last = [m for m in res.metrics() if "loss" in m][-1]
    name = torch.cuda.get_device_name(0)
    got = {"tokens_per_s": last["tokens_per_s"], "mfu": last["mfu"], "reserved_gb": last["reserved_peak_mb"] / 1024}
    print(f"\nthroughput baseline on {name} ({accelerator()}), torch {torch.__version__}: {json.dumps(got)}")
    assert got["mfu"] is not None and 0.05 < got["mfu"] <= 1.0, got
    band = json.loads(BASELINE.read_text()).get(name) if BASELINE.exists() else None
    if band is None:
        print(f"no band recorded for {name!r} in {BASELINE.name}: record these figures there")
        return
    for k, (lo, hi) in band.items():
        assert lo <= got[k] <= hi, (k, got[k], (lo, hi))
