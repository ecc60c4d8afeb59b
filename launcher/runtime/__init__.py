"""The in-job runtime, usable on its own from a user's training script:

    from launcher.runtime import init_distributed, build_engine, Checkpointer, PreemptionFlag, build_dataloader

    world = init_distributed(recipe)                      # process group, timeouts, NCCL/OMP environment
    layout, _ = plan.layout.for_world(world.world_size)   # the plan's layout at this world size
    engine = build_engine(model, layout, recipe, plan, steps, world.device, world.is_gpu)
    ...

or all of it at once with `Trainer(recipe, plan, run_dir).run()` (what `python -m launcher.runtime.train` does).
Names are imported lazily so `import launcher.runtime` stays cheap until something is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "init_distributed": ".dist",
    "set_collective_timeout": ".dist",
    "shutdown": ".dist",
    "World": ".dist",
    "build_engine": ".engines",
    "Engine": ".engines",
    "Checkpointer": ".checkpoint.checkpointer",
    "export_model": ".checkpoint.export",
    "PreemptionFlag": ".signals",
    "build_dataloader": ".data",
    "build_model": ".models",
    "Trainer": ".loop",
    "Job": ".job",
    "init": ".job",
    "Metrics": ".metrics",
    "read_metrics": ".metrics",
    "ConfigError": ".failures",
    "HangError": ".failures",
    "PreflightError": ".failures",
    "Preempted": ".failures",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'launcher.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(mod, __name__), name)


def __dir__() -> list[str]:
    return __all__
