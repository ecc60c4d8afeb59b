"""The generated shell: every value enters a template through a quoting filter, every DTLAUNCH_ name a template
spells is one launcher/jobenv.py defines, every rendered script passes `bash -n` and shellcheck, and golden
files show any change to a rendered script as a reviewable diff.

Update the golden files after an intended change with: DTLAUNCH_UPDATE_GOLDEN=1 make test
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import yaml

from launcher import jobenv
from launcher.plan import make_plan
from launcher.recipe import load
from launcher.render import render
from launcher.render.template_filters import FILTERS as FILTER_TABLE
from launcher.render.template_filters import whole
from launcher.render.templates import render_template
from testpaths import RECIPES, ROOT

# The shared partials and each target's own templates, which one loader searches.
TEMPLATES = sorted(
    t
    for d in (ROOT / "launcher" / "render" / "templates", *(ROOT / "launcher" / "targets").glob("*/templates"))
    for t in d.glob("*.j2")
)
GOLDEN = Path(__file__).parent / "golden"
# A value may enter a script only through a filter that quotes it for its context, or be one of our own
# constants: an exit code, or an environment variable's name from launcher/jobenv.py. `verbatim` is the one
# deliberate exception: targets.*.setup lines, run as written.
FILTERS = tuple(FILTER_TABLE)
EXPR = re.compile(r"{{-?(.*?)-?}}", re.S)


def test_every_template_value_goes_through_a_quoting_filter():
    unsafe = []
    for t in TEMPLATES:
        for expr in EXPR.findall(t.read_text()):
            e = expr.strip()
            last = e.rsplit("|", 1)
            if len(last) == 2 and last[1].strip().split("(")[0] in FILTERS:
                continue
            if re.fullmatch(r"code\.[A-Z]+", e):
                continue
            if re.fullmatch(r"jobenv\.[A-Z_]+", e) and re.fullmatch(r"[A-Z_][A-Z0-9_]*", getattr(jobenv, e[7:], "")):
                continue
            if re.fullmatch(r'"" if value is none else "=" ~ value\|sbatch', e):  # #SBATCH name[=value]
                continue
            unsafe.append(f"{t.name}: {{{{ {e} }}}}")
    assert not unsafe, "values inserted without a quoting filter:\n" + "\n".join(unsafe)


def test_every_dtlaunch_name_a_template_spells_is_one_jobenv_defines():
    """The shared preamble writes its names as {{ jobenv.RUN_ID }}; the rest of the shell spells them out, so
    a renamed or mistyped variable would otherwise read as unset in the job."""
    known = {v for v in vars(jobenv).values() if isinstance(v, str) and v.startswith("DTLAUNCH_")}
    known |= {n for n in jobenv.ENV_INPUTS if n.startswith("DTLAUNCH_")}
    unknown = {
        f"{t.name}: {name}"
        for t in TEMPLATES
        for name in re.findall(r"DTLAUNCH_[A-Z_]*[A-Z]", t.read_text())
        if name not in known
    }
    assert not unknown, sorted(unknown)


def test_template_names_are_unique_across_the_template_directories():
    """One loader searches the shared directory and every target's: a second template of one name would be
    silently shadowed by the first."""
    names = [t.name for t in TEMPLATES]
    assert len(TEMPLATES) > 10 and len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def _scripts(recipe: str, target: str, overrides=()) -> dict[str, str]:
    r = load(RECIPES / f"{recipe}.yaml", list(overrides))
    art = render(r, make_plan(r), target)
    if target == "sky":
        task = yaml.safe_load(art.files["task.yaml"])
        return {"task.yaml": art.files["task.yaml"], "setup.sh": task["setup"], "run.sh": task["run"]}
    return {
        name: art.files[name]
        for name in ("job.sbatch", "step.sh", "launch.sh", "submitit_setup.sh")
        if name in art.files
    }


SLURM_SETUP = ("targets.slurm.setup=['module load cuda', 'export CUDA_CACHE_DISABLE=1']",)  # run as written
# The user's own code, with an argument, a secret and an env value a shell would misread if unquoted.
ENTRYPOINT = (
    "entrypoint={module: train, workdir: ., args: ['--lr', '1e-3; rm -rf /']}",
    "secrets=[MY_TOKEN]",
    "env={A_B: 'x y $HOME'}",
)
CASES = [
    ("tiny", "local", ()),
    ("tiny", "slurm", ()),
    ("tiny", "sky", ()),
    ("llama70b", "slurm", ()),
    ("llama70b", "sky", ()),
    ("llama2-13b-zero3", "slurm", ()),
    ("llama3-405b", "slurm", ()),
    ("llama3-405b", "sky", ()),
    ("llama3-8b", "sky", ()),
    ("tiny", "sky", ("resources.image=nvcr.io/nvidia/pytorch:24.05-py3",)),
    ("tiny", "slurm", ("resources.image=org/train:1", "targets.slurm.container={runtime: pyxis}")),
    ("tiny", "slurm", ("resources.image=org/train:1", "targets.slurm.container={runtime: apptainer}")),
    (
        "tiny",
        "sky",
        (
            "resources.nodes=2",
            "parallelism.strategy=zero2",
            "parallelism.launcher=deepspeed",
            "targets.sky.checkpoint_storage={bucket: 's3://b/c'}",
        ),
    ),
    (
        "tiny",
        "sky",
        (
            "resources.nodes=2",
            "parallelism.strategy=zero2",
            "parallelism.launcher=deepspeed",
            "targets.sky.deepspeed_ssh=true",
            "targets.sky.checkpoint_storage={bucket: 's3://b/c'}",
        ),
    ),
    ("tiny", "slurm", ("targets.slurm.submit=submitit", *SLURM_SETUP)),
    ("tiny", "sky", ("targets.sky.setup=['pip install foo']", "checkpoint.dir=/ckpt/{run_id}")),
    *(("tiny", target, ENTRYPOINT) for target in ("local", "slurm", "sky")),
]


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
        assert text == golden.read_text(), (
            f"{name} of {recipe} for {target} changed; if intended, regenerate the "
            "golden files with DTLAUNCH_UPDATE_GOLDEN=1 and review `git diff tests/golden`"
        )


def test_a_value_the_renderer_did_not_pass_is_an_error_not_an_empty_word():
    with pytest.raises(jinja2.UndefinedError, match="'job_script' is undefined"):
        render_template("slurm_step.sh.j2")
    # Jinja's own `int` filter reads "8080" as 8080 and "x" as 0: a wrong port, silently. Ours refuses text.
    assert whole(8080) == 8080 and whole(90.0) == 90
    for bad in ("8080", "x", True, None):
        with pytest.raises(TypeError, match="needs a number"):
            whole(bad)
