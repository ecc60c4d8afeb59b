"""README.md, true as written: every shell block is either run here (and must succeed, with the output it
documents) or marked as needing a real cluster or a cloud (and must still be valid shell naming real
dtlaunch commands). The markers and the runner are in tests/readme_blocks.py.

Runnable blocks run as a newcomer would run them after `make install`: bash, the venv's bin first on PATH
(the README says to activate it), a private DTLAUNCH_HOME, and a scratch directory holding the repository's
recipes/, examples/ and scripts/ (so `runs/` and `rendered/` land there, not in the checkout).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from readme_blocks import readme_blocks
from testpaths import ROOT

BLOCKS, PROBLEMS = readme_blocks(ROOT)
VENV_BIN = Path(sys.executable).parent
LINKED = ("recipes", "examples", "scripts")


def test_every_shell_block_is_marked_and_some_run():
    assert not PROBLEMS, "\n".join(PROBLEMS)
    assert sum(b.runnable for b in BLOCKS) >= 5


def _dtlaunch_commands() -> set[str]:
    from launcher.cli import cli

    return set(cli.commands)


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.runnable], ids=lambda b: b.id)
def test_blocks_not_run_here_are_valid_shell_with_real_commands(block):
    p = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
    assert p.returncode == 0, f"README.md:{block.line}: {p.stderr}"
    known = _dtlaunch_commands()
    for line in block.code.splitlines():
        words = shlex.split(line, comments=True) if line.strip() else []
        for i, w in enumerate(words[:-1]):
            if w == "dtlaunch" and not words[i + 1].startswith("-"):
                assert words[i + 1] in known, f"README.md:{block.line}: `dtlaunch {words[i + 1]}` is not a command"


def _workspace(tmp: Path) -> Path:
    ws = tmp / "ws"
    ws.mkdir()
    for name in LINKED:
        (ws / name).symlink_to(ROOT / name, target_is_directory=True)
    return ws


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.runnable], ids=lambda b: b.id)
def test_runnable_block(block, tmp_path):
    cwd = ROOT if block.kind == "repo" else _workspace(tmp_path)
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "DTLAUNCH_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    for k in ("DTLAUNCH_FAULT", "DTLAUNCH_RUN_ID", "SLURM_CONF"):
        env.pop(k, None)
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"README.md:{block.line} ({block.kind}) exited {p.returncode}:\n{out[-4000:]}"
    for text in block.expect:
        assert text in out, f"README.md:{block.line}: the output no longer contains {text!r}:\n{out[-4000:]}"
