"""Shared helpers for the SkyPilot target's tests: render a recipe (with overrides) into a directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import recipe as R
from launcher.plan import make_plan
from launcher.render import render

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def render_to(tmp: Path, recipe_path, overrides=(), text: str | None = None):
    """Render for SkyPilot and write the files like `dtlaunch render -t sky -o DIR` does."""
    rec = R.load_text(text, "<test>", list(overrides)) if text is not None else R.load(recipe_path, list(overrides))
    art = render(rec, make_plan(rec), "sky")
    out = art.write(tmp / "job")
    return rec, art, out


@pytest.fixture(scope="session")
def sky_lib():
    """The real SkyPilot library (import takes ~2 s, so once per session)."""
    import sky  # the [sky] extra is part of the test environment: a missing one must fail, not skip

    return sky
