"""The generated shell: every value enters a template through a quoting filter, every rendered script passes
`bash -n` and shellcheck, golden files show any change to a rendered script as a reviewable diff, and the
compiled templates `render` runs say what Jinja says of the same .j2 files.

Update the golden files after an intended change with: DTLAUNCH_UPDATE_GOLDEN=1 make test
"""
from __future__ import annotations

import importlib.util
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
from launcher.render.template_filters import FILTERS as FILTER_TABLE
from testpaths import RECIPES, ROOT

TEMPLATES = ROOT / "launcher" / "render" / "templates"
GOLDEN = Path(__file__).parent / "golden"
# A value may enter a script only through a filter that quotes it for its context, or be one of our own
# exit-code constants. `verbatim` is the one deliberate exception: targets.*.setup lines, run as written.
FILTERS = tuple(FILTER_TABLE)
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
         ("llama3-405b", "sky", ()), ("llama3-8b", "sky", ()),
         ("tiny", "sky", ("resources.image=nvcr.io/nvidia/pytorch:24.05-py3",)),
         ("tiny", "slurm", ("resources.image=org/train:1", "targets.slurm.container={runtime: pyxis}")),
         ("tiny", "slurm", ("resources.image=org/train:1", "targets.slurm.container={runtime: apptainer}")),
         ("tiny", "sky", ("resources.nodes=2", "parallelism.strategy=zero2", "parallelism.launcher=deepspeed",
                          "targets.sky.checkpoint_storage={bucket: 's3://b/c'}")),
         ("tiny", "sky", ("resources.nodes=2", "parallelism.strategy=zero2", "parallelism.launcher=deepspeed",
                          "targets.sky.deepspeed_ssh=true", "targets.sky.checkpoint_storage={bucket: 's3://b/c'}"))]


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


# ---- the compiled templates: what `render` runs is what Jinja would say of the same .j2 files

def _compiler():
    """scripts/compile_templates.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("compile_templates", ROOT / "scripts" / "compile_templates.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _recipe_with_entrypoint(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    doc = yaml.safe_load((RECIPES / "tiny.yaml").read_text())
    doc["entrypoint"] = {"script": "train.py", "args": ["--lr", "1e-3; rm -rf /"]}
    doc["secrets"] = ["MY_TOKEN"]
    doc["env"] = {"A_B": "x y $HOME"}
    p = tmp_path / "ep.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


SLURM_SETUP = ("targets.slurm.setup=['module load cuda', 'source ~/venv/bin/activate']",)
EQUIVALENCE = [*((RECIPES / f"{c[0]}.yaml", c[1], c[2]) for c in CASES),
               (RECIPES / "tiny.yaml", "slurm", ("targets.slurm.submit=submitit", *SLURM_SETUP)),
               (RECIPES / "tiny.yaml", "slurm", ("targets.slurm.container={runtime: pyxis, image: /s/t.sqsh, "
                                                 "mounts: ['/data:/data:ro']}",)),
               (RECIPES / "tiny.yaml", "slurm", ("targets.slurm.container={runtime: apptainer, image: /s/t.sif}",
                                                 "targets.slurm.submit=submitit")),
               (RECIPES / "tiny.yaml", "sky", ("targets.sky.setup=['pip install foo']",)),
               ("entrypoint", "local", ()), ("entrypoint", "slurm", SLURM_SETUP), ("entrypoint", "sky", ())]


def test_compiled_templates_render_what_jinja_renders(tmp_path, monkeypatch):
    """Every template call of many renders (each target, containers, submitit, setup lines, secrets, an
    entrypoint), recorded with its context, then rendered again by Jinja itself from the .j2 file."""
    from launcher.render import compiled_templates

    calls: list[tuple[str, dict]] = []
    for name, fn in list(compiled_templates.TEMPLATES.items()):
        def recording(c, w, name=name, fn=fn):
            calls.append((name, dict(c)))
            return fn(c, w)
        monkeypatch.setitem(compiled_templates.TEMPLATES, name, recording)
    for recipe, target, overrides in EQUIVALENCE:
        path = _recipe_with_entrypoint(tmp_path) if recipe == "entrypoint" else recipe
        r = load(path, list(overrides))
        render(r, make_plan(r), target)
    monkeypatch.undo()
    used = {name for name, _ in calls}
    assert used == {p.name for p in TEMPLATES.glob("*.j2") if not p.name.startswith("_")}, used
    env = _compiler().environment()
    env.filters.update(FILTER_TABLE)
    from launcher.render.templates import render_template
    for name, context in calls:
        assert render_template(name, **context) == env.get_template(name).render(**context), name


def test_the_compiled_module_is_up_to_date_and_the_check_sees_a_changed_template(tmp_path):
    """`--check` passes on this checkout, and fails once a template changes, until the module is rebuilt."""
    r = subprocess.run([sys.executable, "scripts/compile_templates.py", "--check"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    tree = tmp_path / "repo"
    (tree / "scripts").mkdir(parents=True)
    (tree / "scripts" / "compile_templates.py").write_text((ROOT / "scripts" / "compile_templates.py").read_text())
    render_dir = tree / "launcher" / "render"
    render_dir.mkdir(parents=True)
    (render_dir / "compiled_templates.py").write_text((ROOT / "launcher/render/compiled_templates.py").read_text())
    (render_dir / "templates").mkdir()
    for t in TEMPLATES.glob("*.j2"):
        (render_dir / "templates" / t.name).write_text(t.read_text())
    step = render_dir / "templates" / "slurm_step.sh.j2"
    step.write_text(step.read_text() + "echo {{ job_dir|q }}\n")

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(tree / "scripts/compile_templates.py"), "--check"],
                              capture_output=True, text=True)
    stale = check()
    assert stale.returncode == 1 and "out of date" in stale.stderr and "make templates" in stale.stderr
    assert subprocess.run([sys.executable, str(tree / "scripts/compile_templates.py")]).returncode == 0
    assert check().returncode == 0
    assert "job_dir" in (render_dir / "compiled_templates.py").read_text().rsplit("def t_slurm_step_sh", 1)[1]


@pytest.mark.parametrize("source,words", [
    ("{% macro m() %}x{% endmacro %}", "Macro"),
    ("{{ x|upper }}", "'upper'"),
    ("{% for a in b %}{{ loop.index|int }}{% else %}none{% endfor %}", "for ... else"),
    ("{{ x is even }}", "'even'"),
    ("{% set y = 1 %}", "Assign"),
])
def test_a_construct_the_compiler_does_not_know_is_refused_with_its_line(source, words):
    mod = _compiler()
    tree = mod.environment().parse("\n" + source, "bad.sh.j2")
    with pytest.raises(mod.Unsupported) as e:
        mod.TemplateCompiler("bad.sh.j2", set()).compile(tree)
    assert "bad.sh.j2:2:" in str(e.value) and words in str(e.value)


def test_a_value_the_renderer_did_not_pass_is_an_error_not_an_empty_word():
    from launcher.render.template_filters import MissingValue, whole
    from launcher.render.templates import render_template

    with pytest.raises(MissingValue, match="slurm_step.sh.j2 needs 'job_script'"):
        render_template("slurm_step.sh.j2")
    # Jinja's own `int` filter reads "8080" as 8080 and "x" as 0: a wrong port, silently. Ours refuses text.
    assert whole(8080) == 8080 and whole(90.0) == 90
    for bad in ("8080", "x", True, None):
        with pytest.raises(TypeError, match="needs a number"):
            whole(bad)
