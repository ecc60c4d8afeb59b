"""Torchrun entry of bench/trainer_overhead.py: both arms of one strategy, alternately, in ONE world.

    torchrun --nproc-per-node=2 bench/overhead_world.py SPEC.json

SPEC.json: {"plan": plan.json of our run, "minimal_args": [bench/minimal_loops.py arguments], "pairs": N,
"out": DIR}. Pair i runs `launcher.runtime.Trainer` on the plan (DIR/ours-i/metrics.jsonl) and the minimal
loop (DIR/minimal-i/minimal-RANK.json), ours first in even pairs and the minimal loop first in odd ones.

Why one world rather than a torchrun per run: see bench/trainer_overhead.py (separate processes of the same
code read up to 10% apart here, more than the 3% the benchmark must resolve). Each arm still builds its model,
optimizer and engine from scratch, as a run does; what it skips is torchrun and the imports, which the
steady-state speed never included.
"""
from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import minimal_loops  # noqa: E402
from common import abba  # noqa: E402
from launcher import planfile  # noqa: E402
from launcher.runtime import Trainer, init_distributed  # noqa: E402
from launcher.runtime.dist import shutdown  # noqa: E402


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    recipe, plan, doc = planfile.read(spec["plan"])
    world = init_distributed(recipe)
    import torch.distributed as dist

    out = Path(spec["out"])
    for i in range(spec["pairs"]):
        for arm in abba(i):
            run_dir = out / f"{arm}-{i}"
            run_dir.mkdir(parents=True, exist_ok=True)
            gc.collect()  # the previous arm's model and engine go now, not during this arm's steps
            dist.barrier()
            if arm == "ours":
                code = Trainer(recipe, plan, run_dir, recipe_hash=doc["recipe_hash"], world=world).run()
                if code != 0:
                    print(f"overhead_world: our run {run_dir} ended with exit code {code}", file=sys.stderr, flush=True)
                    os._exit(code)
            else:
                minimal_loops.run(minimal_loops.parse_args([*spec["minimal_args"], "--out", str(run_dir)]))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
