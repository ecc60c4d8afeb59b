"""Single-process tests of the runtime's pure parts: model size, DeepSpeed config, checkpoint
selection, data order, fault parsing, environment detection."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec.structs
import pytest
import torch
import yaml

from launcher import catalog
from launcher.jobenv import ExitCode
from launcher.plan import make_plan
from launcher.plan.params import count_params
from launcher.recipe import load_text
from launcher.runtime.checkpoint import disk
from launcher.runtime.data import DataPosition, GlobalOrderSampler, SyntheticTokens, TokenDataset, rescale_position
from launcher.runtime.dist import detect, first_slurm_host, job_environment
from launcher.runtime.failures import ConfigError
from launcher.runtime.inject import Faults, parse
from launcher.runtime.models import build_model
from rt_harness import recipe_dict

# ----------------------------------------------------------------------------- model


@pytest.mark.parametrize("preset", sorted(catalog.PRESETS))
def test_param_count_matches_planner_on_meta(preset):
    shape = catalog.PRESETS[preset]
    model = build_model(shape, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == count_params(shape)


def test_tied_embeddings_count_once():
    shape = catalog.ModelShape(2, 64, 176, 4, 2, 256, tied_embeddings=True, seq_len=32)
    model = build_model(shape, device="meta")
    assert sum(p.numel() for p in model.parameters()) == count_params(shape)


@pytest.mark.parametrize(
    "preset,tied,model_parallel,apart",
    [
        ("tiny", False, False, False),  # a 512 x 128 table is smaller than a block: both tables in the root
        ("tiny", False, True, True),  # a pipeline stage holds only one of them
        ("tiny", True, False, False),  # tied: one weight, in the root
        ("llama3-8b", False, False, True),  # 128K x 4096 is larger than a block: units of their own
        ("llama3-8b", True, False, False),
    ],
)
def test_fsdp_units_are_the_ones_the_planner_counts(preset, tied, model_parallel, apart):
    """One rule for both: the runtime's FSDP2 units on the real model hold exactly the parameters the planner's
    units say (the embedding and the head apart, or in the root with the final norm)."""
    from launcher.plan.layout import Layout
    from launcher.plan.moments import units
    from launcher.runtime.engines import fsdp_units

    shape = msgspec.structs.replace(catalog.PRESETS[preset], tied_embeddings=tied, layers=2)
    model = build_model(shape, device="meta")
    got = fsdp_units(model, model_parallel=model_parallel)

    def size(m, nested):
        return sum(p.numel() for p in m.parameters()) - sum(p.numel() for u in nested for p in u.parameters())

    lay = Layout("fsdp", dp=2, pp=2 if model_parallel else 1)
    planned = units(shape, "llama", count_params(shape), lay)
    root = got[-1]
    assert size(root, got[:-1]) == pytest.approx(planned.root)
    assert (model.tok_embeddings in got) == apart and (model.output in got) == apart
    if apart:
        assert planned.emb == planned.head == shape.vocab * shape.hidden
    else:
        assert planned.emb == planned.head == 0


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_activation_checkpointing_gives_identical_gradients(ac):
    """Recomputation must change memory, never results."""
    shape = catalog.PRESETS["micro"]
    torch.manual_seed(0)
    ref = build_model(shape, "none")
    torch.manual_seed(0)
    ckp = build_model(shape, ac)
    x = torch.randint(0, shape.vocab, (2, 32))
    for m in (ref, ckp):
        m(x).float().pow(2).mean().backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), ckp.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n


def test_meta_model_materialises_like_a_real_one():
    shape = catalog.PRESETS["micro"]
    torch.manual_seed(3)
    real = build_model(shape)
    torch.manual_seed(3)
    meta = build_model(shape, device="meta")
    meta.to_empty(device="cpu")
    meta.init_weights()
    x = torch.randint(0, shape.vocab, (1, 16))
    assert torch.equal(real(x), meta(x))


def test_causal_attention_does_not_look_ahead():
    shape = catalog.PRESETS["micro"]
    torch.manual_seed(0)
    m = build_model(shape).eval()
    x = torch.randint(0, shape.vocab, (1, 20))
    y = x.clone()
    y[0, 15:] = (y[0, 15:] + 1) % shape.vocab
    with torch.no_grad():
        assert torch.allclose(m(x)[0, :15], m(y)[0, :15], atol=1e-6)


# ----------------------------------------------------------------------------- DeepSpeed config


def _plan_for(**over):
    rec = load_text(yaml.safe_dump(recipe_dict(**over)))
    return rec, make_plan(rec)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_deepspeed_config_is_accepted_by_deepspeed(strategy, precision):
    import deepspeed  # noqa: F401 - part of the test environment: missing must fail, not skip
    from deepspeed.runtime.config import DeepSpeedConfig

    from launcher.plan.buckets import DS_ALLGATHER_BUCKET, DS_REDUCE_BUCKET
    from launcher.plan.deepspeed import deepspeed_config

    rec, plan = _plan_for(parallelism={"strategy": strategy, "precision": precision})
    assert deepspeed_config(rec, plan)["train_batch_size"] == 16 and plan.layout.dp == 2
    # The parser checks train_batch = micro * accumulation * world, and outside a process group its
    # world is 1: parse the config the runtime would build on one rank (the 2-rank one is parsed by
    # deepspeed.initialize in the multi-process tests).
    cfg = deepspeed_config(rec, plan, dp=1, grad_accum=4)
    parsed = DeepSpeedConfig(cfg)  # the same parser deepspeed.initialize uses; raises on a bad config
    assert parsed.zero_optimization_stage == int(strategy[-1])
    assert parsed.train_batch_size == 16
    assert parsed.train_micro_batch_size_per_gpu == 4 and parsed.gradient_accumulation_steps == 4
    assert parsed.gradient_clipping == rec.training.grad_clip
    assert parsed.bfloat16_config.enabled == (precision == "bf16")
    assert parsed.float16_config.enabled == (precision == "fp16")
    if precision == "fp16":
        assert parsed.float16_config.loss_scale == 0  # dynamic
    zc = parsed.zero_config
    assert zc.reduce_bucket_size == DS_REDUCE_BUCKET and zc.allgather_bucket_size == DS_ALLGATHER_BUCKET


def test_deepspeed_config_offload_and_static_loss_scale():
    import deepspeed  # noqa: F401 - part of the test environment
    from deepspeed.runtime.config import DeepSpeedConfig

    from launcher.plan.deepspeed import deepspeed_config

    rec, plan = _plan_for(
        parallelism={"strategy": "zero3", "precision": "fp16", "offload": "params", "loss_scaling": "none"}
    )
    parsed = DeepSpeedConfig(deepspeed_config(rec, plan, dp=1, grad_accum=4))
    assert parsed.zero_config.offload_optimizer.device == "cpu"
    assert parsed.zero_config.offload_param.device == "cpu"
    assert parsed.float16_config.loss_scale == 1.0
    assert parsed.train_batch_size == 16
    # CPU-only: torch's AdamW may hold the offloaded states (no DeepSpeedCPUAdam JIT build); GPU: DeepSpeed's.
    assert parsed.zero_force_ds_cpu_optimizer is False
    assert "zero_force_ds_cpu_optimizer" not in deepspeed_config(rec, plan, is_gpu=True)


def test_deepspeed_config_needs_no_torch():
    """render/ is pure: importing it must not pull in torch (the CLI and planner stay light)."""
    code = "import sys, launcher.plan.deepspeed; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ----------------------------------------------------------------------------- checkpoint directory protocol


def _fake_ckpt(root: Path, step: int, state: str, world: int = 2) -> Path:
    """state: complete (files, manifests, marker) | partial (files only, never committed)."""
    p = disk.step_path(root, step)
    p.mkdir(parents=True)
    for rank in range(world):
        (p / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * (10 + rank))
        (p / f"rng-{rank:05d}.pt").write_bytes(b"r" * 3)
    (p / ".metadata").write_bytes(b"m")
    if state == "complete":
        for rank in range(world):
            disk.write_manifest(p, rank)
        disk.commit(root, step, {"step": step, "world_size": world})
    return p


def test_only_committed_uncorrupted_checkpoints_are_selected(tmp_path):
    root = tmp_path / "ck"
    _fake_ckpt(root, 5, "complete")
    _fake_ckpt(root, 10, "complete")
    _fake_ckpt(root, 15, "partial")
    _fake_ckpt(root, 20, "complete")
    disk.mark_corrupt(disk.step_path(root, 20), "test")
    assert disk.complete_steps(root) == [5, 10]
    assert disk.corrupt_steps(root) == [20]
    assert disk.newest_step(root) == 10
    assert json.loads((root / "step-00000010" / "meta.json").read_text())["step"] == 10
    assert disk.newest_step(tmp_path / "missing") == 0


def test_each_rank_manifests_exactly_its_own_files(tmp_path):
    p = _fake_ckpt(tmp_path / "ck", 3, "complete")
    m0 = json.loads((p / "manifest-rank-00000.json").read_text())["files"]
    m1 = json.loads((p / "manifest-rank-00001.json").read_text())["files"]
    assert set(m0) == {"__0_0.distcp", "rng-00000.pt", ".metadata"} and set(m1) == {"__1_0.distcp", "rng-00001.pt"}
    assert m1["__1_0.distcp"]["size"] == 11
    assert disk.owner("zero_pp_rank_3_mp_rank_00_optim_states.pt") == 3  # DeepSpeed's per-rank files
    assert disk.owner("bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt") == 12
    assert disk.owner("mp_rank_00_model_states.pt") == 0 and disk.owner("trainer.pt") == 0


def test_verification_finds_truncation_changed_bytes_and_missing_manifests(tmp_path):
    root = tmp_path / "ck"
    p = _fake_ckpt(root, 4, "complete")
    files = sorted(disk.expected_files(p)[0])
    assert not disk.size_problems(p) and not disk.crc_problems(p, files)
    data = p / "__1_0.distcp"
    data.write_bytes(b"\x7f" * 11)  # same size, other bytes: only the checksum can tell
    assert not disk.size_problems(p)
    assert any("__1_0.distcp has changed" in x for x in disk.crc_problems(p, files))
    data.write_bytes(b"\x01" * 5)  # truncated
    assert disk.size_problems(p) == ["__1_0.distcp is 5 bytes, written as 11"]
    (p / "manifest-rank-00001.json").write_text("{")  # a manifest that does not parse: damage
    assert any("rank 1's manifest is unreadable" in x for x in disk.size_problems(p))


def test_a_read_that_keeps_failing_is_a_storage_error_not_damage(tmp_path, monkeypatch):
    """A file that cannot be read (EIO, ESTALE, or ENOENT on a network mount that lags behind the node that
    wrote it) is read again; still failing, the attempt ends with StorageError and nothing is marked."""
    from launcher.runtime.failures import StorageError

    monkeypatch.setattr(disk, "READ_RETRY_S", 0.0)
    p = _fake_ckpt(tmp_path / "ck", 4, "complete")
    files = sorted(disk.expected_files(p)[0])
    real, calls = disk.crc32_of, []

    def flaky(path):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        return real(path)

    monkeypatch.setattr(disk, "crc32_of", flaky)
    assert disk.crc_problems(p, files) == []  # retried
    (p / "manifest-rank-00001.json").unlink()
    with pytest.raises(StorageError, match=r"rank 1's manifest .*\(No such file or directory\), 4 tries"):
        disk.size_problems(p)
    assert not disk.is_corrupt(p)


def test_meta_json_and_the_marker_must_agree_with_the_directory(tmp_path):
    p = _fake_ckpt(tmp_path / "ck", 4, "complete")
    assert disk.meta_problems(p) == []
    meta = json.loads((p / "meta.json").read_text())
    (p / "meta.json").write_text(json.dumps({**meta, "step": 3}, indent=2, sort_keys=True) + "\n")
    problems = disk.meta_problems(p)
    assert any("meta.json has changed since it was committed" in x for x in problems)
    assert "meta.json says step 3, but the directory is step 4" in problems
    # A marker of an older version records no checksum: the step is still compared.
    (p / "COMPLETE").write_text(json.dumps({"step": 4, "time": 0}))
    assert disk.meta_problems(p) == ["meta.json says step 3, but the directory is step 4"]


def test_prune_keeps_the_newest_and_never_the_last_verified_one(tmp_path):
    root = tmp_path / "ck"
    for s in (2, 4, 6, 8):
        _fake_ckpt(root, s, "complete")
    _fake_ckpt(root, 3, "partial")  # a dead attempt older than the newest committed: garbage
    disk.prune(root, keep=2)
    assert disk.complete_steps(root) == [6, 8]
    assert not disk.step_path(root, 3).exists()
    # The newest two no longer check out (e.g. another node's files not visible yet): the newest verified one,
    # older than them, is kept although keep=2 would drop it.
    for s in (10, 12):
        p = _fake_ckpt(root, s, "complete")
        (p / "__0_0.distcp").write_bytes(b"")
    disk.prune(root, keep=2)
    assert disk.complete_steps(root) == [8, 10, 12]
    disk.mark_corrupt(disk.step_path(root, 8), "test")
    disk.prune(root, keep=1)
    assert disk.step_path(root, 8).exists(), "a corrupt checkpoint is kept for a person to look at"


def test_clean_partials_at_startup(tmp_path):
    root = tmp_path / "ck"
    _fake_ckpt(root, 4, "complete")
    _fake_ckpt(root, 8, "partial")
    (root / "step-00000012.tmp").mkdir()  # the rename-based protocol of dtlaunch 0.1
    removed = {p.name for p in disk.clean_partials(root)}
    assert removed == {"step-00000008", "step-00000012.tmp"}
    assert disk.complete_steps(root) == [4]


def test_checkpoint_dir_template(tmp_path):
    assert disk.expand_dir(None, tmp_path, None) == tmp_path / "checkpoints"
    assert disk.expand_dir("/ck/{run_id}/x", tmp_path, "r42") == Path("/ck/r42/x")
    with pytest.raises(ConfigError, match="DTLAUNCH_RUN_ID"):
        disk.expand_dir("/ck/{run_id}", tmp_path, None)


# ----------------------------------------------------------------------------- data order


def _global_batches(world: int, micro: int, global_batch: int, steps: int, epoch: int = 0, start: int = 0):
    ds = TokenDataset(SyntheticTokens(20000, 512, 0), 64, 512)
    out = []
    samplers = [GlobalOrderSampler(ds, world, r, global_batch, seed=3) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
        s.start_step = start
    streams = [list(iter(s)) for s in samplers]
    per_rank = global_batch // world
    for k in range(steps):
        out.append(sorted(i for st in streams for i in st[k * per_rank : (k + 1) * per_rank]))
    return out


def test_global_batches_do_not_depend_on_world_size():
    one = _global_batches(1, 4, 16, 5)
    two = _global_batches(2, 4, 16, 5)
    four = _global_batches(4, 2, 16, 5)
    assert one == two == four
    assert all(len(b) == 16 for b in one)


def test_resuming_mid_epoch_continues_with_the_next_batch():
    full = _global_batches(2, 4, 16, 6)
    resumed = _global_batches(1, 4, 16, 3, start=3)
    assert resumed == full[3:6]


def test_epochs_differ_and_repeat_with_the_seed():
    assert _global_batches(2, 4, 16, 2, epoch=0) != _global_batches(2, 4, 16, 2, epoch=1)
    assert _global_batches(2, 4, 16, 2, epoch=1) == _global_batches(2, 4, 16, 2, epoch=1)


def test_the_data_loader_leaves_the_global_generator_alone():
    """Starting an epoch and seeking (a resume mid-epoch) draw nothing from torch's global generator: an extra
    draw at a resume would shift every later random op (dropout) away from the uninterrupted run's."""
    from launcher.recipe.schema import DataSpec
    from launcher.runtime.data import build_dataloader

    batches = build_dataloader(
        DataSpec(source="synthetic", num_tokens=20_000),
        vocab=512,
        seq_len=32,
        micro_batch=2,
        grad_accum=2,
        rank=0,
        world_size=1,
        seed=1,
        device=torch.device("cpu"),
        is_gpu=False,
    )
    torch.manual_seed(5)
    before = torch.get_rng_state()
    batches.next_step()
    batches.seek(DataPosition(1, 3, 4))
    batches.next_step()
    assert torch.equal(torch.get_rng_state(), before)


def test_a_failed_durable_write_leaves_nothing_behind(tmp_path, monkeypatch):
    """A full disk while a small file (a manifest, the run's kept records) is written: the error reaches the
    caller, and neither the file nor its half-written temporary is left."""

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        disk.write_file_durably(tmp_path / "records.jsonl", b"x" * 100)
    assert list(tmp_path.iterdir()) == []


def test_position_rescaling():
    pos, warn = rescale_position(DataPosition(2, 6, 16).to_dict(), 16)
    assert (pos.epoch, pos.step_in_epoch, warn) == (2, 6, None)
    pos, warn = rescale_position(DataPosition(0, 6, 16).to_dict(), 32)
    assert pos.step_in_epoch == 3 and warn is None
    pos, warn = rescale_position(DataPosition(0, 5, 16).to_dict(), 32)
    assert pos.step_in_epoch == 2 and "trained on twice" in warn


def test_synthetic_data_is_deterministic_and_learnable():
    a, b = SyntheticTokens(5000, 512, 1), SyntheticTokens(5000, 512, 1)
    assert torch.equal(a.tokens, b.tokens)
    # A bigram chain: each token has at most 3 successors.
    t = a.tokens.long()
    succ = {}
    for x, y in zip(t[:-1].tolist(), t[1:].tolist(), strict=True):
        succ.setdefault(x, set()).add(y)
    assert max(len(s) for s in succ.values()) <= 3


def test_file_tokens_uint16_bin_npy_and_bytes(tmp_path):
    from launcher.runtime.data import FileTokens

    vals = torch.arange(1000, dtype=torch.int64) % 300
    (tmp_path / "t.bin").write_bytes(vals.to(torch.int16).numpy().astype("<u2").tobytes())
    ft = FileTokens(tmp_path / "t.bin", "uint16")
    assert len(ft) == 1000 and torch.equal(ft.window(10, 5), vals[10:15])
    import numpy as np  # installed with deepspeed

    np.save(tmp_path / "t.npy", vals.numpy().astype(np.uint32))
    fn = FileTokens(tmp_path / "t.npy", "uint16")  # the .npy header wins over the recipe's dtype
    assert len(fn) == 1000 and torch.equal(fn.window(990, 10), vals[990:])
    (tmp_path / "t.txt").write_bytes(b"hello world")
    fb = FileTokens(tmp_path / "t.txt", "bytes")
    assert fb.window(0, 5).tolist() == list(b"hello")
    with pytest.raises(ConfigError, match="not found"):
        FileTokens(tmp_path / "nope.bin", "uint16")


def test_out_of_vocab_tokens_are_a_config_error(tmp_path):
    from launcher.runtime.data import FileTokens

    (tmp_path / "t.txt").write_bytes(bytes(range(200, 256)) * 4)
    ds = TokenDataset(FileTokens(tmp_path / "t.txt", "bytes"), 16, 128)
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        ds[0]


# ----------------------------------------------------------------------------- faults, environment


def test_fault_parsing_and_selection():
    fs = parse("exit:rank=1:step=7:code=3; sigkill:step=2:attempt=1")
    assert [(f.kind, f.rank, f.step, f.attempt) for f in fs] == [("exit", 1, 7, 0), ("sigkill", None, 2, 1)]
    assert fs[0].params == {"code": "3"}
    f = Faults(rank=1, restart_count=0, text="desync_step:rank=1:step=5;hang:rank=0:step=5")
    assert f.hit("desync_step", 4) is None and f.hit("desync_step", 5) is not None
    assert f.hit("desync_step", 5) is None  # fires once
    assert f.hit("hang", 5) is None  # another rank's fault
    assert not Faults(rank=1, restart_count=1, text="exit:rank=1:step=7")  # only on attempt 0
    with pytest.raises(ConfigError, match="unknown fault"):
        parse("explode:step=1")
    with pytest.raises(ConfigError, match="step=N"):
        parse("exit:rank=1")


def test_detect_torchrun_slurm_skypilot_and_single():
    t = detect(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "h0",
            "MASTER_PORT": "1234",
            "TORCHELASTIC_RESTART_COUNT": "2",
        }
    )
    assert (t.source, t.rank, t.world_size, t.local_rank, t.local_world_size, t.restart_count) == (
        "torchrun",
        3,
        8,
        1,
        4,
        2,
    )
    s = detect(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS_PER_NODE": "4",
        }
    )
    assert (s.source, s.rank, s.world_size, s.master_addr, s.master_port, s.local_world_size) == (
        "slurm",
        5,
        8,
        "gpu07",
        14242,
        4,
    )  # job.sbatch's MASTER_PORT for job 4242: 10000 + 4242 % 20000
    k = detect({"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n", "SKYPILOT_NUM_NODES": "2"})
    assert (k.source, k.rank, k.world_size, k.master_addr) == ("skypilot", 1, 2, "10.0.0.1")
    assert detect({}).source == "single"
    assert first_slurm_host("node1,node2") == "node1" and first_slurm_host("a[3,5-9]") == "a3"


def test_job_environment_respects_what_is_set():
    env = job_environment(
        {"NCCL_IB_DISABLE": "0"},
        local_world_size=2,
        is_gpu=True,
        env={"NCCL_IB_DISABLE": "1", "TORCH_NCCL_BLOCKING_WAIT": "1"},
    )
    assert "NCCL_IB_DISABLE" not in env and "TORCH_NCCL_BLOCKING_WAIT" not in env
    # 2: a timed-out collective's error reaches Python (exit 43) instead of the watchdog aborting the process.
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert "TORCH_FR_BUFFER_SIZE" in env and int(env["OMP_NUM_THREADS"]) >= 1
    cpu = job_environment({"NCCL_IB_DISABLE": "0"}, local_world_size=2, is_gpu=False, env={})
    assert "NCCL_IB_DISABLE" not in cpu and int(cpu["OMP_NUM_THREADS"]) >= 1


def test_gloo_is_pinned_to_the_interface_of_the_nodes_address():
    """On cloud images the hostname resolves to 127.0.1.1; gloo must announce the node's real address."""
    env = job_environment({}, local_world_size=1, is_gpu=False, env={"DTLAUNCH_NODE_ADDR": "127.0.0.1"})
    assert env["GLOO_SOCKET_IFNAME"] == "lo"
    env = job_environment(
        {}, local_world_size=1, is_gpu=False, env={"DTLAUNCH_NODE_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth9"}
    )
    assert "GLOO_SOCKET_IFNAME" not in env  # what the user set wins


def test_light_modules_do_not_import_torch():
    code = "import sys, launcher, launcher.recipe, launcher.plan, launcher.runtime; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_lr_schedule():
    from launcher.runtime.optim import lr_factor

    kw = dict(steps=100, warmup=10, lr=1.0, min_lr=0.1)
    assert lr_factor(0, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(9, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_factor(100, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(55, schedule="linear", **kw) == pytest.approx(0.55)
    assert lr_factor(70, schedule="constant", **kw) == 1.0


def test_plot_metrics(tmp_path):
    from launcher.cli.plot import PlotError, plot_metrics

    with pytest.raises(PlotError, match="no metrics"):
        plot_metrics(tmp_path)
    lines = [{"event": "start", "time": 1}]
    lines += [{"step": s, "loss": 6 - s / 10, "tokens_per_s": 1000} for s in range(1, 11)]
    lines += [{"event": "preempt", "step": 10}, {"event": "resume", "step": 10}]
    lines += [{"step": s, "loss": 6 - s / 10, "tokens_per_s": 900} for s in range(9, 21)]  # re-logged steps
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{torn")
    out = plot_metrics(tmp_path / "metrics.jsonl")
    assert out == tmp_path / "loss.png" and out.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "empty.jsonl").write_text(json.dumps({"event": "start"}) + "\n")
    with pytest.raises(PlotError, match="no logged steps"):
        plot_metrics(tmp_path / "empty.jsonl")


def test_fsdp2_cpu_offload_on_a_cpu_machine_is_a_config_error():
    from launcher.plan.layout import Layout
    from launcher.runtime.engines import TorchEngine

    rec, _ = _plan_for()
    lay = Layout("fsdp", dp=2, precision="fp32", offload="params")
    with pytest.raises(ConfigError, match="needs a GPU"):
        TorchEngine(build_model(catalog.PRESETS["micro"]), lay, rec.training, 10, torch.device("cpu"), is_gpu=False)


def test_layout_keeps_the_global_batch_on_another_world_size():
    from launcher.plan.layout import LayoutError

    _, plan = _plan_for()
    lay, notes = plan.layout.for_world(1)
    assert (lay.grad_accum, lay.global_batch) == (4, 16) and "grad_accum 2 -> 4" in notes[0]
    with pytest.raises(LayoutError, match="cannot be split"):
        plan.layout.for_world(3)
    # tensor 2 on 2 ranks keeps one data-parallel rank, so the micro-steps per rank double again
    tp2 = msgspec.structs.replace(plan.layout, tp=2)
    lay, _ = tp2.for_world(2)
    assert (lay.tp, lay.dp, lay.global_batch) == (2, 1, 16)
    with pytest.raises(LayoutError, match="cannot hold tensor 2 x pipeline 1"):
        tp2.for_world(3)


# ----------------------------------------------------------------------------- checksums taken while writing


def test_dcp_writer_checksums_equal_a_read_back(tmp_path):
    """The CRC-32s the writer records as it writes are those of the files on disk, for every file DCP wrote
    (data files of each writer thread and the renamed .metadata), so the manifest need not read them back."""
    import torch.distributed.checkpoint as dcp

    from launcher.runtime.checkpoint import dcpio

    state = {
        "w": torch.randn(300, 70),
        "b": torch.arange(1000, dtype=torch.int64),
        "s": torch.tensor(3.0),
        "nested": {"x": torch.randn(5, 5).t()},
        "note": "bytes too",
    }
    w = dcpio.writer(tmp_path, thread_count=3)
    dcp.save(state, storage_writer=w, no_dist=True)
    sums = dcpio.written_sums(w, tmp_path)
    on_disk = {f.name for f in tmp_path.iterdir() if f.is_file()}
    assert set(sums) == on_disk and ".metadata" in sums and len(sums) >= 3
    for name, (size, crc) in sums.items():
        assert (tmp_path / name).stat().st_size == size
        assert disk.crc32_of(tmp_path / name) == crc, name
    assert disk.write_manifest(tmp_path, 0, sums)["files"] == disk.write_manifest(tmp_path, 0)["files"]


def test_dcp_write_threads_are_the_ranks_share_of_the_cores(monkeypatch):
    """Writer threads only where a rank has cores for them: one per core of its share, 1 to DCP_WRITE_THREADS."""
    from launcher.runtime.checkpoint.dcpio import DCP_WRITE_THREADS, dcp_write_threads

    assert dcp_write_threads(cpus=2, local_ranks=2) == 1  # the benchmark machine: threads would only contend
    assert dcp_write_threads(cpus=1, local_ranks=4) == 1
    assert dcp_write_threads(cpus=8, local_ranks=4) == 2
    assert dcp_write_threads(cpus=128, local_ranks=8) == DCP_WRITE_THREADS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert 1 <= dcp_write_threads() <= DCP_WRITE_THREADS


def test_checksums_not_taken_in_order_are_not_trusted(tmp_path):
    """A seek, a short write or a size that changed afterwards: the manifest reads the file back."""
    from launcher.runtime.checkpoint import dcpio

    fs = dcpio._checksumming_fs()
    with fs.create_stream(tmp_path / "a", "wb") as s:
        s.write(b"hello")
        s.seek(0)
        s.write(b"J")
    with fs.create_stream(tmp_path / "b", "wb") as s:
        s.write(memoryview(b"world"))
    assert str(tmp_path / "a") not in fs.sums and str(tmp_path / "b") in fs.sums
    fs.rename(tmp_path / "b", tmp_path / "__0_0.distcp")
    sums = {"__0_0.distcp": fs.sums[str(tmp_path / "__0_0.distcp")]}
    assert disk.write_manifest(tmp_path, 0, sums)["files"]["__0_0.distcp"]["crc32"] == disk.crc32_of(
        tmp_path / "__0_0.distcp"
    )
    (tmp_path / "__0_0.distcp").write_bytes(b"changed later")  # a different size: recomputed, not trusted
    m = disk.write_manifest(tmp_path, 0, sums)["files"]["__0_0.distcp"]
    assert m == {"size": 13, "crc32": disk.crc32_of(tmp_path / "__0_0.distcp")}


# ----------------------------------------------------------------------------- loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 10_000])  # one token per chunk, a chunk that does not divide, all at once
def test_the_chunked_cross_entropy_is_torchs_in_value_and_gradient(dtype, rows):
    """The loss and the logits' gradient equal F.cross_entropy's on an fp32 copy (the reference the chunked
    version exists to avoid), and the gradient comes back in the logits' own dtype."""
    from launcher.runtime.loss import cross_entropy

    g = torch.Generator().manual_seed(rows)
    logits = (4 * torch.randn(3, 50, 301, generator=g)).to(dtype)
    targets = torch.randint(0, 301, (3, 50), generator=g)
    mine = logits.clone().requires_grad_()
    ref = logits.clone().float().requires_grad_()
    loss = cross_entropy(mine, targets, rows)
    expected = torch.nn.functional.cross_entropy(ref.flatten(0, 1), targets.flatten(0, 1))
    (2.5 * loss).backward()
    (2.5 * expected).backward()
    assert loss.dtype == torch.float32 and mine.grad.dtype == dtype
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(mine.grad.float(), ref.grad.to(dtype).float(), rtol=tol, atol=tol * 1e-2)


# ----------------------------------------------------------------------------- gradient clipping


@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipping, and a norm already under the limit
def test_clipping_on_plain_gradients_is_torchs(max_norm):
    """DDP's gradients (plain tensors): the same norm and the same scaled gradients as clip_grad_norm_, and
    parameters without a gradient are left alone. (Sharded gradients: tests/runtime/test_rt_layouts.py compares
    FSDP2 and tensor-parallel runs' clipped norms with one rank's.)"""
    from launcher.runtime.gradclip import clip_grad_norm

    g = torch.Generator().manual_seed(3)
    mine = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(7, 5), (5,), (3, 3, 2), (4,)]]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    for a, b in zip(mine[:3], ref[:3], strict=True):
        a.grad = torch.randn(a.shape, generator=g)
        b.grad = a.grad.clone()
    norm = clip_grad_norm(mine, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    assert mine[3].grad is None
    after = float(torch.stack([p.grad.norm() for p in mine[:3]]).norm())
    assert after == pytest.approx(min(max_norm, float(norm)), rel=1e-5)


def test_a_checkpoint_of_another_recipe_is_refused_unless_allowed():
    """A checkpoint written by another recipe (here another learning rate and data) in the same
    directory is refused with what differs, unless checkpoint.resume_changed_recipe allows it; the length of
    training and the world size may change freely."""
    from launcher.runtime.checkpoint.compat import check_compatible, identity
    from launcher.runtime.failures import ConfigError

    base = {
        "model": {"preset": "tiny"},
        "training": {"lr": 3e-3, "seed": 0, "steps": 40, "data": {"source": "synthetic", "num_tokens": 200000}},
    }
    other = {
        "model": {"preset": "tiny"},
        "training": {"lr": 1e-4, "seed": 0, "steps": 80, "data": {"source": "synthetic", "num_tokens": 999}},
    }

    def meta(r):
        return {
            "format": 1,
            "shape": "tiny",
            "family": "torch",
            "strategy": "fsdp",  # noqa: E731
            "world_size": 2,
            "identity": identity(r),
        }

    with pytest.raises(ConfigError, match=r"different recipe.*training\.data\.num_tokens.*training\.lr") as e:
        check_compatible(meta(base), meta(other), world_size=2, deepspeed=False, allow_changed_recipe=False, fmt=1)
    assert "resume_changed_recipe" in e.value.fix
    notes = check_compatible(meta(base), meta(other), world_size=2, deepspeed=False, allow_changed_recipe=True, fmt=1)
    assert any("recipe changed (allowed): training.lr" in n for n in notes), notes
    longer = {**base, "training": {**base["training"], "steps": 400}}
    # no ConfigError: a longer run on another world size is the same run
    check_compatible(meta(base), meta(longer), world_size=4, deepspeed=False, allow_changed_recipe=False, fmt=1)


def test_a_store_port_taken_since_torchrun_chose_it_is_a_retry_not_a_bad_node(tmp_path):
    """torchrun picks rank 0's store port free and rank 0 binds it moments later; another process can take it in
    between (seen on the local cluster: EADDRINUSE after a requeue). That is transient: FAILED, which torchrun's
    restart meets with another port, not PREFLIGHT, which would exclude a good node. A real bind on a port held
    here, in a process of its own (the process group is global)."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    code = (
        "import os\n"
        f"os.environ.update(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT='{held.getsockname()[1]}')\n"
        "from launcher.runtime.dist import init_distributed\n"
        "try:\n"
        "    init_distributed(init_timeout_s=10, verbose=False)\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, int(e.exit_code), str(e).splitlines()[0])\n"
    )
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    finally:
        held.close()
    assert p.stdout.startswith(
        f"RuntimeFailure {int(ExitCode.FAILED)} rank 0 could not open the process group's store"
    ), p.stdout + p.stderr
    assert "the port was taken after it was chosen" in p.stdout
