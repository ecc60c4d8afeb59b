"""Torchrun entry of bench/trainer_overhead.py: both arms of one strategy, block by block, in ONE world.

    torchrun --nproc-per-node=2 bench/overhead_world.py SPEC.json

SPEC.json: {"plan": plan.json of our run, "minimal_args": [bench/minimal_loops.py arguments], "rounds": R,
"warmup": W, "blocks": N, "block": B, "out": DIR}. The plan and the minimal loop both train W + N*B steps.

Round r builds both arms afresh, as a run does (`launcher.runtime.Trainer` on the plan, logging to
DIR/ours-r/metrics.jsonl, and the minimal loop, writing DIR/minimal-r/minimal-RANK.json), trains W steps of
each untimed, then alternates blocks of B steps: in block pair b ours goes first when b is even and the
minimal loop when b is odd (a load that drifts over a pair favours neither). Each block starts at a barrier
and its duration is the slowest rank's. Rank 0 writes DIR/blocks-r.json: {"ours": [seconds per block],
"minimal": [...]}, block pair b at index b.

Why blocks of a few steps rather than whole runs one after the other: this host's speed drifts by 10% and
more over minutes (neighbours of a virtual machine), so two whole runs a minute apart differ by more than
the 3% the benchmark must resolve; two blocks of B steps two seconds apart see nearly the same machine.
Why one world rather than a torchrun per run: separate processes of the same code read up to 10% apart
here (cores, memory layout, start-up state); in one world, what differs between the arms is the loop.

Once our trainer has started, its process settings hold for both arms: automatic garbage collection is
off (launcher.runtime.stepgc) while the minimal loop's blocks run too. That spares the minimal loop the
collector pauses a hand-written loop would have, so the comparison can only be harder on us.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import minimal_loops  # noqa: E402
from common import abba  # noqa: E402
from launcher import planfile  # noqa: E402
from launcher.runtime import Trainer, init_distributed  # noqa: E402
from launcher.runtime.dist import shutdown  # noqa: E402


def _advance(it: Iterator[int], n: int) -> None:
    for _ in range(n):
        next(it)


def _finish(it: Iterator[int], arm: str) -> None:
    """Run an arm's end (our final checkpoint; the minimal loop's record); it must have no steps left."""
    for step in it:
        raise RuntimeError(
            f"overhead_world: the {arm} arm has steps left after the blocks (step {step}): "
            "the plan's and the minimal loop's steps must be warmup + blocks * block"
        )


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    recipe, plan, doc = planfile.read(spec["plan"])
    world = init_distributed(recipe)
    import torch
    import torch.distributed as dist

    out = Path(spec["out"])
    for r in range(spec["rounds"]):
        gc.collect()  # the previous round's models and engines go now, not during this round's steps
        dirs = {arm: out / f"{arm}-{r}" for arm in ("ours", "minimal")}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        arms = {
            "ours": Trainer(recipe, plan, dirs["ours"], recipe_hash=doc["recipe_hash"], world=world).steps(),
            "minimal": minimal_loops.steps(
                minimal_loops.parse_args([*spec["minimal_args"], "--out", str(dirs["minimal"])])
            ),
        }
        for arm in abba(r):  # build (on the first step) and warm up, untimed
            _advance(arms[arm], spec["warmup"])
        seconds = {"ours": [], "minimal": []}
        for b in range(spec["blocks"]):
            for arm in abba(b):
                dist.barrier()
                t0 = time.perf_counter()
                _advance(arms[arm], spec["block"])
                seconds[arm].append(time.perf_counter() - t0)
        for arm in abba(r):
            _finish(arms[arm], arm)
        # the slowest rank's duration of each block: a block ends for the world when its last rank is done
        local = torch.tensor([seconds["ours"], seconds["minimal"]], dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        if world.rank == 0:
            (out / f"blocks-{r}.json").write_text(json.dumps({"ours": local[0].tolist(), "minimal": local[1].tolist()}))
        dist.barrier()
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
