"""Broken recipes are caught by dtlaunch's own validation, with file/line/field, before SkyPilot sees them.

The sharpest case is a GPU name: SkyPilot's offline schema accepts `NotAGPU:8` (it only finds out when
the optimizer looks for capacity, after the user has waited), so dtlaunch has to reject it itself.
"""

from __future__ import annotations

import os

import pytest
import yaml

from launcher import recipe as R
from launcher.errors import RecipeError
from sky_helpers import RECIPES, render_to

TINY = (RECIPES[0].parent / "tiny.yaml").read_text()


def _problem(text: str) -> dict:
    with pytest.raises(RecipeError) as ei:
        R.load_text(text, "broken.yaml")
    (p, *_) = ei.value.problems
    return p


def test_unknown_gpu_is_ours_to_reject(sky_lib, tmp_path):
    # SkyPilot itself accepts the bogus name offline ...
    _, _, out = render_to(tmp_path, RECIPES[0])
    doc = yaml.safe_load((out / "task.yaml").read_text())
    doc["resources"]["accelerators"] = "NotAGPU:8"
    (out / "bogus.yaml").write_text(yaml.safe_dump(doc))
    cwd = os.getcwd()
    os.chdir(out)
    try:
        sky_lib.Task.from_yaml(str(out / "bogus.yaml"))
    finally:
        os.chdir(cwd)
    # ... so the recipe loader must stop it, naming file, line and field.
    p = _problem(TINY.replace("accelerator: cpu:2", "accelerator: NotAGPU:8"))
    assert p.field == "resources.accelerator" and "NotAGPU" in p.message
    assert p.file == "broken.yaml" and p.line == TINY.splitlines().index("  accelerator: cpu:2") + 1


def test_nodes_must_be_a_number():
    p = _problem(TINY.replace("nodes: 1", "nodes: two"))
    assert p.field == "resources.nodes" and p.line == TINY.splitlines().index("  nodes: 1") + 1


def test_unknown_sky_key_is_named_with_a_suggestion():
    text = TINY.replace("targets:\n  default: local", "targets:\n  default: sky\n  sky:\n    use_spot: true")
    p = _problem(text)
    assert p.field == "targets.sky.use_spot" and "unknown key" in p.message
    assert "spot" in p.fix and p.line == text.splitlines().index("    use_spot: true") + 1


def test_secret_values_are_refused():
    p = _problem(TINY + "secrets: ['HF_TOKEN=hf_abc']\n")
    assert p.field.startswith("secrets") and "names only" in p.message
