"""`make demo`: a first run that installs only core + [train], says what it is doing step by step, and runs
only real dtlaunch commands that need nothing beyond [train].

No network and no install: scripts/demo.sh runs for real, in a scratch directory, against a stand-in venv whose
`python` and `dtlaunch` record how they were called (so what pip would install, and each dtlaunch command, is
checked exactly). Whether those commands then work with the light install is checked by running plan and both
renders with every optional extra's package made unimportable.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from testpaths import ROOT

SCRIPT = ROOT / "scripts" / "demo.sh"
EXTRAS = ("sky", "submitit", "paramiko", "deepspeed", "transformers")  # what [slurm], [sky], [deepspeed], [hf] bring
STUB = textwrap.dedent(
    """\
    #!/bin/sh
    {{ printf '%s' "$(basename "$0")"; for a in "$@"; do printf '\\037%s' "$a"; done; printf '\\n'; }} >> '{log}'
    """
)


def _demo(tmp_path: Path, *, stamp: str | None = None, torch_index: str = ""):
    """Run scripts/demo.sh in tmp_path with a stand-in venv; (stdout, [argv of each python and dtlaunch call])."""
    work, log = tmp_path / "ws", tmp_path / "calls.log"
    work.mkdir(exist_ok=True)
    for name in ("pyproject.toml", "constraints.txt"):  # copies: the stamps are compared with their times
        shutil.copy(ROOT / name, work / name)
    if not (work / "recipes").exists():
        (work / "recipes").symlink_to(ROOT / "recipes")
    bin_dir = work / "venv" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in ("python", "dtlaunch"):
        (bin_dir / tool).write_text(STUB.format(log=log))
        (bin_dir / tool).chmod(0o755)
    if stamp:
        later = time.time() + 10
        (work / "venv" / stamp).touch()
        os.utime(work / "venv" / stamp, (later, later))
    log.write_text("")
    env = {**os.environ, "VENV": "venv", "TORCH_INDEX": torch_index}
    p = subprocess.run(["bash", str(SCRIPT)], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout, [line.split("\x1f") for line in log.read_text().splitlines()]


def test_make_demo_runs_the_script_and_installs_nothing_else():
    """`make -n -B demo`: every recipe make would run for the demo (-B: as if every stamp were stale), so a
    prerequisite that installs the full set ([all], DeepSpeed, SkyPilot) shows up here."""
    # --no-print-directory: under `make check` (a make of its own) the nested make would say where it runs
    p = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].endswith("bash scripts/demo.sh"), p.stdout
    for word in ("pip", "[all", "deepspeed", "skypilot", "[dev"):
        assert word not in p.stdout.lower()


def test_a_cold_demo_installs_torch_then_core_and_train_only_with_numbered_timed_steps(tmp_path):
    out, calls = _demo(tmp_path)
    pips = [c[1:] for c in calls if c[0] == "python"]
    assert pips == [
        ["-m", "pip", "install", "-q", "-c", "constraints.txt", "torch==2.13.0"],
        ["-m", "pip", "install", "-q", "-c", "constraints.txt", "-e", ".[train]"],
    ]
    steps = re.findall(r"^\[(\d)/(\d)\] (.*) \.\.\.$", out, re.M)
    assert [(n, total) for n, total, _ in steps] == [("1", "4"), ("2", "4"), ("3", "4"), ("4", "4")], out
    assert steps[0][2].startswith("installing torch (CPU)") and steps[1][2].startswith(
        "installing dtlaunch (core + train"
    )
    assert len(re.findall(r"^ +done in \d+ s$", out, re.M)) == 4 and re.search(r"^demo done in \d+ s", out, re.M)
    assert (tmp_path / "ws" / "venv" / ".installed-demo").exists()  # its own stamp: `make install` still runs


def test_torch_index_is_passed_to_the_torch_install_only(tmp_path):
    _, calls = _demo(tmp_path, torch_index="https://download.pytorch.org/whl/cpu")
    torch_call, dtlaunch_call = (c for c in calls if c[0] == "python")
    assert torch_call[-3:] == ["--index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0"]
    assert "--index-url" not in dtlaunch_call


@pytest.mark.parametrize("stamp", [".installed-demo", ".installed"])
def test_an_installed_venv_is_not_installed_again(tmp_path, stamp):
    """After the demo's own install, or after `make install` (its stamp, .installed), the demo only runs."""
    out, calls = _demo(tmp_path, stamp=stamp)
    assert [c for c in calls if c[0] == "python"] == []
    assert re.findall(r"^\[(\d)/4\] (.*)$", out, re.M)[:2] == [
        ("1", "torch (CPU): already installed in venv (skipped)"),
        ("2", "dtlaunch (core + train): already installed in venv (skipped)"),
    ]
    assert re.findall(r"^\[(\d)/4\]", out, re.M) == ["1", "2", "3", "4"]
    assert len(re.findall(r"^ +done in \d+ s$", out, re.M)) == 2  # the two steps that ran


def test_a_stamp_older_than_pyproject_installs_again(tmp_path):
    _demo(tmp_path)
    stamp = tmp_path / "ws" / "venv" / ".installed-demo"
    os.utime(stamp, (time.time() - 3600, time.time() - 3600))
    _, calls = _demo(tmp_path)
    assert len([c for c in calls if c[0] == "python"]) == 2


def test_every_dtlaunch_command_of_the_demo_is_a_real_command_with_valid_arguments(tmp_path):
    """Each call parses with the real CLI (command, options, arguments): a renamed command or option fails."""
    from launcher.cli import cli

    _, calls = _demo(tmp_path, stamp=".installed-demo")
    argvs = [c[1:] for c in calls if c[0] == "dtlaunch"]
    assert [a[0] for a in argvs] == ["plan", "render", "render", "up", "up", "status", "plot"]
    assert {"slurm", "sky"} == {a[a.index("--target") + 1] for a in argvs if a[0] == "render"}
    for argv in argvs:
        ctx = cli.make_context("dtlaunch", list(argv))
        name, cmd, rest = cli.resolve_command(ctx, [*ctx.protected_args, *ctx.args])
        assert cmd is not None and name in cli.commands
        cmd.make_context(name, rest, parent=ctx)  # raises click's UsageError on an unknown option or argument


def test_plan_and_both_renders_need_no_extra_beyond_train(tmp_path):
    """The demo's plan and renders, in a process where SkyPilot, submitit, paramiko, DeepSpeed and transformers
    cannot be imported (as after the demo's light install): each succeeds and writes its files."""
    code = textwrap.dedent(
        f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {EXTRAS!r}:
                    raise ImportError(f"{{name}} is not installed (blocked by the test)")
        sys.meta_path.insert(0, Block())
        from launcher.cli import cli
        for args in (["plan", "recipes/llama70b.yaml"],
                     ["render", "recipes/llama70b.yaml", "--target", "slurm", "-o", "out/slurm"],
                     ["render", "recipes/llama70b.yaml", "--target", "sky", "-o", "out/sky"]):
            cli.main(args, "dtlaunch", standalone_mode=False)
        print("imported:", sorted(m for m in sys.modules if m.split(".")[0] in {EXTRAS!r}))
        """
    )
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "imported: []" in p.stdout
    assert (tmp_path / "out" / "slurm").is_dir() and (tmp_path / "out" / "sky" / "task.yaml").is_file()
