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

sys.path.insert(0, str(ROOT / "bench"))
from readme_table import region  # noqa: E402

BLOCKS, PROBLEMS = readme_blocks(ROOT)
VENV_BIN = Path(sys.executable).parent
LINKED = ("recipes", "examples", "scripts")


def test_every_shell_block_is_marked_and_some_run():
    assert not PROBLEMS, "\n".join(PROBLEMS)
    assert sum(b.runnable for b in BLOCKS) >= 5


def test_the_benchmark_table_is_the_latest_make_bench():
    """The README's figures are bench/results.md's, as `make bench` copied them (never typed by hand)."""
    assert region((ROOT / "README.md").read_text()) == (ROOT / "bench" / "results.md").read_text().strip("\n")


def test_the_exit_code_table_is_the_runtimes():
    """Each row of the README's exit-code table is a code and name of launcher.jobenv.ExitCode, all of them."""
    from launcher.jobenv import ExitCode

    text = (ROOT / "README.md").read_text()
    table = text[text.index("| code | name | meaning |") :].split("\n\n")[0].splitlines()[2:]
    rows = [tuple(c.strip() for c in line.strip("|").split("|")[:2]) for line in table]
    assert rows == [(str(int(c)), c.name) for c in ExitCode]


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


def _newcomer_env(home: Path) -> dict:
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "DTLAUNCH_HOME": str(home),
        "PYTHONUNBUFFERED": "1",
    }
    for k in list(env):  # nothing of the test session's own cluster or faults leaks into a newcomer's shell
        if k.startswith(("SLURM_", "DTLAUNCH_TEST_")) or k in ("DTLAUNCH_FAULT", "DTLAUNCH_RUN_ID"):
            env.pop(k)
    return env


def _run_block(block, cwd: Path, env: dict, where: str = "") -> None:
    try:
        p = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.code],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        if block.kind == "slurm-local":  # the block stops its cluster; a block that failed half-way has not
            subprocess.run(
                ["bash", str(ROOT / "scripts" / "slurm-local.sh"), "stop", "--purge"],
                env=env,
                capture_output=True,
                timeout=300,
            )
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"README.md:{block.line} ({block.kind}){where} exited {p.returncode}:\n{out[-4000:]}"
    for text in block.expect:
        assert text in out, f"README.md:{block.line}{where}: the output no longer contains {text!r}:\n{out[-4000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "repo"], ids=lambda b: b.id)
def test_repository_block(block, tmp_path):
    """The blocks that act on the checkout itself (make targets), which the in-order run below leaves out.
    The other blocks run once, in order (each alone as well doubled the README's seven minutes of runs)."""
    _run_block(block, ROOT, _newcomer_env(tmp_path / "home"))


@pytest.mark.slow
def test_the_readme_in_order_in_one_workspace(tmp_path):
    """The reader's path: every block run here, top to bottom, in ONE workspace with one job registry, so a
    block that meets an earlier block's run (the same `runs/NAME`, a job of the same name) is caught. The
    repository's own blocks (make targets acting on the checkout) are left to the test above. Each block names
    the run directories it reads (`-o runs/NAME`), so that it also stands alone for a reader who starts there."""
    ws, env = _workspace(tmp_path), _newcomer_env(tmp_path / "home")
    ordered = [b for b in BLOCKS if b.runnable and b.kind != "repo"]
    assert len(ordered) >= 5
    for block in ordered:
        _run_block(block, ws, env, where=" (run in order, after the blocks above it)")
    _the_4_rank_run_is_tensor_and_pipeline_parallel(ws / "runs" / "tiny-tp2-pp2")


def _the_4_rank_run_is_tensor_and_pipeline_parallel(run: Path) -> None:
    """The README's `dtlaunch up ... tensor=2 ... pipeline=2` (through the local target's launch script): 4 ranks in
    that layout, a falling loss, and the stages' weights gathered over tensor ranks and stages into one file."""
    import json

    from safetensors.torch import load_file

    from launcher.catalog import PRESETS
    from launcher.plan.params import count_params

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    start = [m for m in rows if m.get("event") == "start"][0]
    assert start["layout"]["tp"] == 2 and start["layout"]["pp"] == 2 and start["world_size"] == 4, start
    losses = [m["loss"] for m in rows if "loss" in m]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    weights = load_file(str(run / "model.safetensors"))
    assert sum(t.numel() for t in weights.values()) == count_params(PRESETS["tiny"])


def test_the_shipped_recipes_table_is_what_plan_says(run_cli):
    """The README's table of the shipped recipes: each row's peak moment and per-GPU figure are the ones
    `dtlaunch plan` gives for that recipe (the figures were typed once and drifted)."""
    import json
    import re

    text = (ROOT / "README.md").read_text()
    table = text[text.index("| recipe | layout | peak | planner | trace |") :].split("\n\n")[0].splitlines()[2:]
    assert len(table) >= 4
    for row in table:
        recipe = re.search(r"`([\w.-]+\.yaml)`", row).group(1)
        documented = re.search(r"([\d.]+) per GPU|([\d.]+) GB per GPU", row)
        code, out, err = run_cli("plan", ROOT / "recipes" / recipe)
        assert code == 0, out + err
        printed = re.search(r"fits: ([\d.]+) GB of", out).group(1)
        assert (documented.group(1) or documented.group(2)) == printed, (recipe, row, printed)
        code, out, err = run_cli("plan", ROOT / "recipes" / recipe, "--json")
        peak = json.loads(out)["memory"]["peak_at"]
        assert row.split("|")[3].strip() == peak, (recipe, row, peak)


def test_the_readme_recipe_is_one_validate_accepts():
    """The recipe a reader copies from "The recipe" section loads, plans and validates with no error (one written
    from the README used to plan as "fits" and then be refused by validate)."""
    import re

    from launcher.plan import make_plan
    from launcher.recipe import load_text
    from launcher.validate import validate

    text = (ROOT / "README.md").read_text()
    section = text[text.index("### The recipe") :]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    recipe = load_text(block, "README.md (The recipe)")
    errors = [f for f in validate(recipe, make_plan(recipe)) if f.severity == "error"]
    assert not errors, [f"{f.rule}: {f.message}" for f in errors]
