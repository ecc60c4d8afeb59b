"""Issue 34: published figures as tests of the plan's time and memory. torchtitan's Llama 3.1 runs on H100
(tests/anchors/torchtitan_h100.json, with their layouts and batch sizes) are planned here; one of them, measured,
calibrates the MFU (one for bf16, one for torch.compile + Float8, which the plan does not model), and the plan
must then land near every other one. Where it does not, the bound below pins the known difference and its
reason (docs/accuracy.md has the table): a change to the model that moves a figure fails here and is seen.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.plan import make_plan
from launcher.recipe import load

HERE = Path(__file__).resolve().parent
RECIPES = HERE.parent / "recipes"
DOC = json.loads((HERE / "anchors" / "torchtitan_h100.json").read_text())
ANCHORS = {a["id"]: a for a in DOC["anchors"]}
GIB = 2**30

# (lowest, highest) relative error, predicted / published - 1, and why where it is not near 0.
TIME = {
    "t1-8b-fsdp-8": (-1e-9, 1e-9),  # the calibration itself
    "t1-8b-fsdp-8-compile-float8": (-1e-9, 1e-9),
    "t3-8b-fsdp-128": (-0.05, 0.05),  # +2.8%: 16 nodes lose a little to the inter-node reduce-scatter
    "t4-70b-fsdp32-tp8": (-0.05, 0.05),  # +1.5%
    # +28%: the 1F1B bubble (18% at 32 micro-batches over 8 stages) is modelled, the stage-to-stage sends on the
    # critical path are not; the bubbles make interleaving 10% faster, torchtitan measured 28%
    "t5-405b-fsdp8-tp8-pp8-1f1b": (0.15, 0.40),
    "t5-405b-fsdp8-tp8-pp8-interleaved": (0.0, 0.15),  # +9.5%: the same, smaller
}
MEMORY = {
    "t1-8b-fsdp-8": (-0.10, 0.0),  # -6%: torchtitan's figure is the reserved peak, with the allocator's caching
    "t1-8b-fsdp-8-compile-float8": (-0.05, 0.05),
    "t3-8b-fsdp-128": (-0.05, 0.05),
    # -50% and -36%/-22%: torch.compile, Float8 (its scaled weight copies for the all-gathers) and async TP's
    # symmetric-memory buffers are not in the plan (`plan` lists them as not modelled)
    "t4-70b-fsdp32-tp8": (-0.60, -0.40),
    "t5-405b-fsdp8-tp8-pp8-1f1b": (-0.45, -0.25),
    "t5-405b-fsdp8-tp8-pp8-interleaved": (-0.30, -0.15),
}


def plan(a: dict, mfu: float = 0.4):
    overrides = [
        "resources.accelerator=H100:8",
        "resources.gpu_memory_gb=96",  # their H100s have 96 GB of HBM2e
        f"resources.nodes={a['nodes']}",
        f"resources.mfu={mfu}",
        "parallelism.strategy=fsdp",
        "parallelism.offload=none",
        f"parallelism.tensor={a['tp']}",
        f"parallelism.sequence_parallel={str(a['tp'] > 1).lower()}",
        f"parallelism.pipeline={a['pp']}",
        f"parallelism.pipeline_schedule={a.get('schedule', '1f1b')}",
        f"parallelism.activation_checkpointing={a['ac']}",
        "model.seq_len=8192",
        "training.tokens=null",
        "training.steps=100",
        f"training.global_batch={a['global_batch']}",
        # torchtitan's local batch is per data-parallel rank; with a pipeline its micro-batches are of size 1
        f"training.micro_batch={1 if a['pp'] > 1 else a['local_batch']}",
        f"parallelism.grad_accum={a['local_batch'] if a['pp'] > 1 else 1}",
    ]
    return make_plan(load(RECIPES / a["recipe"], overrides))


def tps_per_gpu(p) -> float:
    return p.tokens_per_step / p.step_seconds / p.world_size


def calibrated_mfu(techniques: str) -> float:
    """The MFU of the busy time that makes the plan give the calibration run's published tokens/s."""
    a = ANCHORS[DOC["calibration"][techniques]]
    return 0.4 * a["tps_per_gpu"] / tps_per_gpu(plan(a))


@pytest.mark.parametrize("anchor", list(ANCHORS))
def test_the_plan_lands_near_torchtitans_published_h100_runs(anchor):
    a = ANCHORS[anchor]
    p = plan(a, calibrated_mfu(a["techniques"]))
    assert (p.layout.tp, p.layout.pp, p.world_size) == (a["tp"], a["pp"], a["nodes"] * 8)
    assert p.global_batch == a["global_batch"]
    time_err = tps_per_gpu(p) / a["tps_per_gpu"] - 1
    mem = p.memory.reserved  # they read torch's allocator, which the context is outside
    mem_err = mem / GIB / a["memory_gib"] - 1
    lo, hi = TIME[anchor]
    assert lo <= time_err <= hi, f"{anchor}: {tps_per_gpu(p):.0f} tokens/s/GPU against {a['tps_per_gpu']}"
    lo, hi = MEMORY[anchor]
    assert lo <= mem_err <= hi, f"{anchor}: {mem / GIB:.1f} GiB against {a['memory_gib']}"


def test_the_calibrated_mfus_are_what_torchtitan_reports():
    """torchtitan: 'the 1D Llama 3.1 8B model training on 8 or 128 H100 GPUs without Float8 achieves 33% to 39%
    MFU' (against the SXM peak, which their lower-power H100s do not reach)."""
    assert 0.33 <= calibrated_mfu("bf16") <= 0.39


# ----------------------------------------------------------------------------- measured on a GPU

H200 = json.loads((HERE / "anchors" / "h200_ledgers.json").read_text())
# The allocator's active peak on the H200 against the plan's tensors (with cuBLAS's workspaces): (lowest, highest)
# relative error. Within 1% unless said.
ACTIVE = {
    "gpu-matrix0/device/ddp-fp16": (0.0, 0.06),  # +4.0%: not yet explained (fp16 DDP only; bf16 is +0.2%)
    "gpu-matrix0/device/zero2-fp16": (0.0, 0.03),  # +1.5%
    "gpu-matrix0/device/zero3-bf16": (0.0, 0.07),  # +5.0%: not yet explained
    # +50%: with optimizer offload DeepSpeed holds ~440 MB more on the GPU than the plan's staging buffer; not
    # yet explained
    "gpu-matrix0/device/zero2-offload-adamw": (0.4, 0.6),
    "gpu-matrix0/device/zero2-offload-sgd": (0.4, 0.6),
}


@pytest.mark.parametrize("run", H200["runs"], ids=lambda r: r["run"])
def test_the_plans_tensors_are_what_an_h200_allocated(run):
    from launcher.plan.ledger import entry
    from launcher.recipe.loading import load_data

    recipe = load_data(json.loads(json.dumps(run["recipe"])), run["run"])
    predicted = entry(recipe, make_plan(recipe), [])["predicted"]["peak_bytes"]
    err = run["active_peak_bytes"] / predicted - 1
    lo, hi = ACTIVE.get(run["run"], (-0.01, 0.01))
    assert lo <= err <= hi, (
        f"{run['run']}: {run['active_peak_bytes'] / 1e6:.1f} MB measured, {predicted / 1e6:.1f} planned"
    )
