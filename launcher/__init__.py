"""dtlaunch: plan, validate, render and launch distributed training jobs.

Two Python entry points, loaded on first use so `import launcher` (and every CLI command) stays free of
torch and submitit:

* `launcher.submit(recipe)` submits to SLURM through submitit and returns its Job (launcher/api.py);
* `launcher.init()`, inside a job, gives the user's own training script dtlaunch's runtime: the process
  group, the plan's wrapping, atomic checkpoints, preemption and metrics (launcher/runtime/job.py).
"""

from .version import __version__ as __version__

__all__ = ["submit", "init", "Job"]


def __getattr__(name: str):
    if name == "submit":
        from .api import submit

        return submit
    if name in ("init", "Job"):
        from .runtime import job

        return getattr(job, name)
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")
