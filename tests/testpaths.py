"""Paths the tests share: the repository and its shipped recipes (never the working directory's)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
