"""SkyBackend against the real SkyPilot library on a machine with no cloud credentials.

Nothing is mocked: SkyPilot's own API server is started locally (first time ~20 s) and reports no
enabled cloud, and `submit` must turn that into a BackendError that says to run `sky check`, not a
traceback. One test, because the API server start dominates.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.errors import BackendError
from launcher.targets import backend

from sky_helpers import RECIPES, render_to

TINY = next(p for p in RECIPES if p.name == "tiny.yaml")


@pytest.mark.slow
def test_submit_without_credentials_fails_fast_with_sky_check(tmp_path):
    _, art, out = render_to(tmp_path, TINY, ["resources.nodes=2"])
    with pytest.raises(BackendError) as ei:
        backend("sky").submit(art, str(out), wait=False)
    msg = str(ei.value)
    assert "sky check" in msg and ("no cloud" in msg or "credentials" in msg), msg
    assert ei.value.exit_code == 3


def test_missing_secret_is_named_before_skypilot_is_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("DTLAUNCH_TEST_TOKEN", raising=False)
    _, art, out = render_to(tmp_path, TINY, ["secrets=[DTLAUNCH_TEST_TOKEN]"])
    with pytest.raises(BackendError, match="DTLAUNCH_TEST_TOKEN not set"):
        backend("sky").submit(art, str(out), wait=False)


def test_cli_path_never_imports_sky():
    """Importing the backend and rendering must not pull in SkyPilot (~2 s, ~160 MB)."""
    code = ("import sys; import launcher.cli, launcher.targets.sky, launcher.render.sky; "
            "print('sky' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
