"""dtlaunch: plan, validate, render and launch distributed training jobs."""
__version__ = "0.1.0"
