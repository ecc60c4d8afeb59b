"""The honest baseline: the minimal torchrun training loop a user would write by hand.

Same model (launcher.runtime.models.llama, same preset and seed, so the same initial weights), same
synthetic tokens in the same order, same global batch and gradient accumulation, AdamW (same betas,
weight decay on >=2-D parameters only), the same warmup+cosine schedule, grad clipping at 1.0, fp32.
No checkpointing, no preflight, no per-step agreement collective, no watchdog: just the loop.

    torchrun --nproc-per-node=2 bench/minimal_loops.py --strategy ddp|fsdp|zero1|zero2|zero3 --out DIR [...]
    torchrun --nproc-per-node=2 bench/minimal_loops.py --mode save --preset small-50m --out DIR

Each rank writes DIR/minimal-RANK.json: wall-clock time at the end of every step, losses, peak RSS.
`--mode save` times torch.save (+fsync) of the FSDP2 model+optimizer state dict (each rank its shards,
as DCP writes them) - the baseline of the checkpoint benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec.structs
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from launcher.catalog import PRESETS  # noqa: E402
from launcher.runtime.data import SyntheticTokens  # noqa: E402  (the tokens only; batching is done here)
from launcher.runtime.models.llama import build_model  # noqa: E402


def vmhwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="train", choices=["train", "save"])
    ap.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp", "zero1", "zero2", "zero3"])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--num-tokens", type=int, default=400000)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3, help="save mode: how many saves")
    ap.add_argument(
        "--train-between",
        type=int,
        default=0,
        help="save mode: training steps before each save (a run's checkpoint.every)",
    )
    ap.add_argument(
        "--ds-config",
        default=None,
        help="zero*: a DeepSpeed config JSON file instead of the minimal one "
        "(to tell config effects from loop effects)",
    )
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def _wrap(model, a):
    """DDP or FSDP2 as a hand-written loop would (DeepSpeed wraps later, with the optimizer)."""
    if a.strategy == "ddp" and a.mode == "train":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, gradient_as_bucket_view=True, broadcast_buffers=False)
    if a.strategy == "fsdp" or a.mode == "save":
        from torch.distributed.fsdp import fully_shard

        for unit in model.layers:
            fully_shard(unit)
        fully_shard(model)
    return model


def main() -> None:
    a = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    run(a)
    dist.barrier()
    dist.destroy_process_group()


def run(a: argparse.Namespace) -> None:
    """The loop itself, in a process group that already exists."""
    for _ in steps(a):
        pass


def steps(a: argparse.Namespace) -> Iterator[int]:
    """The loop one step at a time: yields each completed step; DIR/minimal-RANK.json is written after the
    last (bench/overhead_world.py alternates a few of these steps with a few of `launcher.runtime.Trainer`'s
    in one world)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ga = a.global_batch // (a.micro_batch * world)

    torch.manual_seed(0)
    shape = msgspec.structs.replace(PRESETS[a.preset], seq_len=a.seq_len)
    model = _wrap(build_model(shape), a)
    # param groups after wrapping: fully_shard replaces the parameters with DTensors
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(a))
    zero = a.strategy.startswith("zero")
    if zero and a.mode == "train":
        model, opt, sched = _deepspeed(model, opt, sched, a, ga)

    # Data: sample i is tokens[i*seq : (i+1)*seq + 1]; each epoch a seeded permutation cut into global
    # batches; rank r takes every world-th sample of the batch (DistributedSampler's interleaving).
    tokens = SyntheticTokens(a.num_tokens, shape.vocab, 0).tokens.long()
    n_samples = (tokens.numel() - 1) // a.seq_len
    steps_per_epoch = n_samples // a.global_batch
    idx = torch.arange(a.seq_len + 1)

    def batches():
        epoch = 0
        while True:
            order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(epoch))
            mine = order[: steps_per_epoch * a.global_batch][rank::world]
            for s in range(steps_per_epoch):
                per_rank = mine[s * a.global_batch // world : (s + 1) * a.global_batch // world]
                yield [tokens[(i * a.seq_len)[:, None] + idx] for i in per_rank.split(a.micro_batch)]
            epoch += 1

    out = Path(a.out)
    if a.mode == "save":
        save_baseline(model, opt, a, rank, out)
        return

    data = batches()
    times, losses = {}, {}
    t_start = time.time()
    for step in range(1, a.steps + 1):
        micro = next(data)
        for i, b in enumerate(micro):
            loss = _micro_step(model, b, a, last=i == len(micro) - 1, ga=ga, zero=zero)
        if not zero:  # DeepSpeed's engine stepped in its last micro-step
            _optimizer_step(model, opt, sched)
        if step % a.log_every == 0 or step == a.steps:
            losses[step] = loss.item()
            if rank == 0:
                print(f"step {step} loss {losses[step]:.4f}", flush=True)
        times[step] = time.time()
        yield step
    rec = {
        "rank": rank,
        "t_start": t_start,
        "times": times,
        "losses": losses,
        "vmhwm_mb": vmhwm_mb(),
        "tokens_per_step": a.global_batch * a.seq_len,
    }
    (out / f"minimal-{rank}.json").write_text(json.dumps(rec))


def _deepspeed(model, opt, sched, a, ga: int):
    """DeepSpeed's engine with the minimal ZeRO config (or --ds-config's)."""
    import deepspeed

    from launcher.runtime.engines.deepspeed import without_shm_comm

    without_shm_comm(deepspeed)  # as the runtime: no minute of C++ build in one loop's start-up only
    cfg = {
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": int(a.strategy[-1])},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    if a.ds_config:
        cfg = json.loads(Path(a.ds_config).read_text())
    model, opt, _, sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    return model, opt, sched


def _lr_lambda(a):
    def lr_lambda(step: int) -> float:  # linear warmup, then cosine to 0
        if step < a.warmup:
            return (step + 1) / a.warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))))

    return lr_lambda


def _optimizer_step(model, opt, sched) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _micro_step(model, b, a, *, last: bool, ga: int, zero: bool):
    """Forward and backward of one micro-batch, with gradient sync only on the last one (DeepSpeed counts
    the micro-steps itself)."""
    x, y = b[:, :-1], b[:, 1:]
    if zero:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))
        model.backward(loss)
        model.step()
        return loss
    if a.strategy == "fsdp":
        model.set_requires_gradient_sync(last)
        ctx = contextlib.nullcontext()
    else:
        ctx = contextlib.nullcontext() if last else model.no_sync()
    with ctx:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))
        (loss / ga).backward()
    return loss


def _train_step(model, opt, a) -> None:
    x = torch.randint(0, model.shape.vocab, (a.micro_batch, a.seq_len + 1))
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten(0, 1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def save_baseline(model, opt, a, rank: int, out: Path) -> None:
    """`repeat` x torch.save of this rank's shards + fsync, at the points a run checkpoints: after
    `--train-between` training steps, keeping the previous save's file until the new one is written (a run's
    keep=1). Both matter on this machine: a write right after training steps took ~2.5x as long as one back to
    back with the previous write (0.37 -> 0.95 s for torch.save, and the same for DCP), and a kept file ~1.4x."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _train_step(model, opt, a)  # so that AdamW has its moments
    secs, nbytes, prev = [], 0, None
    for i in range(a.repeat):
        for _ in range(a.train_between):
            _train_step(model, opt, a)
        model_sd, optim_sd = get_state_dict(model, opt)
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        state = {
            "model": {k: local(v) for k, v in model_sd.items()},
            "optim": {
                "state": {k: {n: local(t) for n, t in s.items()} for k, s in optim_sd["state"].items()},
                "param_groups": optim_sd["param_groups"],
            },
        }
        path = out / f"torchsave-{i}-rank{rank}.pt"
        dist.barrier()
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        dist.barrier()
        secs.append(time.perf_counter() - t0)
        nbytes = path.stat().st_size
        if prev is not None:
            prev.unlink()
        prev = path
    prev.unlink()
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, nbytes)
    (out / f"minimal-{rank}.json").write_text(
        json.dumps({"rank": rank, "save_seconds": secs, "bytes_total": sum(sizes), "vmhwm_mb": vmhwm_mb()})
    )


if __name__ == "__main__":
    main()
