"""Test driver for test_rt_layouts.py: train several plans one after another inside ONE torchrun world (as
multi_train.py does), each case with its own environment (a fault that preempts it) and expected exit code,
and after each case write what every rank holds, read off the wrapped model: its coordinates in the mesh and
the bytes of its parameters and optimizer states (the local shards of DTensors), for the test to compare with
the planner's per-rank figures.

Usage: torchrun ... layout_train.py CASES.json, where CASES.json lists {"plan", "run_dir", "env", "expect"}.
Each case writes run_dir/result.json (rank 0) and run_dir/rank-{r}.json (every rank).
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


def local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def group_timeouts() -> dict[str, float]:
    """Every process group's timeout in seconds, read off its backends (the shortest of them)."""
    import torch
    from torch.distributed.distributed_c10d import _world

    out: dict[str, float] = {}
    for pg in _world.pg_map:
        for dev in pg._device_types:
            opts = getattr(pg._get_backend(torch.device(dev)), "options", None)
            if opts is not None:
                out[pg.group_name] = min(out.get(pg.group_name, float("inf")), opts._timeout.total_seconds())
    return out


def holdings(trainer: Trainer, rank: int) -> dict:
    eng = trainer.engine
    params = sum(local_bytes(p) for p in eng.module.parameters())
    optim = sum(
        local_bytes(v)
        for st in eng.optimizer.state.values()
        for k, v in st.items()
        if k in ("exp_avg", "exp_avg_sq", "momentum_buffer")
    )
    return {
        "rank": rank,
        "coords": list(trainer.layout.coords(rank)),
        "params": params,
        "optim": optim,
        "engine": type(eng).__name__,
        "timeouts": group_timeouts(),
        "checkpoint_group": trainer.world.checkpoint_group.group_name,
    }


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    first, first_plan, _ = planfile.read(cases[0]["plan"])
    world = init_distributed(first, first_plan)
    import torch.distributed as dist

    for case in cases:
        recipe, plan, doc = planfile.read(case["plan"])
        run_dir = Path(case["run_dir"])
        saved_env = {k: os.environ.get(k) for k in case.get("env", {})}
        os.environ.update(case.get("env", {}))
        t0 = time.time()
        trainer = Trainer(recipe, plan, run_dir, recipe_hash=doc["recipe_hash"], world=world)
        try:
            code, err = trainer.run(), None
        except BaseException as e:  # noqa: BLE001 - reported per case
            code, err = getattr(e, "exit_code", 1), f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        expected = int(case.get("expect", 0))
        if code == expected and trainer.engine is not None:
            (run_dir / f"rank-{world.rank}.json").write_text(json.dumps(holdings(trainer, world.rank)))
        if world.rank == 0 or code != expected:
            (run_dir / f"result-rank{world.rank}.json").write_text(
                json.dumps(
                    {
                        "code": int(code),
                        "error": err if code != expected else None,
                        "seconds": round(time.time() - t0, 2),
                    }
                )
            )
        if code != expected:  # the peers may be stuck in a collective: end the world
            print(
                f"case {run_dir} ended with {code} (expected {expected}) on rank {world.rank}: {err}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
        dist.barrier()
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
