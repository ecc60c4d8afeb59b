"""Fixtures for the runtime tests: a free port, a fresh run directory, and the deterministic
reference runs that the restart/resume tests compare against (run once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rt_harness import det_recipe, free_port, run_torchrun, write_plan


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(strategy) -> RunResult of an uninterrupted deterministic 2-rank run (cached)."""
    cache = {}

    def get(strategy: str):
        if strategy not in cache:
            d = tmp_path_factory.mktemp(f"ref-{strategy}")
            res = run_torchrun(write_plan(d, det_recipe(strategy)), d)
            assert res.rc == 0, res.output[-4000:]
            cache[strategy] = res
        return cache[strategy]

    return get
