"""The user's own training code (recipe `entrypoint`): what the recipe accepts, what is shipped with the job,
how every target starts it, and - on real torchrun runs of the rendered local script - the environment
contract it sees and the exit codes the job scripts get from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from launcher.errors import DtlaunchError, RecipeError
from launcher.plan import make_plan
from launcher.recipe import load
from launcher.render import code as codemod
from launcher.render import render
from launcher.validate import validate

BASE = {
    "name": "mine",
    "model": {"preset": "tiny"},
    "resources": {"accelerator": "cpu:2"},
    "training": {"steps": 4, "micro_batch": 2},
}


def write_recipe(d: Path, entrypoint: dict | None, **extra) -> Path:
    doc = {**BASE, **extra}
    if entrypoint is not None:
        doc["entrypoint"] = entrypoint
    p = d / "recipe.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def project(tmp_path: Path, script: str = "print('hi')\n") -> Path:
    d = tmp_path / "proj"
    d.mkdir()
    (d / "train.py").write_text(script)
    return d


# ----------------------------------------------------------------------------- the recipe


@pytest.mark.parametrize(
    "ep, words",
    [
        ({}, "exactly one of entrypoint.script"),
        ({"script": "a.py", "module": "a"}, "exactly one of entrypoint.script"),
        ({"script": "/abs/train.py"}, "relative to entrypoint.workdir"),
        ({"script": "../outside.py"}, "relative to entrypoint.workdir"),
        ({"script": "train.sh"}, "a Python file"),
        ({"module": "my-pkg.train"}, "is not a module name"),
        ({"module": "pkg.train", "args": ["ok", "bad\x00arg"]}, "NUL"),
    ],
)
def test_bad_entrypoints_are_located_errors(tmp_path, ep, words):
    p = write_recipe(tmp_path, ep)
    with pytest.raises(RecipeError) as e:
        load(p)
    text = str(e.value)
    assert words in text and str(p) in text and "entrypoint" in text


def test_trainer_rules_are_silent_for_user_code_and_a_missing_script_is_an_error(tmp_path):
    d = project(tmp_path)
    # A model given only by its size: dtlaunch's trainer could not build it; the user's code does.
    doc_model = {"model": {"params": 1_000_000, "layers": 2, "hidden": 64}}
    p = write_recipe(d, {"script": "train.py"}, **doc_model)
    r = load(p)
    rules = {f.rule for f in validate(r, make_plan(r), "local")}
    assert "runtime-shape" not in rules and "entrypoint-missing" not in rules
    p = write_recipe(d, None, **doc_model)
    r = load(p)
    assert "runtime-shape" in {f.rule for f in validate(r, make_plan(r), "local")}  # the same model, our trainer
    p = write_recipe(d, {"script": "nested/missing.py"})
    r = load(p)
    found = [f for f in validate(r, make_plan(r), "local") if f.rule == "entrypoint-missing"]
    assert found and found[0].severity == "error" and "nested/missing.py" in found[0].message
    assert found[0].file == str(p) and found[0].line is not None


# ----------------------------------------------------------------------------- what is shipped


def test_only_code_is_shipped(tmp_path):
    d = project(tmp_path)
    (d / "pkg").mkdir()
    (d / "pkg" / "__init__.py").write_text("")
    (d / "pkg" / "model.py").write_text("X = 1\n")
    for junk in (
        ".git/HEAD",
        "__pycache__/train.cpython-311.pyc",
        ".venv/bin/python",
        "rendered/x/launch.sh",
        "data/shard0.bin",
        "notes.swp",
        "pkg.egg-info/PKG-INFO",
        "runs/r/metrics.jsonl",
    ):
        (d / junk).parent.mkdir(parents=True, exist_ok=True)
        (d / junk).write_text("junk")
    (d / "linked_dir").symlink_to(tmp_path, target_is_directory=True)  # a loop, if followed
    p = write_recipe(d, {"script": "train.py", "exclude": ["data/*"]})
    files = codemod.collect(load(p))
    assert sorted(files) == ["code/pkg/__init__.py", "code/pkg/model.py", "code/recipe.yaml", "code/train.py"]
    assert files["code/pkg/model.py"] == b"X = 1\n"


def test_shipping_limits_and_errors_name_the_field_and_the_fix(tmp_path, monkeypatch):
    d = project(tmp_path)
    (d / "weights.bin").write_bytes(os.urandom(3 << 20))
    p = write_recipe(d, {"script": "train.py"})
    monkeypatch.setattr(codemod, "MAX_BYTES", 2 << 20)
    with pytest.raises(DtlaunchError) as e:
        codemod.collect(load(p))
    assert "entrypoint.workdir" in str(e.value) and "weights.bin (3.0 MiB)" in str(e.value)
    assert "entrypoint.exclude" in (e.value.fix or "")
    monkeypatch.setattr(codemod, "MAX_BYTES", 64 << 20)
    monkeypatch.setattr(codemod, "MAX_FILES", 3)
    for i in range(5):
        (d / f"m{i}.py").write_text("")
    with pytest.raises(DtlaunchError, match="more than 3 files"):
        codemod.collect(load(p))
    monkeypatch.setattr(codemod, "MAX_FILES", 5000)
    p = write_recipe(d, {"script": "train.py", "exclude": ["train.py"]})
    with pytest.raises(DtlaunchError, match=r"train.py is not in .*\(it is excluded\)"):
        codemod.collect(load(p))
    p = write_recipe(d, {"script": "train.py", "workdir": "no/such/dir"})
    with pytest.raises(DtlaunchError, match="is not a directory"):
        codemod.collect(load(p))


def test_workdir_is_relative_to_the_recipe_not_the_working_directory(tmp_path, monkeypatch):
    project(tmp_path)
    (tmp_path / "recipes").mkdir()
    p = tmp_path / "recipes" / "r.yaml"
    p.write_text(yaml.safe_dump({**BASE, "entrypoint": {"script": "train.py", "workdir": "../proj"}}))
    monkeypatch.chdir("/")
    files = codemod.collect(load(p))
    assert "code/train.py" in files and not any("recipes" in f for f in files)


# ----------------------------------------------------------------------------- how each target starts it


@pytest.mark.parametrize("target", ["local", "slurm", "sky"])
def test_every_target_ships_and_starts_the_code(tmp_path, target):
    d = project(tmp_path)
    hostile = "it's $(touch pwned); `x`"
    p = write_recipe(d, {"script": "train.py", "args": ["--note", hostile]})
    r = load(p)
    art = render(r, make_plan(r), target)
    assert "code/train.py" in art.files
    scripts = "\n".join(t for t in art.files.values() if isinstance(t, str))
    assert "launcher.runtime.entry" in scripts and "launcher.runtime.train" not in scripts.replace(
        "-m launcher.runtime.train --plan", ""
    )
    assert 'cd "$DTLAUNCH_CODE_DIR"' in scripts
    assert "'it'\"'\"'s $(touch pwned); `x`'" in scripts  # one literal word, never run


def test_deepspeed_launcher_runs_the_module_with_its_arguments(tmp_path):
    d = project(tmp_path)
    (d / "pkg").mkdir()
    (d / "pkg" / "__init__.py").write_text("")
    (d / "pkg" / "train.py").write_text("")
    p = write_recipe(
        d,
        {"module": "pkg.train", "args": ["--epochs", "3"]},
        parallelism={"strategy": "zero2", "launcher": "deepspeed"},
    )
    r = load(p)
    run = yaml.safe_load(render(r, make_plan(r), "sky").files["task.yaml"].split("\n", 2)[2])["run"]
    assert "--module launcher.runtime.entry --module pkg.train --epochs 3" in run


# ----------------------------------------------------------------------------- real runs of the rendered script

CONTRACT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from helper import MARK                      # a sibling module: sys.path as for `python train.py`
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    keys = ["DTLAUNCH_PLAN", "DTLAUNCH_RUN_DIR", "DTLAUNCH_CHECKPOINT_DIR", "DTLAUNCH_RUN_ID", "DTLAUNCH_CODE_DIR",
            "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    out = {k: os.environ.get(k) for k in keys}
    out.update(argv=sys.argv, cwd=os.getcwd(), mark=MARK, name=__name__)
    with open(os.path.join(os.environ["DTLAUNCH_RUN_DIR"], f"contract-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    how = os.environ.get("HOW_TO_END", "ok")
    if how == "code":
        sys.exit(int(os.environ["END_CODE"]))
    if how == "fail":                            # rank 1 raises, rank 0 stops with a message
        if rank == 1:
            raise RuntimeError("boom in user code")
        sys.exit("stopping: no data")
""")


def run_launch(out: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(out / "launch.sh")],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "DTLAUNCH_PORT": "", **env},
        cwd="/",
    )


def codes(out: Path) -> list[int]:
    files = sorted(out.glob("status/*/rank-*.code"), key=lambda f: f.stat().st_mtime)
    return [int(f.read_text().split()[0]) for f in files[-2:]]


@pytest.mark.slow
def test_local_script_sees_the_contract_and_its_exit_codes_drive_the_job(tmp_path):
    d = project(tmp_path, CONTRACT_SCRIPT)
    (d / "helper.py").write_text("MARK = 'sibling import ok'\n")
    args = ["--lr", "3e-4", "two words", "--flag=$HOME"]
    # No torchrun restarts: the codes are what is tested here (a failed rank is restarted up to 3 times by default,
    # which tests/runtime and tests/slurm cover).
    p = write_recipe(d, {"script": "train.py", "args": args}, targets={"local": {"max_restarts": 0}})
    out = tmp_path / "out"
    r = load(p)
    render(r, make_plan(r), "local").write(out)
    res = run_launch(out)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = [json.loads((out / f"contract-{i}.json").read_text()) for i in range(2)]
    for i, s in enumerate(seen):
        assert s["argv"] == ["train.py", *args] and s["name"] == "__main__" and s["mark"] == "sibling import ok"
        assert s["cwd"] == str(out / "code") == s["DTLAUNCH_CODE_DIR"]
        assert s["WORLD_SIZE"] == "2" and s["LOCAL_RANK"] == str(i) and s["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
        plan = json.loads(Path(s["DTLAUNCH_PLAN"]).read_text())
        assert plan["recipe"]["entrypoint"]["script"] == "train.py"
        assert s["DTLAUNCH_RUN_ID"] == "mine" and s["DTLAUNCH_CHECKPOINT_DIR"] == str(out / "checkpoints")
    # The job's exit code is the ranks' own: 42 (preempted after a checkpoint) reaches the job script,
    # where torchrun alone would say 1.
    res = run_launch(out, HOW_TO_END="code", END_CODE="42")
    assert res.returncode == 42 and codes(out) == [42, 42], res.stderr[-2000:]
    # Both ways a script fails end the job with 1, each saying why (one launch for the two: a rank each).
    res = run_launch(out, HOW_TO_END="fail")
    assert res.returncode == 1 and "boom in user code" in res.stderr and "Traceback" in res.stderr, res.stderr[-3000:]
    assert "stopping: no data" in res.stderr, res.stderr[-3000:]


@pytest.mark.slow
def test_local_module_entrypoint_and_a_missing_module_fails_once_with_config(tmp_path):
    d = project(tmp_path)
    (d / "pkg").mkdir()
    (d / "pkg" / "__init__.py").write_text("")
    (d / "pkg" / "train.py").write_text(
        textwrap.dedent("""
        import os, sys
        if __name__ == "__main__":
            open(os.path.join(os.environ["DTLAUNCH_RUN_DIR"], "ran-" + os.environ["RANK"]), "w").write(" ".join(sys.argv[1:]))
    """)
    )
    p = write_recipe(d, {"module": "pkg.train", "args": ["a", "b c"]})
    out = tmp_path / "out"
    r = load(p)
    render(r, make_plan(r), "local").write(out)
    res = run_launch(out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [(out / f"ran-{i}").read_text() for i in range(2)] == ["a b c", "a b c"]
    p = write_recipe(d, {"module": "pkg.nope"})
    r = load(p)
    render(r, make_plan(r), "local").write(out)
    res = run_launch(out)
    assert res.returncode == 2 and "entrypoint module pkg.nope cannot be imported" in res.stderr
    assert not list(out.glob("ran-*")) or all((out / f"ran-{i}").exists() for i in range(2))


def test_entry_runner_maps_endings_like_the_interpreter(tmp_path, monkeypatch):
    """launcher.runtime.entry in-process: the exit statuses `python script.py` would give."""
    from launcher.runtime import entry

    monkeypatch.chdir(tmp_path)
    for body, want in [
        ("pass", 0),
        ("import sys; sys.exit(3)", 3),
        ("import sys; sys.exit(None)", 0),
        ("import sys; sys.exit(300)", 300 & 0xFF),
        ("raise ValueError('x')", 1),
        ("import sys; sys.exit('why')", 1),
    ]:
        (tmp_path / "s.py").write_text(body + "\n")
        code, _ = entry.run("s.py", [], module=False)
        assert code == want, body
    code, message = entry.run("absent.py", [], module=False)
    assert code == 2 and "absent.py" in message
    assert subprocess.run([sys.executable, "-m", "launcher.runtime.entry"], capture_output=True).returncode == 2
