"""GPU suite driver: train several plans one after another in ONE torchrun world (as tests/runtime/multi_train.py
does), and after each write where every tensor of the engine lives and what the GPU reported, for the test to
check. Usage: torchrun ... gpu_driver.py CASES.json (each {"plan", "run_dir", "env"})."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from launcher import planfile
from launcher.runtime import Trainer, init_distributed


def devices(tensors) -> list[str]:
    out = set()
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        out.add(t.device.type)
    return sorted(out)


def placement(trainer: Trainer) -> dict:
    eng = trainer.engine
    module = eng.module
    states = [
        v
        for st in getattr(eng.optimizer, "state", {}).values()
        for k, v in st.items()
        if isinstance(v, torch.Tensor) and k != "step"
    ]
    params = list(module.parameters())
    return {
        "params": devices(params),
        "grads": devices(p.grad for p in params),
        "optimizer": devices(states),
        "buffers": devices(module.buffers()),
        "device": str(trainer.world.device),
        "backend": trainer.world.backend,
        "max_reserved": torch.cuda.max_memory_reserved(),
        "weight_std": {
            n: float(p.detach().float().std())
            for n, p in module.named_parameters()
            if "attention.wq" in n and not hasattr(p, "ds_id")
        },
        # the optimizer that steps the states: inside DeepSpeed's ZeRO wrapper, the one it was given
        "optimizer_type": type(getattr(eng.optimizer, "optimizer", eng.optimizer)).__name__,
        "fused": bool(getattr(eng.optimizer, "defaults", {}).get("fused")),
    }


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    first, first_plan, _ = planfile.read(cases[0]["plan"])
    world = init_distributed(first, first_plan)
    import torch.distributed as dist

    for case in cases:
        recipe, plan, doc = planfile.read(case["plan"])
        run_dir = Path(case["run_dir"])
        saved = {k: os.environ.get(k) for k in case.get("env", {})}
        os.environ.update(case.get("env", {}))
        t0 = time.time()
        trainer = Trainer(recipe, plan, run_dir, recipe_hash=doc["recipe_hash"], world=world)
        try:
            code, err = trainer.run(), None
        except BaseException as e:  # noqa: BLE001 - reported per case
            code, err = getattr(e, "exit_code", 1), f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        if trainer.engine is not None:
            (run_dir / f"placement-rank{world.rank}.json").write_text(json.dumps(placement(trainer)))
        if world.rank == 0 or err:
            (run_dir / f"result-rank{world.rank}.json").write_text(
                json.dumps({"code": int(code), "error": err, "seconds": round(time.time() - t0, 2)})
            )
        if err:
            print(f"case {run_dir} failed on rank {world.rank}: {err}", file=sys.stderr, flush=True)
            if world.world_size > 1:  # the other ranks may be waiting in a collective this rank left
                os._exit(1)
            continue  # one rank: the next cases still tell something
        torch.cuda.reset_peak_memory_stats()
        dist.barrier()
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
