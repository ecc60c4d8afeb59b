"""A plain PyTorch training loop, launched by dtlaunch and using its runtime for the parts that are hard to
get right on a cluster: the process group and its timeouts, the plan's parallel strategy, checkpoints that
survive a preemption or a crash, and metrics.

    dtlaunch up examples/plain-pytorch/recipe.yaml            # 2 CPU ranks here; GPUs and nodes per recipe

Everything else is yours: the model, the data, the loss. The resume position (epoch and micro-batch within
it) goes into each checkpoint with `state=`, so a preempted run continues with the very next batch.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

import launcher


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """An MLP classifier; `layers` are the repeated blocks FSDP2 shards one by one."""

    def __init__(self, features: int, width: int, depth: int, classes: int):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, x):
        h = self.inp(x)
        for block in self.layers:
            h = block(h)
        return self.out(h)


def make_data(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    """A learnable synthetic task (labels from a fixed random projection): every rank builds the same."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--samples", type=int, default=4096)
    args = ap.parse_args()

    job = launcher.init()  # reads the plan the job scripts point at; joins the process group
    seed = job.recipe.training.seed
    torch.manual_seed(seed)  # the same initial weights on every rank
    engine = job.wrap(Net(args.features, args.width, args.depth, args.classes))
    state = job.resume()  # {} on a fresh start, else what the newest good checkpoint saved below

    data = make_data(args.samples, args.features, args.classes, seed)
    sampler = DistributedSampler(data, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=seed,
                                 drop_last=True)
    per_epoch = len(sampler) // job.micro_batch // job.grad_accum  # optimizer steps per epoch
    total = job.total_steps or 3 * per_epoch
    epoch, batch = state.get("epoch", 0), state.get("batch", 0)  # batch: micro-batches done in this epoch
    step = job.step
    while step < total:
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one after a resume
        rest = list(sampler)[batch * job.micro_batch:]
        # its own generator: iter() over a DataLoader without one draws from torch's global generator, and the
        # extra iter() of a resume mid-epoch would shift dropout's numbers away from the uninterrupted run's
        loader = DataLoader(Subset(data, rest), batch_size=job.micro_batch, drop_last=True,
                            generator=torch.Generator().manual_seed(seed))
        batches = iter(loader)
        while step < total and batch < per_epoch * job.grad_accum:
            for i in range(job.grad_accum):
                x, y = (t.to(job.device) for t in next(batches))
                loss = engine.accumulate(lambda model: F.cross_entropy(model(x), y), last=i == job.grad_accum - 1)
                batch += 1
            engine.step()  # clip, optimizer, schedule, zero_grad
            step += 1
            # Logs, agrees on preemption across ranks (then checkpoints and exits 42), checkpoints when due.
            job.step_done(step, loss=loss, state={"epoch": epoch, "batch": batch})
        epoch, batch = epoch + 1, 0
    job.finish(state={"epoch": epoch, "batch": 0})


if __name__ == "__main__":
    main()
