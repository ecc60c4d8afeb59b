"""Test driver: train several plans one after another inside ONE torchrun world, through the public
library API (init_distributed once, then Trainer(..., world=world).run() per plan).

Starting a torchrun world costs several seconds on this 2-core machine; the strategy matrix shares
one world so the suite stays short. Usage: torchrun ... multi_train.py CASES.json, where CASES.json
lists {"plan": ..., "run_dir": ...}. Each case writes run_dir/result.json (rank 0).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from launcher import planfile
from launcher.runtime import Trainer, init_distributed


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    first, _, _ = planfile.read(cases[0]["plan"])
    world = init_distributed(first)
    import torch.distributed as dist

    for case in cases:
        recipe, plan, doc = planfile.read(case["plan"])
        run_dir = Path(case["run_dir"])
        t0 = time.time()
        try:
            code = Trainer(recipe, plan, run_dir, recipe_hash=doc["recipe_hash"], world=world).run()
            err = None
        except BaseException as e:  # noqa: BLE001 - reported per case
            code, err = getattr(e, "exit_code", 1), f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        if world.rank == 0 or err:
            (run_dir / f"result-rank{world.rank}.json").write_text(
                json.dumps({"code": code, "error": err, "seconds": round(time.time() - t0, 2)}))
        if err:  # the peers may be stuck in a collective: end the world, the remaining cases report "not run"
            print(f"case {run_dir} failed on rank {world.rank}: {err}", file=sys.stderr, flush=True)
            os._exit(1)
        dist.barrier()
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
