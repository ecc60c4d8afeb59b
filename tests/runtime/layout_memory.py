"""Test driver for test_rt_layouts.py's memory check: in ONE torchrun world, for each layout in CASES.json, wrap
the runtime's own model as the trainer does (`build_engine`), run two optimizer steps of real tensors under
PyTorch's MemTracker, and write every rank's peak (the second step's) beside the planner's largest moment for
that rank's pipeline position.

MemTracker's module tracker is replaced by a stand-in: its backward hooks fail under the pipeline stages'
autograd.grad calls, and only the total is compared (the planner's terms and the tracker's categories cut the
same bytes differently: a stage's receive buffers are "buffers" to one and activations to the other).

Usage: torchrun ... layout_memory.py CASES.json, where CASES.json lists {"sets": [...], "out": dir}.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from launcher.plan import make_plan
from launcher.plan.moments import timeline
from launcher.plan.parts import part_of, rank_params
from launcher.recipe import load
from launcher.runtime.engines import build_engine
from launcher.runtime.models import build_model

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml"


class NoModules:
    is_bw = False
    parents = {"Global"}

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def measure(sets: list[str], world: int, rank: int) -> dict:
    recipe = load(str(TINY), [f"resources.accelerator=cpu:{world}", "training.preflight=false", *sets])
    plan = make_plan(recipe)
    layout, _ = plan.layout.for_world(world)
    torch.manual_seed(0)
    module = build_model(recipe.model.shape(), layout.activation_checkpointing, device="cpu")
    training = recipe.training.replace(grad_clip=0.0)
    engine = build_engine(
        module, layout, recipe.replace(training=training), plan, 10, torch.device("cpu"), is_gpu=False
    )
    for group in engine.optimizer.param_groups:
        group["foreach"] = True  # what AdamW picks on CUDA
    g = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, recipe.model.shape().vocab, (layout.micro_batch, plan.seq_len + 1), generator=g)
        for _ in range(layout.grad_accum)
    ]
    tracker = MemTracker()
    tracker._mod_tracker = NoModules()
    tracker.track_external(engine.model, engine.optimizer, *batches)
    with tracker:
        for it in range(2):
            if it:  # the second step: the first one also builds the optimizer state and the pipeline's buffers
                gc.collect()
                tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
                tracker._peak_mem = {d: s["Total"] for d, s in tracker._peak_mem_snap.items()}
            engine.forward_backward([(b[:, :-1], b[:, 1:]) for b in batches])
            engine.step()
    traced = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    shape = recipe.model.shape()
    part = part_of(shape, plan.layout, layout.coords(rank)[0])
    rows = timeline(
        shape, "llama", rank_params(shape, "llama", plan.params, plan.layout, part), plan.seq_len, plan.layout, part
    )
    at = max(rows, key=lambda m: sum(rows[m].values()))
    return {
        "rank": rank,
        "coords": list(layout.coords(rank)),
        "traced": int(traced),
        "planned": int(round(sum(rows[at].values()))),
        "planned_at": at,
    }


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in cases:
        out = Path(case["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank-{rank}.json").write_text(json.dumps(measure(case["sets"], world, rank)))
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: gloo's teardown aborts now and then (docs/pitfalls.md)


if __name__ == "__main__":
    main()
