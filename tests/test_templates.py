"""The generated shell: every value enters a template through a quoting filter, every rendered script passes
`bash -n` and shellcheck, and golden files show any change to a rendered script as a reviewable diff.

Update the golden files after an intended change with: DTLAUNCH_UPDATE_GOLDEN=1 make test
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.plan import make_plan
from launcher.recipe import load
from launcher.render import render
from testpaths import RECIPES, ROOT

TEMPLATES = ROOT / "launcher" / "render" / "templates"
GOLDEN = Path(__file__).parent / "golden"
# A value may enter a script only through a filter that quotes it for its context, or be one of our own
# exit-code constants. `verbatim` is the one deliberate exception: targets.*.setup lines, run as written.
FILTERS = ("q", "cmd", "sbatch", "envname", "verbatim", "int")
EXPR = re.compile(r"{{-?(.*?)-?}}", re.S)


def test_every_template_value_goes_through_a_quoting_filter():
    unsafe = []
    for t in sorted(TEMPLATES.glob("*.j2")):
        for expr in EXPR.findall(t.read_text()):
            e = expr.strip()
            last = e.rsplit("|", 1)
            if len(last) == 2 and last[1].strip().split("(")[0] in FILTERS:
                continue
            if re.fullmatch(r"code\.[A-Z]+", e):
                continue
            if re.fullmatch(r'"" if value is none else "=" ~ value\|sbatch', e):  # #SBATCH name[=value]
                continue
            unsafe.append(f"{t.name}: {{{{ {e} }}}}")
    assert not unsafe, "values inserted without a quoting filter:\n" + "\n".join(unsafe)


def _scripts(recipe: str, target: str, overrides=()) -> dict[str, str]:
    r = load(RECIPES / f"{recipe}.yaml", list(overrides))
    art = render(r, make_plan(r), target)
    if target == "sky":
        task = yaml.safe_load(art.files["task.yaml"])
        return {"task.yaml": art.files["task.yaml"], "setup.sh": task["setup"], "run.sh": task["run"]}
    return {name: art.files[name] for name in ("job.sbatch", "step.sh", "launch.sh") if name in art.files}


CASES = [("tiny", "local", ()), ("tiny", "slurm", ()), ("tiny", "sky", ()), ("llama70b", "slurm", ()),
         ("llama70b", "sky", ()), ("llama2-13b-zero3", "slurm", ()), ("llama3-405b", "slurm", ()),
         ("llama3-405b", "sky", ()),
         ("tiny", "sky", ("resources.nodes=2", "parallelism.strategy=zero2", "parallelism.launcher=deepspeed",
                          "targets.sky.checkpoint_storage={bucket: 's3://b/c'}"))]


@pytest.mark.parametrize("recipe,target,overrides", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_rendered_scripts_pass_bash_n_and_shellcheck(recipe, target, overrides, tmp_path):
    for name, text in _scripts(recipe, target, overrides).items():
        if name == "task.yaml":
            continue
        p = tmp_path / name
        p.write_text(text if text.startswith("#!") else "#!/usr/bin/env bash\n" + text)
        r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        r = subprocess.run(["shellcheck", "-S", "warning", "-s", "bash", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, f"{name}:\n{r.stdout}"


@pytest.mark.parametrize("recipe,target,overrides", CASES[:8], ids=[f"{c[0]}-{c[1]}" for c in CASES[:8]])
def test_rendered_scripts_match_the_golden_files(recipe, target, overrides):
    for name, text in _scripts(recipe, target, overrides).items():
        text = text.replace(sys.executable, "<python that rendered>")
        golden = GOLDEN / f"{recipe}-{target}" / name
        if os.environ.get("DTLAUNCH_UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert golden.is_file(), f"no golden file {golden}: run with DTLAUNCH_UPDATE_GOLDEN=1 and review the diff"
        assert text == golden.read_text(), (f"{name} of {recipe} for {target} changed; if intended, regenerate the "
                                            "golden files with DTLAUNCH_UPDATE_GOLDEN=1 and review `git diff tests/golden`")


def _render_in_child(tmp_path: Path, tmpdir: Path) -> subprocess.CompletedProcess:
    """`render` in a fresh interpreter whose temp dir is `tmpdir` (tempfile reads TMPDIR once per process)."""
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    return subprocess.run([sys.executable, "-m", "launcher.cli", "render", str(RECIPES / "llama70b.yaml"),
                           "--target", "slurm", "-o", str(out), "-q"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(tmpdir)}, timeout=120)


def test_compiled_templates_are_cached_per_user_and_a_bad_cache_dir_only_costs_time(tmp_path):
    """Jinja's bytecode cache: the second render reads the compiled templates the first one wrote (into a
    0700 directory of this user), and gives the same scripts; a cache directory that cannot be used (here
    a plain file in its place) leaves `render` working and its output the same."""
    good, bad = tmp_path / "tmp-good", tmp_path / "tmp-bad"
    good.mkdir()
    bad.mkdir()
    runs = tmp_path / "runs"
    runs.mkdir()
    first = _render_in_child(runs, good)
    assert first.returncode == 0, first.stderr
    cache = good / f"_jinja2-cache-{os.getuid()}"
    entries = sorted(cache.glob("*.cache"))
    assert entries and (cache.stat().st_mode & 0o777) == 0o700
    stamps = {e: e.stat().st_mtime_ns for e in entries}
    second = _render_in_child(runs, good)
    assert second.returncode == 0, second.stderr
    assert {e: e.stat().st_mtime_ns for e in entries} == stamps  # read, not rewritten
    (bad / f"_jinja2-cache-{os.getuid()}").write_text("not a directory")
    third = _render_in_child(runs, bad)
    assert third.returncode == 0, third.stderr
    outs = sorted(runs.iterdir())
    scripts = [(d / "job.sbatch").read_text() for d in outs]
    assert scripts[0] == scripts[1] == scripts[2]
