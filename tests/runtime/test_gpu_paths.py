"""The runtime's GPU and NCCL paths, checked on this CPU-only machine where torch allows it.

What CPU cannot run (a CUDA kernel, an NCCL communicator) is stood in for by what torch itself provides for
the purpose: fake CUDA tensors (`FakeTensorMode` creates `device="cuda"` tensors on a CPU build and raises on
a device mismatch), and the fake process group, registered for the devices its real counterpart serves
("cuda:fake" refuses a host tensor exactly as NCCL does: "No backend type associated with device type cpu").
Where a test needs torch to say that a GPU is there (a device count, a device's RNG), it says so: those are
mocks of the one thing that cannot exist here. The same paths run for real in tests/gpu on a GPU.

Numbers in the names: the findings of the GPU-path review these tests pin down.
"""

from __future__ import annotations

import ast
import contextlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from launcher import catalog, jobenv
from launcher.plan import make_plan
from launcher.recipe import load_text
from launcher.runtime.failures import PreflightError
from launcher.runtime.models.llama import apply_rope, build_model
from rt_harness import recipe_dict

REPO = Path(__file__).resolve().parents[2]


def _plan(**over):
    rec = load_text(yaml.safe_dump(recipe_dict(**over)), "<test>")
    return rec, make_plan(rec)


@contextlib.contextmanager
def fake_world(world_size: int, backend: str, rank: int = 0):
    """A fake process group of `world_size` ranks, this process being `rank`, with the devices `backend` names."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(backend, rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def as_fake(backend: str) -> str:
    """The fake group standing for a real backend spec: NCCL serves CUDA tensors only, gloo host ones."""
    if ":" not in backend:
        backend = {"nccl": "cuda:nccl", "gloo": "cpu:gloo"}[backend]
    return ",".join(f"{part.split(':')[0]}:fake" for part in backend.split(","))


# ----------------------------------------------------------------------------- 1: host collectives under offload


@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_1_offloaded_gradients_clip_over_a_group_that_reduces_host_tensors(offload):
    """FSDP2's CPU offload leaves the gradient shards on the host, so the clipping norm's all-reduce (and the fp16
    scaler's found-inf) reduce host tensors over the training groups: the default group needs a CPU backend
    beside NCCL. Here the group is the fake one with the devices the runtime's backend choice for this plan
    serves, at the 70B recipe's 64 ranks; the real clip_grad_norm runs on host gradients over it."""
    from launcher.runtime.dist import backend_for, host_collectives
    from launcher.runtime.gradclip import clip_grad_norm

    _, plan = _plan(
        parallelism={"strategy": "fsdp", "offload": offload}, resources={"accelerator": "H100:8", "nodes": 8}
    )
    backend = backend_for(True, host_collectives(plan))
    assert backend_for(True, False) == "nccl" and backend_for(False, False) == "gloo"
    params = [torch.nn.Parameter(torch.ones(4, 4, device="cpu")) for _ in range(3)]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    with fake_world(64, as_fake(backend), rank=5):
        norm = clip_grad_norm(params, 1.0, sum_over=dist.group.WORLD)  # raised on "cuda:fake" alone
    assert norm.device.type == "cpu"
    # a plan that keeps everything on the GPU stays on NCCL alone (no gloo communicators per group)
    _, plain = _plan(parallelism={"strategy": "fsdp", "offload": "none"}, resources={"accelerator": "H100:8"})
    assert backend_for(True, host_collectives(plain)) == "nccl"
    _, ds = _plan(parallelism={"strategy": "zero3", "offload": "optimizer"}, resources={"accelerator": "H100:8"})
    assert not host_collectives(ds)  # DeepSpeed reduces on the GPU before it offloads


def test_1_an_nccl_only_group_refuses_host_tensors():
    """The stand-in is faithful: the fake group for NCCL alone refuses what NCCL refuses."""
    with fake_world(64, as_fake("nccl"), rank=3), pytest.raises(RuntimeError, match="device type cpu"):
        dist.all_reduce(torch.ones(2, device="cpu"))


# ----------------------------------------------------------------------------- 2, 3, 12: meta initialisation


def test_2_offload_materialises_parameters_on_the_host_and_the_rotary_tables_on_the_gpu():
    """With FSDP2's CPU offload the parameters are materialised on the host, but forward runs on the GPU:
    the rotary tables (buffers, which FSDP2 moves only inside fully_shard and not when they are meta) must be
    made on the GPU, or the first forward mixes devices. Fake CUDA tensors: the real materialisation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from launcher.runtime.models import materialise

    model = build_model(catalog.PRESETS["micro"], device="meta")
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialise(model, torch.device("cuda"), offload=True)
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert model.rope_cos.device.type == "cuda" and model.rope_sin.device.type == "cuda"
        q = torch.empty(1, 16, 4, 16, device="cuda")
        assert apply_rope(q, model.rope_cos, model.rope_sin).device.type == "cuda"


def test_3_an_interleaved_split_built_on_meta_materialises_every_chunk():
    """Interleaved 1F1B: a rank's `local` module is separate from the chunks it runs (they share its blocks, not
    its buffers), and each chunk is materialised on its own; no chunk keeps a meta rotary table, and every
    weight is the eager model's."""
    from launcher.runtime.engines.pipeline import materialise_split, split_model

    shape = catalog.PRESETS["tiny"]
    eager = dict(build_model(shape, seed=7).named_parameters())
    for pp_rank in (0, 1):
        meta = build_model(shape, device="meta", seed=7)
        split = split_model(meta, 2, pp_rank, "interleaved_1f1b")
        assert len(split.chunks) == 2 and split.local not in split.chunks
        materialise_split(split, torch.device("cpu"), offload=False)
        for module in (*split.chunks, split.local):
            assert not any(t.is_meta for t in (*module.parameters(), *module.buffers()))
        for chunk in split.chunks:
            assert torch.equal(chunk.rope_cos, build_model(shape).rope_cos)
            for name, p in chunk.named_parameters():
                assert torch.equal(p, eager[name]), name


def test_12_initial_weights_are_a_function_of_seed_name_and_shape():
    """No two layers (so no two pipeline stages) draw the same numbers, the statistics are the intended ones,
    and the seed, not the global generator, decides them."""
    from launcher.runtime.models.llama import init_std

    shape = catalog.PRESETS["small-50m"]
    torch.manual_seed(123)
    a = dict(build_model(shape, seed=0).named_parameters())
    torch.manual_seed(456)
    b = dict(build_model(shape, seed=0).named_parameters())
    c = dict(build_model(shape, seed=1).named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    for name, p in a.items():
        std = init_std(name, shape.layers)
        if std is None:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert p.std().item() == pytest.approx(std, rel=0.05), name
    first, last = (
        a["layers.0.attention.wq.weight"].flatten(),
        a[f"layers.{shape.layers - 1}.attention.wq.weight"].flatten(),
    )
    assert abs(torch.corrcoef(torch.stack((first, last)))[0, 1].item()) < 0.1
    half = a["tok_embeddings.weight"].shape[0] // 2  # two shards of one tensor differ too
    top, bottom = a["tok_embeddings.weight"][:half].flatten(), a["tok_embeddings.weight"][half : 2 * half].flatten()
    assert abs(torch.corrcoef(torch.stack((top, bottom)))[0, 1].item()) < 0.1


def test_12_a_flat_partition_holds_the_whole_parameters_values():
    """ZeRO-3 partitions are flat slices: filled from the same blocks, they are the whole parameter's values."""
    from launcher.runtime.models import init

    whole = torch.empty(300, 7)
    init.normal_(whole, 0.02, seed=3, name="w")
    for start, n in ((0, 2100), (5, 17), (699, 701), (2090, 10)):
        part = torch.empty(n)
        init.normal_flat_(part, start, (300, 7), 0.02, seed=3, name="w")
        assert torch.equal(part, whole.flatten()[start : start + n])


# ----------------------------------------------------------------------------- fake CUDA over the model's functions


def test_the_models_functions_keep_to_the_device_on_fake_cuda():
    """The model's parts and the clipping on fake CUDA tensors: a tensor made without `device=` on the way would be
    on the CPU and raise a device mismatch (the rotary tables from the wrong device do). The whole model cannot run
    fake on a CPU-only build (ops that take a CUDA device guard, the embedding's and the loss's, need the CUDA
    runtime); its parts can, each as the runtime calls it."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

    from launcher.runtime.gradclip import clip_grad_norm
    from launcher.runtime.models.llama import Attention, FeedForward, RMSNorm, rope_tables

    shape = catalog.PRESETS["micro"]
    with torch.device("meta"):
        parts = {
            dtype: [m.to(dtype) for m in (Attention(shape), FeedForward(shape), RMSNorm(shape.hidden))]
            for dtype in (torch.float32, torch.bfloat16)
        }  # fp32 GQA takes the expanded k/v path
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        cos, sin = rope_tables(shape.hidden // shape.heads, 32, shape.rope_theta, device="cuda")
        for dtype, modules in parts.items():
            for m in modules:
                m.to_empty(device="cuda")
            attention, ffn, norm = modules
            x = torch.empty(2, 32, shape.hidden, device="cuda", dtype=dtype)
            assert ffn(norm(attention(x, cos, sin))).device.type == "cuda"
        cpu_tables = rope_tables(shape.hidden // shape.heads, 32, shape.rope_theta, device="cpu")
        with pytest.raises(FakeTensorDeviceMismatchError):
            parts[torch.float32][0](torch.empty(2, 32, shape.hidden, device="cuda"), *cpu_tables)
        grads = [torch.nn.Parameter(torch.empty(4, 4, device="cuda")) for _ in range(2)]
        for p in grads:
            p.grad = torch.empty(4, 4, device="cuda")
        assert clip_grad_norm(grads, 1.0).device.type == "cuda"
        # a pipeline stage whose parameters got no gradient still reports (and sums) its norm on the GPU
        assert clip_grad_norm([torch.nn.Parameter(torch.empty(4, device="cuda"))], 1.0).device.type == "cuda"


LINT_FACTORIES = {
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "eye",
    "as_tensor",
    "empty_strided",
}


def test_runtime_tensor_factories_name_their_device():
    """A tensor factory without `device=` makes a host tensor, which on a GPU either crashes the first op that
    meets a CUDA tensor or quietly moves work to the CPU. Every one in launcher/runtime says where (a module's
    __init__ builds under its caller's device context, and is exempt)."""
    found = []
    for path in sorted((REPO / "launcher" / "runtime").rglob("*.py")):
        tree = ast.parse(path.read_text())
        inits = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef) and f.name == "__init__"
            for n in ast.walk(f)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LINT_FACTORIES
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)
                and id(node) not in inits
            ):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: torch.{node.func.attr}(...) without device=")
    assert not found, "\n".join(found)


# ----------------------------------------------------------------------------- 7, 23: one GPU per rank


def test_7_23_each_rank_gets_a_gpu_of_its_own_or_a_preflight_error():
    from launcher.runtime.dist import gpu_index

    assert [gpu_index(r, 8, 8, None) for r in range(8)] == list(range(8))  # torchrun: every rank sees the node
    assert gpu_index(5, 8, 1, "5") == 0  # srun --gpus-per-task: each task sees its own
    with pytest.raises(PreflightError, match="9 ranks on this node but torch sees 8 GPU"):
        gpu_index(8, 9, 8, None)  # two ranks would share a GPU ("Duplicate GPU detected")
    with pytest.raises(PreflightError, match="sees 1 GPU"):
        gpu_index(1, 8, 1, None)  # one GPU visible to all 8 ranks


def test_7_a_gpu_recipe_on_a_machine_without_cuda_is_a_preflight_error(monkeypatch):
    """The recipe decides GPU or CPU, never whatever this process happens to see: a node with a broken driver must
    not join an NCCL world as a gloo rank (it would hang for init_timeout, then fail misleadingly)."""
    from launcher.runtime.dist import init_distributed

    rec, plan = _plan(resources={"accelerator": "H100:8"})
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SKYPILOT_NODE_RANK"):
        monkeypatch.delenv(k, raising=False)
    env: dict[str, str] = {}
    with pytest.raises(PreflightError, match="CPU-only build"):
        init_distributed(rec, plan, env=env, verbose=False)
    assert not dist.is_initialized()


def _node_check_of_a_gpu_plan(tmp_path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`launcher.runtime.train --check` of an 8-GPU plan, as each node runs it before torchrun."""
    from rt_harness import write_plan

    plan = write_plan(tmp_path, recipe_dict(resources={"accelerator": "H100:8"}))
    return subprocess.run(
        [sys.executable, "-m", "launcher.runtime.train", "--plan", str(plan), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_7_the_node_check_before_torchrun_says_preflight_for_a_gpu_plan_here(tmp_path):
    """`launcher.runtime.train --check` (each node, before torchrun) exits 44, so the node can be excluded."""
    p = _node_check_of_a_gpu_plan(tmp_path)
    assert p.returncode == jobenv.ExitCode.PREFLIGHT, p.stdout + p.stderr
    assert "CPU-only build" in p.stderr


SMI_OK = "0, NVIDIA H100 80GB HBM3, 0, No, No, No, Not Active\n1, NVIDIA H100 80GB HBM3, 0, No, No, No, Active\n"
SMI_BAD = "0, NVIDIA H100 80GB HBM3, 0, No, No, No, Not Active\n1, NVIDIA H100 80GB HBM3, 2, No, Yes, No, Not Active\n"


def test_7_gpu_health_reads_ecc_remaps_and_xids_as_a_sites_prolog_would():
    from launcher.runtime.nodecheck import gpu_health

    assert gpu_health(SMI_OK) == (
        [],
        ["GPU 1 (NVIDIA H100 80GB HBM3): its clocks are slowed by the hardware (thermal or power brake)"],
    )
    failures, _ = gpu_health(SMI_BAD)
    assert failures == [
        "GPU 1 (NVIDIA H100 80GB HBM3): 2 uncorrected ECC error(s) since the driver loaded",
        "GPU 1 (NVIDIA H100 80GB HBM3): a row remap pending (the GPU needs a reset)",
    ]
    log = (
        "[  12.3] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, Graphics Exception\n[99.1] NVRM: Xid (PCI:0000:5d:00): 79, ..."
    )
    assert gpu_health(SMI_OK.replace("Active\n", "Not Active\n"), log)[0] == [
        "Xid 79 on PCI:0000:5d:00 in the kernel log (the GPU needs a reset or replacing)"
    ]  # 13 (a program's own graphics exception) is not the node's fault
    assert gpu_health("0, NVIDIA A10G, [N/A], [N/A], [N/A], [N/A], [Not Supported]\n") == ([], [])


def test_7_the_node_check_fails_a_node_whose_gpu_reports_errors(tmp_path):
    """A mock nvidia-smi and dmesg (no GPU here), first on PATH: the node check runs the real query and fails the
    node with 44, naming the GPU and the error, before it looks for CUDA."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text(f"#!/bin/sh\ncase \"$*\" in *--query-gpu=*) printf '{SMI_BAD}' ;; esac\n")
    (bin_ / "dmesg").write_text("#!/bin/sh\necho 'NVRM: Xid (PCI:0000:3b:00): 48, pid=7, DBE'\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    p = _node_check_of_a_gpu_plan(
        tmp_path, {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURMD_NODENAME": "gpu07"}
    )
    assert p.returncode == jobenv.ExitCode.PREFLIGHT, p.stdout + p.stderr
    assert "node gpu07 cannot run the plan: GPU 1 (NVIDIA H100 80GB HBM3): 2 uncorrected ECC error(s)" in p.stderr
    assert "Xid 48 on PCI:0000:3b:00" in p.stderr and "CPU-only build" not in p.stderr


# ----------------------------------------------------------------------------- 8: DeepSpeed offload optimizers


def _ds_world(monkeypatch):
    for k, v in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999"
    ).items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


DS_OFFLOAD = """
import sys, torch, torch.distributed as dist, yaml
from launcher import catalog
from launcher.runtime.engines.deepspeed import import_deepspeed
from launcher.plan.deepspeed import deepspeed_config
from launcher.plan import make_plan
from launcher.recipe import load_text
from launcher.runtime.models.llama import build_model
from launcher.runtime.optim import build_optimizer
deepspeed = import_deepspeed(is_gpu=False)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for name, optimizer, client in (("sgd", "sgd", False), ("client", "adamw", True)):
    recipe = yaml.safe_load(sys.argv[1])
    recipe["training"]["optimizer"] = optimizer
    rec = load_text(yaml.safe_dump(recipe), "<test>")
    cfg = deepspeed_config(rec, make_plan(rec), dp=1, grad_accum=4, is_gpu=True, client_optimizer=client)
    model = build_model(catalog.PRESETS["micro"])
    opt = build_optimizer(model, rec.training) if not client else torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    assert engine.zero_cpu_offload(), name
    print("accepted", name, flush=True)
"""


def test_8_zero_offload_accepts_a_torch_optimizer_on_a_gpu_config(tmp_path):
    """The GPU config (is_gpu=True) with optimizer offload and an optimizer other than DeepSpeed's CPU Adam (SGD,
    or a user's own through job.wrap): DeepSpeed's own config class and engine accept it (the engine raised
    "ZeRO-Offload with a client optimizer" at start-up on every GPU node). DeepSpeed keeps its communication
    state per process: a process of its own. Its comm on the CPU accelerator compiles nothing: left to itself it
    JIT-builds its shared-memory all-reduce into TORCH_EXTENSIONS_DIR (minutes on a busy host, where this test
    once timed out)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from launcher.plan.deepspeed import deepspeed_config
    from rt_harness import torchrun_env

    recipe = recipe_dict(parallelism={"strategy": "zero2", "offload": "optimizer"})
    rec, plan = _plan(**{k: recipe[k] for k in ("parallelism",)}, training={"optimizer": "sgd"})
    assert (
        DeepSpeedConfig(deepspeed_config(rec, plan, dp=1, grad_accum=4, is_gpu=True)).zero_force_ds_cpu_optimizer
        is False
    )
    rec, plan = _plan(parallelism=recipe["parallelism"])  # AdamW on a GPU: DeepSpeed's CPU Adam, left forced
    assert "zero_force_ds_cpu_optimizer" not in deepspeed_config(rec, plan, is_gpu=True)
    env = torchrun_env(
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    )
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "extensions")
    p = subprocess.run(
        [sys.executable, "-c", DS_OFFLOAD, yaml.safe_dump(recipe)], capture_output=True, text=True, env=env, timeout=300
    )
    assert p.returncode == 0 and "accepted sgd" in p.stdout and "accepted client" in p.stdout, p.stdout + p.stderr
    built = [str(f.relative_to(tmp_path)) for f in tmp_path.rglob("*")]
    assert not built, built


# ----------------------------------------------------------------------------- 9: RNG of this device only


def test_9_cuda_rng_is_saved_for_this_device_and_restored_with_fewer_visible(monkeypatch):
    """Mocks of torch.cuda (no GPU here): a state saved by a rank that saw 8 GPUs (every device's state, as
    dtlaunch once saved it) and one saved now (its own device's) both restore on a process that sees 1 GPU."""
    from launcher.runtime.checkpoint import state as st

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("saves every device's state"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": seen.setdefault("set", s))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: pytest.fail("restores every device's state"))
    saved = st.rng_state()
    assert torch.equal(saved["cuda"], torch.tensor([7], dtype=torch.uint8))
    st.set_rng_state(saved)
    assert torch.equal(seen.pop("set"), torch.tensor([7], dtype=torch.uint8))
    old = dict(saved, cuda=[torch.tensor([i], dtype=torch.uint8) for i in range(8)])
    st.set_rng_state(old)
    assert torch.equal(seen["set"], torch.tensor([0], dtype=torch.uint8))


# ----------------------------------------------------------------------------- 13, 18: the GPU job's environment


def test_13_18_gpu_jobs_set_expandable_segments_and_deterministic_nccl():
    env = jobenv.job_environment({}, is_gpu=True, deterministic=True)
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert env["NCCL_ALGO"] == "Ring" and env["NCCL_PROTO"] == "Simple"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_COLLNET_ENABLE"] == "0"
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "NCCL_ALGO" not in jobenv.job_environment({}, is_gpu=True)  # only when asked: it costs bandwidth
    assert "PYTORCH_ALLOC_CONF" not in jobenv.job_environment({}, is_gpu=False)
    from launcher.render import render

    rec, plan = _plan(
        resources={"accelerator": "H100:8"},
        training={"deterministic": True},
        targets={"default": "slurm", "slurm": {"partition": "gpu"}},
    )
    script = render(rec, plan, "slurm").files["job.sbatch"]
    for k in ("PYTORCH_ALLOC_CONF", "NCCL_ALGO", "NCCL_NVLS_ENABLE", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"):
        assert k in script, k


def test_13_deterministic_mode_does_not_fill_every_new_tensor():
    import torch.utils.deterministic

    from launcher.runtime.dist import enable_determinism

    before = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    try:
        enable_determinism()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.utils.deterministic.fill_uninitialized_memory is False
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.utils.deterministic.fill_uninitialized_memory = before[1]


# ----------------------------------------------------------------------------- 14: what a GPU user watches


def test_14_mfu_uses_the_dense_peak_of_the_exact_device_and_refuses_above_100_percent():
    from launcher.runtime.metrics import MFUError, mfu

    peaks = catalog.DEVICE_PEAK_TFLOPS
    assert peaks["NVIDIA H100 80GB HBM3"] == 989  # SXM dense, not the 1,979 sparse headline
    for device, sku in (
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA B200", "B200"),
    ):
        assert peaks[device] == catalog.ACCELERATORS[sku].peak_tflops, device  # the planner's figure, one fact
    assert peaks["NVIDIA H100 PCIe"] < peaks["NVIDIA H100 80GB HBM3"]
    per_token = 6 * 8e9  # an 8B model
    assert mfu(10_000, 8, per_token, 989) == pytest.approx(10_000 * per_token / (8 * 989e12))
    assert mfu(10_000, 8, per_token, None) is None  # a CPU or an unknown GPU: no number rather than a wrong one
    with pytest.raises(MFUError, match="above 100%"):
        mfu(300_000, 8, per_token, 989)


def test_14_a_small_models_mfu_is_logged_as_a_figure_not_zero(tmp_path):
    """A tiny model on an H200 ran at an MFU of a few millionths; four decimals logged it as 0.0."""
    import json

    from launcher.runtime.metrics import Metrics

    m = Metrics(tmp_path, enabled=True, total_steps=2, is_gpu=True)
    m.step(1, loss=1.0, lr=1e-3, tokens_per_s=9e4, step_time=0.01, grad_norm=1.0, mfu=3.4567e-6)
    m.step(2, loss=1.0, lr=1e-3, tokens_per_s=9e4, step_time=0.01, grad_norm=1.0, mfu=0.412345)
    logged = [json.loads(line)["mfu"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [3.46e-6, 0.412]


def test_14_memory_is_the_maximum_over_ranks_with_the_rank_that_holds_it():
    from launcher.runtime.metrics import RankFigures

    rows = [
        {"active_peak_mb": 10.0, "reserved_peak_mb": 12.0, "alloc_retries": 0, "ooms": 0, "host_rss_mb": 900.0},
        {"active_peak_mb": 30.0, "reserved_peak_mb": 31.0, "alloc_retries": 2, "ooms": 0, "host_rss_mb": 700.0},
        {"active_peak_mb": 20.0, "reserved_peak_mb": 40.0, "alloc_retries": 1, "ooms": 1, "host_rss_mb": 800.0},
    ]
    gpu = RankFigures.of(rows, is_gpu=True)
    assert gpu.values == {
        "active_peak_mb": 30.0,
        "reserved_peak_mb": 40.0,
        "alloc_retries": 2,
        "ooms": 1,
        "host_rss_mb": 900.0,
    }
    assert gpu.peak_rank == 2  # the largest reserved peak, not rank 0
    cpu = RankFigures.of(
        [dict(r, active_peak_mb=None, reserved_peak_mb=None, alloc_retries=None, ooms=None) for r in rows], is_gpu=False
    )
    assert cpu.values["active_peak_mb"] is None and cpu.peak_rank == 0  # the largest RSS


# ----------------------------------------------------------------------------- 15: exit codes on a GPU


def test_15_oom_is_config_and_gpu_hardware_faults_are_preflight():
    from launcher.runtime.status import classify

    code, msg = classify(
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        7,
        memory_note="the plan expected 61.2 GB per GPU at its peak (layer backward)",
    )
    assert code == jobenv.ExitCode.CONFIG and "during step 7" in msg and "61.2 GB" in msg and "micro_batch" in msg
    for text in (
        "CUDA error: uncorrectable ECC error encountered",
        "CUDA error: unspecified launch failure",
        "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus",
    ):
        code, msg = classify(RuntimeError(text), 3)
        assert code == jobenv.ExitCode.PREFLIGHT and "exclude this node" in msg, text
    code, _ = classify(RuntimeError("CUDA error: an illegal memory access was encountered"), 3)
    assert code == jobenv.ExitCode.FAILED  # a software bug: retried like any crash


def test_11_an_aborted_communicator_is_a_hang():
    from launcher.runtime.status import Timeouts, classify

    # what timed out is a training group's NCCL collective (the checkpoint group is gloo): its setting is named
    timeouts = Timeouts(None, "the checkpoint group's ...", "training.timeout_seconds=600")
    code, msg = classify(dist.DistBackendError("NCCL communicator was aborted on rank 3."), 12, timeouts)
    assert code == jobenv.ExitCode.HANG and "watchdog aborted" in msg and "during step 12" in msg
    assert "(training.timeout_seconds=600)" in msg and "checkpoint group" not in msg


# ----------------------------------------------------------------------------- 17, 20: optimizer and staging


def test_17_adamw_is_fused_on_gpu_jobs(monkeypatch):
    """On a GPU job (offloaded states included) AdamW runs fused, one kernel for all parameters; on CPU-only
    jobs torch's default. (The fused kernel exists on both devices; here it runs on CPU tensors.)"""
    from launcher.plan.layout import Layout
    from launcher.runtime.engines import TorchEngine

    rec, _ = _plan()
    lay = Layout("ddp", dp=1, precision="fp32")
    gpu = TorchEngine(build_model(catalog.PRESETS["micro"]), lay, rec.training, 10, torch.device("cpu"), is_gpu=True)
    cpu = TorchEngine(build_model(catalog.PRESETS["micro"]), lay, rec.training, 10, torch.device("cpu"), is_gpu=False)
    assert gpu.optimizer.defaults["fused"] is True
    assert not cpu.optimizer.defaults.get("fused")


def test_17_fp16_fsdp_steps_after_clipping_with_the_sharded_scaler():
    """FSDP2 in fp16 scales the loss with ShardedGradScaler; clipping unscales first, which leaves a found-inf
    flag shaped [1], and torch's fused AdamW then fails its step ("output with shape [] doesn't match the
    broadcast shape [1]", first seen on an H200). The engine's choice for a GPU job, run here on CPU tensors
    (the fused kernel exists on both): the step goes through, and DDP's plain scaler keeps the fused kernel."""
    from launcher.runtime.engines.mesh import backward, fused_adamw, make_scaler, optimizer_step
    from launcher.runtime.optim import build_optimizer

    rec, _ = _plan()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for fsdp in (True, False):
            model = torch.nn.Linear(8, 8)
            scaler = make_scaler(torch.device("cpu"), fsdp=fsdp)
            opt = build_optimizer(model, rec.training, fused=fused_adamw(True, scaler))
            assert bool(opt.defaults.get("fused")) is not fsdp
            backward(model(torch.randn(4, 8)).square().mean(), 1, scaler)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            before = model.weight.detach().clone()
            assert int(optimizer_step(opt, scaler)) == 0
            assert not torch.equal(model.weight, before)
    finally:
        dist.destroy_process_group()


def test_20_async_staging_copies_without_blocking_into_pinned_memory_on_a_gpu():
    """The stager a GPU job uses pins its host copy and copies without blocking, with one synchronize at the end
    (it waited for every tensor in turn); a CPU job's copies are plain."""
    from launcher.runtime.checkpoint.checkpointer import staging_options

    gpu, cpu = staging_options(gpu=True), staging_options(gpu=False)
    assert gpu.use_pinned_memory and gpu.use_non_blocking_copy and not gpu.use_async_staging
    assert not cpu.use_pinned_memory and not cpu.use_non_blocking_copy


# ----------------------------------------------------------------------------- 19: host syncs per step


def host_side(stack) -> bool:
    """Reads of values that live on the host on a GPU too, which cost no device sync: the data set's token
    windows (read from a host file or array) and the optimizer's step counters (kept on the CPU by torch's
    AdamW unless capturable)."""
    return any(f.filename.endswith(("launcher/runtime/data.py", "torch/optim/optimizer.py")) for f in stack)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_19_an_ordinary_step_never_waits_for_the_device(strategy, tmp_path, monkeypatch):
    """A real single-rank run, driven step by step: every host read of a device value (`float()`, `.item()`,
    `bool()`: aten._local_scalar_dense; and the loop's own deliberate read, `agreement.host_values`) is counted
    per step. Ordinary steps read nothing (the step agreement travels as host numbers over gloo); a log step
    reads its loss and counts once, its gradient norm once."""
    import os
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from launcher.runtime import agreement
    from launcher.runtime.loop import Trainer

    saved_env = dict(os.environ)  # a world of one sets RANK, WORLD_SIZE, ... in this process
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SKYPILOT_NODE_RANK"):
        os.environ.pop(k, None)
    reads = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and not host_side(traceback.extract_stack()):
                reads.append("scalar")
            return func(*args, **(kwargs or {}))

    real = agreement.host_values
    monkeypatch.setattr(agreement, "host_values", lambda t: reads.append("values") or real(t))
    rec, plan = _plan(
        parallelism={"strategy": strategy},
        resources={"accelerator": "cpu:1"},
        training={"steps": 8, "log_every": 4, "preflight": False},
        checkpoint={"every": 100, "export": "none"},
    )
    trainer = Trainer(rec, plan, tmp_path)
    per_step = {}
    steps = trainer.steps()
    try:
        while True:
            reads.clear()
            with Count():
                step = next(steps)
            per_step[step] = list(reads)
    except StopIteration:
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)
    assert sorted(per_step) == list(range(1, 9))
    for step in (2, 3, 5, 6, 7):
        assert per_step[step] == [], (step, per_step[step])
    assert per_step[4] == ["values", "scalar"], per_step[4]  # the loss and non-finite counts; the grad norm


# ----------------------------------------------------------------------------- 22: data workers


def test_22_data_workers_with_pinned_memory_read_what_the_main_process_reads(tmp_path):
    """The GPU data path (is_gpu=True: worker processes from a fork server, persistent across epochs and seeks,
    pinned batches when CUDA is there) yields the same tokens as the CPU path's main-process loading."""
    from launcher.runtime.data import DataPosition, build_dataloader

    rec, _ = _plan(training={"data": {"source": "synthetic", "num_tokens": 4000, "workers": 2}})
    kw = dict(
        vocab=512, seq_len=16, micro_batch=2, grad_accum=2, rank=0, world_size=1, seed=5, device=torch.device("cpu")
    )
    gpu = build_dataloader(rec.training.data, is_gpu=True, **kw)
    cpu = build_dataloader(rec.training.data, is_gpu=False, **kw)
    assert gpu.loader.num_workers == 2 and gpu.loader.persistent_workers and cpu.loader.num_workers == 0
    steps = gpu.steps_per_epoch + 3  # across an epoch boundary
    for _ in range(steps):
        for (xa, ya), (xb, yb) in zip(gpu.next_step(), cpu.next_step(), strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    workers = [w.pid for w in gpu.loader._iterator._workers]
    for b in (gpu, cpu):
        b.seek(DataPosition(0, 2, b.position.global_batch))
    for _ in range(3):
        for (xa, _), (xb, _) in zip(gpu.next_step(), cpu.next_step(), strict=True):
            assert torch.equal(xa, xb)
    assert [w.pid for w in gpu.loader._iterator._workers] == workers  # the same processes, not re-forked


def test_host_values_is_a_plain_read():
    from launcher.runtime.agreement import host_values

    assert host_values(torch.tensor([1.5, 2.0])) == [1.5, 2.0] and not math.isnan(host_values(torch.ones(1))[0])


# ----------------------------------------------------------------------------- the shipped recipes at full size


@pytest.mark.parametrize(
    "recipe,ranks",
    [("llama70b.yaml", (0, 1, 31, 63)), ("llama3-405b.yaml", (0, 7, 8, 77, 127)), ("llama3-8b.yaml", (0, 3))],
)
def test_the_mesh_at_full_size_puts_each_rank_where_its_data_says(recipe, ranks):
    """At the shipped recipes' real world sizes (64, 128 ranks: a fake process group, this process being each rank
    in turn), the DeviceMesh torch builds puts every rank at the coordinates the runtime reads its data by
    (`Layout.coords`): a rank that torch places in another tensor-parallel group than the data loader
    assumes would train on another group's batch."""
    from launcher.recipe import load
    from launcher.runtime.engines.mesh import build_mesh, dp_dims
    from testpaths import RECIPES

    rec = load(RECIPES / recipe)
    plan = make_plan(rec)
    layout, _ = plan.layout.for_world(plan.world_size)
    _, shard = dp_dims(layout)
    for r in ranks:
        with fake_world(plan.world_size, "fake", rank=r):
            mesh = build_mesh(layout, torch.device("cpu"))
            pp, rep, sh, tp = mesh.get_coordinate()
        assert (pp, rep * shard + sh, tp) == layout.coords(r), (recipe, r)


def test_collectives_per_step_of_the_70b_recipe_at_64_ranks():
    """The 70B recipe's step traced at its 64 ranks (fake tensors and process group, `dtlaunch plan --trace`'s
    machinery) at 2 and at 3 layers: one more FSDP2 unit adds, per micro-step, one all-gather in forward, one in
    backward (its weights were freed after forward: reshard_after_forward) and one reduce-scatter of its
    gradients (on every micro-step, or only on the step's last when the plan reduces once per step); the
    clipping's all-reduce does not grow with depth."""
    from launcher.recipe import load
    from launcher.trace.fake import fake_world as trace_world
    from launcher.trace.fake import trace_step
    from testpaths import RECIPES

    rec = load(RECIPES / "llama70b.yaml")
    plan = make_plan(rec)
    lay = plan.layout
    assert lay.strategy == "fsdp" and plan.world_size == 64 and lay.grad_accum >= 2
    by_depth = {}
    for layers in (2, 3):
        with trace_world(plan.world_size):
            by_depth[layers] = trace_step(rec, plan, layers=layers).collectives
    # the tracker counts the second step by phase: a micro-step before the last, the last, the optimizer step
    grow = {k: by_depth[3].get(k, 0) - by_depth[2].get(k, 0) for k in by_depth[2].keys() | by_depth[3].keys()}
    reduces = 1 if lay.grad_reduce == "every_micro_batch" else 0
    assert (
        {k: v for k, v in grow.items() if v}
        == {
            "micro-step|all-gather|64": 2,
            "micro-step|reduce-scatter|64": 1,
            "last micro-step|all-gather|64": 2,
            "last micro-step|reduce-scatter|64": 1,
        }
        if reduces
        else {
            "micro-step|all-gather|64": 2,
            "last micro-step|all-gather|64": 2,
            "last micro-step|reduce-scatter|64": 1,
        }
    ), by_depth
    assert by_depth[2]["optimizer step|all-reduce|64"] == 1  # the clipping's norm, whatever the depth


# ----------------------------------------------------------------------------- 5, 6: the streamed export


def test_5_6_the_export_is_written_in_place_one_tensor_at_a_time(tmp_path):
    """safetensors' own reader takes a file written tensor by tensor, in any order, from a header computed before
    any tensor exists (so no rank ever holds the whole model, a clone of it and its bytes at once); the file
    appears only when complete, and an interrupted export leaves nothing."""
    from safetensors import safe_open

    from launcher.runtime.checkpoint.export import SafetensorsWriter

    g = torch.Generator().manual_seed(0)
    tensors = {
        "b.weight": torch.randn(3, 5, generator=g),
        "a.weight": torch.randn(7, generator=g),
        "c.bias": torch.randn(2, 2, 2, generator=g),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "model.safetensors"
    w = SafetensorsWriter(path, {k: tuple(v.shape) for k, v in tensors.items()}, {"format": "pt"})
    for name in ("c.bias", "empty", "a.weight"):  # not the file's order
        w.write(name, tensors[name].to(torch.bfloat16).float())  # any dtype in, fp32 out
        assert not path.exists()
    w.write("b.weight", tensors["b.weight"])
    assert w.close() == path and not list(tmp_path.glob("*.partial"))
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == sorted(tensors) and f.metadata() == {"format": "pt"}
        for k, v in tensors.items():
            want = v if k == "b.weight" else v.to(torch.bfloat16).float()
            assert torch.equal(f.get_tensor(k), want), k
    w = SafetensorsWriter(tmp_path / "x.safetensors", {"a": (2,)}, {})
    with pytest.raises(RuntimeError, match="never written"):
        w.close()
    w.abort()
    assert not list(tmp_path.glob("x.safetensors*"))


def test_deepspeed_is_told_the_jobs_device_rather_than_left_to_guess(monkeypatch):
    """Left to guess, DeepSpeed warns on every rank of a CPU job that it found no GPU; the runtime names the
    job's device first (a DS_ACCELERATOR the user set still wins)."""
    import os

    from launcher.runtime.engines.deepspeed import name_the_accelerator

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    probe = "import deepspeed; from deepspeed.accelerator import get_accelerator; print('accelerator', get_accelerator()._name)"
    named = "from launcher.runtime.engines.deepspeed import name_the_accelerator; name_the_accelerator(False); "
    told = subprocess.run([sys.executable, "-c", named + probe], capture_output=True, text=True, env=env, timeout=120)
    guessed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert "accelerator cpu" in told.stdout, told.stdout + told.stderr
    assert "Setting accelerator to CPU" not in told.stdout + told.stderr
    assert "Setting accelerator to CPU" in guessed.stdout + guessed.stderr  # what the runtime spares its users
    # A value the user set wins over the job's device, either way round (the variable is what DeepSpeed reads, as
    # `told` shows); unset, a GPU job names cuda.
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    name_the_accelerator(False)
    assert os.environ["DS_ACCELERATOR"] == "cuda"
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    name_the_accelerator(True)
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.delenv("DS_ACCELERATOR")
    name_the_accelerator(True)
    assert os.environ["DS_ACCELERATOR"] == "cuda"
