"""Fixtures for the runtime tests: a free port, a fresh run directory, and the deterministic
reference runs that the restart/resume tests compare against (run once per session)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from launcher.runtime.checkpoint import disk
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


@pytest.fixture
def trained(reference, run_dir):
    """trained(dest=run_dir, keep=None) -> the plan of the reference ddp run written in `dest`, with that run's
    checkpoints copied into `dest/checkpoints` (`keep`: only those steps). For a test that damages or resumes a
    finished run's checkpoints: the directory a fresh 12-step run leaves (its checkpoints hold no path of their
    run), without training it again."""

    def make(dest: Path = run_dir, keep: tuple[int, ...] | None = None) -> Path:
        root = dest / "checkpoints"
        shutil.copytree(reference("ddp").run_dir / "checkpoints", root, symlinks=True)
        if keep is not None:
            for step in set(disk.complete_steps(root)) - set(keep):
                shutil.rmtree(disk.step_path(root, step))
            assert disk.complete_steps(root) == sorted(keep)
        return write_plan(dest, det_recipe("ddp"))

    return make
