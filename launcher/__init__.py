"""dtlaunch: plan, validate, render and launch distributed training jobs.

`launcher.submit(recipe)` submits to SLURM through submitit and returns its Job (launcher/api.py). It is
loaded on first use, so `import launcher` (and every CLI command) stays free of submitit and torch.
"""
__version__ = "0.1.0"
__all__ = ["submit"]


def __getattr__(name: str):
    if name == "submit":
        from .api import submit

        return submit
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")
