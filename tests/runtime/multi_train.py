"""Test driver: train several plans one after another inside ONE torchrun world, through the public
library API (init_distributed once, then Trainer(..., world=world).run() per plan).

Starting a torchrun world costs several seconds on this 2-core machine; the strategy matrix shares
one world so the suite stays short. Usage: torchrun ... multi_train.py CASES.json, where CASES.json
lists {"plan": ..., "run_dir": ...} and, for a case driven through `Trainer.steps()` rather than `run()`,
"stepwise": {} or {"close_after": N}. Each case writes run_dir/result-rank0.json.

The trainer's garbage-collection policy is swapped for a probe (`CycleProbe`) that collects after every
step and counts the tensors that only the collector could have freed: the policy of collecting every 50
steps is safe only while that count is zero. Each result reports it.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

import launcher.runtime.loop as loop_mod
from launcher import planfile
from launcher.runtime import Trainer, init_distributed
from launcher.runtime.stepgc import StepGC


class CycleProbe(StepGC):
    """StepGC that collects after every step, with DEBUG_SAVEALL, and counts tensors in the garbage."""

    found = {"collections": 0, "objects": 0, "tensors": 0, "tensor_bytes": 0}

    def __enter__(self):
        CycleProbe.found = {"collections": 0, "objects": 0, "tensors": 0, "tensor_bytes": 0}
        return super().__enter__()

    def step(self, step: int) -> None:
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        gc.set_debug(0)
        tensors = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
        f = CycleProbe.found
        f["collections"] += 1
        f["objects"] += len(gc.garbage)
        f["tensors"] += len(tensors)
        f["tensor_bytes"] += sum(t.untyped_storage().nbytes() for t in tensors if not t.is_meta)
        del tensors
        gc.garbage.clear()
        gc.collect()  # now without SAVEALL: free what was found


loop_mod.StepGC = CycleProbe


def drive_stepwise(trainer: Trainer, how: dict) -> dict:
    """Drive `trainer.steps()` with foreign collectives and allocations between its steps (as the overhead
    benchmark puts a hand-written loop's steps there); with how["close_after"], abandon it after that many."""
    import torch.distributed as dist

    yielded, it = [], trainer.steps()
    for step in it:
        yielded.append(step)
        foreign = torch.full((1024,), float(step))
        dist.all_reduce(foreign)
        if how.get("close_after") == len(yielded):
            it.close()
    return {"yielded": yielded}


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    first, first_plan, _ = planfile.read(cases[0]["plan"])
    world = init_distributed(first, first_plan)
    import torch.distributed as dist

    for case in cases:
        recipe, plan, doc = planfile.read(case["plan"])
        run_dir = Path(case["run_dir"])
        t0 = time.time()
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        stepwise = {}
        try:
            trainer = Trainer(recipe, plan, run_dir, recipe_hash=doc["recipe_hash"], world=world)
            if "stepwise" in case:
                stepwise = drive_stepwise(trainer, case["stepwise"])
                code = 0
            else:
                code = trainer.run()
            err = None
        except BaseException as e:  # noqa: BLE001 - reported per case
            code, err = getattr(e, "exit_code", 1), f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        stepwise["handlers_restored"] = all(signal.getsignal(sig) == h for sig, h in handlers.items())
        if world.rank == 0 or err:
            (run_dir / f"result-rank{world.rank}.json").write_text(
                json.dumps(
                    {
                        "code": code,
                        "error": err,
                        "seconds": round(time.time() - t0, 2),
                        "gc": CycleProbe.found,
                        "stepwise": stepwise,
                    }
                )
            )
        if err:  # the peers may be stuck in a collective: end the world, the remaining cases report "not run"
            print(f"case {run_dir} failed on rank {world.rank}: {err}", file=sys.stderr, flush=True)
            os._exit(1)
        dist.barrier()
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
