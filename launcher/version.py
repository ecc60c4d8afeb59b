"""dtlaunch's version: its one home (pyproject.toml reads it from here, the wheel and the checkpoints record it)."""

__version__ = "0.1.0"
