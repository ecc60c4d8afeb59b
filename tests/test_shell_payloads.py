"""Shell payloads in every string field of the recipe (enumerated from the schema), on every target and launcher. Each case ends one of two ways: the loader or
validate refuses it, located (at the field or its --set item), or it renders, and the rendered job, run with bash
against stubs that only record (srun, sbatch, scontrol, squeue, scancel, enroot, apptainer, torchrun, deepspeed,
pdsh, python3), never creates the payload's marker file.

The head-only DeepSpeed launch (targets.sky.deepspeed_ssh) goes on through DeepSpeed's own code: the
.deepspeed_env the script wrote and the arguments it gave DeepSpeed's runner become, with the real
PDSHRunner.add_export/get_cmd, the command pdsh would run on every node; the pdsh stub runs it with bash -c in
a clean environment, and the remote interpreter must receive the head's values unchanged.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec.inspect as mi
import pytest
import yaml

from launcher.errors import DtlaunchError, RecipeError
from launcher.plan import make_plan
from launcher.plan.choices import for_target
from launcher.recipe import Recipe, load
from launcher.render import render
from launcher.validate import validate
from testpaths import RECIPES

TINY = RECIPES / "tiny.yaml"
MARK = "PWNED"  # every payload that runs creates a file of this name (relative: wherever it runs)
PAYLOADS = {
    "subst": f"$(touch {MARK})",
    "backtick": f"`touch {MARK}`",
    "dquote": f'"; touch {MARK}; "',
    "squote": f"'; touch {MARK}; '",
    "newline": f"x\ntouch {MARK}\n",
    "backslash": f'\\"; touch {MARK}; #\\',
    "bare": f";touch${{IFS}}{MARK};",  # no space: what DeepSpeed's pdsh runner leaves unquoted
}
VERBATIM = {"targets.slurm.setup.0", "targets.sky.setup.0"}  # shell lines the recipe runs as written, by design
KEY = "DTL_FUZZ"  # the key a dict field (env, model.hf_config) gets
DS = ["parallelism.strategy=zero2", "parallelism.launcher=deepspeed"]
SSH = "sky-deepspeed-ssh"
# The configurations: every target, the SLURM container and submitit variants, both SkyPilot launchers.
CONFIGS = {
    "local": ("local", []),
    "slurm": ("slurm", []),
    "slurm-pyxis": ("slurm", ["targets.slurm.container={runtime: pyxis, image: /images/train.sqsh}"]),
    "slurm-apptainer": ("slurm", ["targets.slurm.container={runtime: apptainer, image: /images/train.sif}"]),
    "slurm-submitit": ("slurm", ["targets.slurm.submit=submitit"]),
    "sky": ("sky", []),
    "sky-deepspeed": ("sky", DS),
    SSH: ("sky", [*DS, "targets.sky.deepspeed_ssh=true"]),
}


def string_fields() -> list[str]:
    """Every field of the schema that holds free text, as a dotted path ('0': a list's item, KEY: a dict's)."""
    out: list[str] = []

    def walk(t, path):
        if isinstance(t, mi.Metadata):
            walk(t.type, path)
        elif isinstance(t, mi.StructType):
            for f in t.fields:
                walk(f.type, [*path, f.encode_name])
        elif isinstance(t, mi.UnionType):
            for x in t.types:
                walk(x, path)
        elif isinstance(t, mi.ListType):
            walk(t.item_type, [*path, "0"])
        elif isinstance(t, mi.DictType):
            walk(t.value_type, [*path, KEY])
        elif isinstance(t, (mi.StrType, mi.AnyType)) and ".".join(path) not in out:
            out.append(".".join(path))

    walk(mi.type_info(Recipe), [])
    return [f for f in out if f not in VERBATIM]


# ----------------------------------------------------------------------------- recipe overrides


ITEM = {"path": "/data", "source": "s3://b/data"}  # a targets.sky.data_mounts item


def sections(base: Path) -> dict[str, dict]:
    """Optional sections a field needs around it: a minimal valid value of each."""
    return {
        "entrypoint": {"script": "train.py", "workdir": str(base.parent / "code")},
        "targets.slurm.container": {"runtime": "pyxis", "image": "/images/train.sqsh"},
        "targets.slurm.ssh": {"host": "login.example"},
        "targets.sky.checkpoint_storage": {"bucket": "s3://b/ckpt", "mount": str(base / "ck")},
    }


def overrides(field: str, payload: str, base: Path) -> list[str]:
    """--set items that put `payload` into `field`, where a user's text would go, with what the field needs around it
    (its section, a file it names)."""
    ck = base / "ck"
    forms = {  # fields with a shape: the payload is one part of a plausible value
        "checkpoint.dir": f"{ck}/{payload}/{{run_id}}",
        "targets.sky.checkpoint_storage.mount": f"{ck}/{payload}",
        "entrypoint.script": f"{payload}.py",
        "entrypoint.workdir": str(base.parent / "workdirs" / payload),
        "targets.sky.workdir": str(base.parent / "workdirs" / payload),
        "training.data.path": str(base.parent / "data" / payload),
        "model.hf_weights": str(base.parent / "data" / payload),
    }
    value = forms.get(field, payload)
    out = [f"{s}={json.dumps(v)}" for s, v in sections(base).items() if field.startswith(s + ".")]
    if field == "entrypoint.module":
        out.append("entrypoint.script=null")
    if field == "training.data.path":
        out.append("training.data.source=file")
    head, _, rest = field.partition(".0")
    if rest:  # a list of sections: one item, the payload in its field
        out.append(f"{head}={json.dumps([{**ITEM, rest[1:]: value}])}")
    elif field.endswith(".0"):
        out.append(f"{field[:-2]}={json.dumps([value])}")
    else:
        out.append(f"{field}={json.dumps(value)}")
    return out


def make_inputs(root: Path) -> None:
    """The files fields name: the entrypoint's code (a script named after each payload too), workdirs and data
    files named after each payload."""
    code = root / "code"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")
    for p in PAYLOADS.values():
        (code / f"{p}.py").write_text("print('hi')\n")
        (root / "workdirs" / p).mkdir(parents=True)
        (root / "workdirs" / p / "train.py").write_text("print('hi')\n")
        (root / "data").mkdir(exist_ok=True)
        (root / "data" / p).write_bytes(bytes(4096))


def config_overrides(name: str, base: Path) -> list[str]:
    target, extra = CONFIGS[name]
    if target != "sky":
        return list(extra)
    # two nodes (one would make DeepSpeed launch locally, without pdsh), checkpoints on a mounted bucket
    return [
        "resources.nodes=2",
        f"targets.sky.checkpoint_storage={{bucket: 's3://b/ckpt', mount: '{base / 'ck'}'}}",
        *extra,
    ]


# ----------------------------------------------------------------------------- stubs


def make_stubs(root: Path) -> Path:
    """Programs the scripts call, on PATH first. python3 records each call (argv, environment, directory) under
    calls/ and exits 0; `-c` and the value check of the head-only launch run the real interpreter."""
    bin_dir, calls = root / "bin", root / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    record = (
        f'd="$(mktemp -d {calls}/call.XXXXXX)"; printf \'%s\\0\' "$0" "$@" > "$d/argv"; env -0 > "$d/env"; '
        'printf %s "$PWD" > "$d/cwd"'
    )
    stubs = {
        "python3": f"""case "$1" in -c) exec {sys.executable} "$@" ;; esac
[ "${{2:-}}" = launcher.pdsh ] && exec {sys.executable} "$@"
case " $* " in *" --check "*) exit 0 ;; esac
{record}""",
        "srun": 'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done\nexec "$@"',
        "apptainer": """case "$1" in
  pull) touch "$2"; exit 0 ;;
  exec) shift; while [ $# -gt 0 ]; do case "$1" in --nv) shift ;; -*) shift 2 ;; *) break ;; esac; done
        shift; exec "$@" ;;
esac
exit 97""",
        "scontrol": '[ "$1 $2" = "show hostnames" ] && echo node1; exit 0',
        # as ssh would: one shell line, in a fresh environment
        "pdsh": 'while [ $# -gt 0 ]; do case "$1" in -S) shift ;; -f|-w) shift 2 ;; *) break ;; esac; done\n'
        'exec env -i PATH="$PATH" HOME="$HOME" bash -c "$*"',
    }
    for name in ("sbatch", "squeue", "scancel", "enroot", "torchrun", "deepspeed"):
        stubs[name] = record
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    shutil.copy(bin_dir / "python3", bin_dir / "python")
    return bin_dir


@dataclass
class Call:
    argv: list[str]
    env: dict[str, str]
    cwd: str


def recorded(root: Path) -> list[Call]:
    out = []
    for d in sorted((root / "calls").iterdir(), key=lambda p: p.stat().st_mtime_ns):
        env = dict(e.split("=", 1) for e in (d / "env").read_text().split("\0") if "=" in e)
        out.append(Call((d / "argv").read_text().split("\0")[:-1], env, (d / "cwd").read_text()))
    return out


def reset_calls(root: Path) -> None:
    shutil.rmtree(root / "calls")
    (root / "calls").mkdir()


# ----------------------------------------------------------------------------- running what was rendered

SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "node1",
    "SLURM_NNODES": "1",
    "SLURM_CPUS_PER_TASK": "2",
    "SLURMD_NODENAME": "node1",
    "SLURM_NODEID": "0",
}
SKY_ENV = {
    "SKYPILOT_NODE_RANK": "0",
    "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.2",
    "SKYPILOT_NUM_NODES": "2",
    "SKYPILOT_NUM_GPUS_PER_NODE": "0",
    "SKYPILOT_TASK_ID": "sky-2026-11-25-task_7",
}


def run(argv, cwd, env) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def execute(config: str, out: Path, root: Path, extra_env=None) -> list[subprocess.CompletedProcess]:
    """Run the rendered job as its scheduler would (node 0 of SkyPilot; the batch script of SLURM; submitit's own
    batch script, then the step it runs); the processes' results."""
    home = out.parent / "home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": f"{root / 'bin'}:{os.environ['PATH']}",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "DTLAUNCH_PYTHON": str(root / "bin" / "python3"),
        **(extra_env or {}),
    }
    target = CONFIGS[config][0]
    if target == "local":
        return [run(["bash", "launch.sh"], out, env)]
    if target == "sky":
        task = yaml.safe_load((out / "task.yaml").read_text())
        env.update({k: str(v) for k, v in task["envs"].items()}, **SKY_ENV)
        cwd = out
        if task["workdir"] != ".":  # SkyPilot copies the user's project to ~/sky_workdir and mounts the job
            cwd = home / "sky_workdir"
            shutil.copytree(task["workdir"], cwd)
            (home / "dtlaunch-job").symlink_to(out)
        return [run(["bash", "-c", task["run"]], cwd, env)]
    env.update(SLURM_ENV, SLURM_SUBMIT_DIR=str(out))
    if not (out / "submitit.json").exists():
        return [run(["bash", "job.sbatch"], out, env)]
    # submitit: its own batch script (parameters as #SBATCH lines, our setup sourced, then its python), then the
    # step its python runs: the srun words with $VARIABLES from the environment the setup exported
    from submitit.slurm.slurm import _make_sbatch_string

    spec = json.loads((out / "submitit.json").read_text())
    batch = _make_sbatch_string(
        command=f"{spec['python']} -u -m submitit.core._submit {out / spec['folder']}",
        folder=out / spec["folder"],
        setup=[f"source {shlex.quote(str(out / spec['setup_script']))}"],
        **spec["parameters"],
    )
    first = run(["bash", "-c", batch], out, env)
    sub = [c for c in recorded(root) if "submitit.core._submit" in c.argv]
    if first.returncode or not sub:
        return [first]
    step_env = sub[-1].env
    old = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(step_env)
        argv = [os.path.expandvars(w) for w in spec["step"]["srun"]]  # what launcher.targets.slurm.submitit_job does
    finally:
        os.environ.clear()
        os.environ.update(old)
    return [first, run(argv, out, step_env)]


def pdsh_launch(call: Call, root: Path, monkeypatch) -> tuple[subprocess.CompletedProcess, list[str]]:
    """What DeepSpeed's runner does with the head's call (runner.py main, for PDSH): its exports from the
    environment and .deepspeed_env through PDSHRunner.add_export, the command from PDSHRunner.get_cmd (with
    the stub as the interpreter it names), then pdsh; (the result, the user words the head passed)."""
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import (
        EXPORT_ENVS,
        encode_world_info,
        fetch_hostfile,
        parse_args,
        parse_inclusion_exclusion,
    )

    args = parse_args(call.argv[call.argv.index("deepspeed.launcher.runner") + 1 :])
    with monkeypatch.context() as m:
        m.chdir(call.cwd)
        m.setattr(sys, "executable", str(root / "bin" / "python3"))
        active = parse_inclusion_exclusion(fetch_hostfile(args.hostfile), args.include, args.exclude)
        runner = PDSHRunner(args, encode_world_info(active))
        env = dict(call.env)
        env["PYTHONPATH"] = call.cwd + (":" + env["PYTHONPATH"] if "PYTHONPATH" in env else "")
        for var in list(env):  # NCCL: what the CUDA accelerator adds to EXPORT_ENVS on a GPU node
            if any(var.startswith(n) for n in [*EXPORT_ENVS, "NCCL"]):
                runner.add_export(var, env[var])
        with open(".deepspeed_env") as fd:  # runner.py's own reading of it
            for var in fd.readlines():
                key, val = var.split("=", maxsplit=1)
                runner.add_export(key, val)
        cmd, _kill, env = runner.get_cmd(env, active)
    return run(cmd, call.cwd, env), [args.user_script, *args.user_args]


# ----------------------------------------------------------------------------- one case


def located(field: str, items: list[str], where: list[tuple[str | None, str]]) -> bool:
    """A refusal names the field (or a section around it, or a field inside it) or one of its --set items."""

    def near(f: str) -> bool:
        return f == field or field.startswith(f + ".") or f.startswith(field + ".")

    return any(near(f) or file in {f"--set {i[:200]}" for i in items} for file, f in where)


class Harness:
    def __init__(self, root: Path, monkeypatch):
        self.root, self.monkeypatch, self.n = root, monkeypatch, 0
        self.remote: Call | None = None  # the last remote call of the head-only launch
        make_stubs(root)
        make_inputs(root)

    def case(self, config: str, field: str | None, payload: str | None) -> str:
        """'refused', 'rendered' (the payload is data only), 'ran', or 'n/a' (the field's section does not go with
        the configuration); raises AssertionError with the case when a property fails."""
        self.n += 1
        base = self.root / f"case{self.n}"
        base.mkdir()
        target = CONFIGS[config][0]
        items = overrides(field, payload, base) if field else []
        what = f"{config} {field}={payload!r}: {items}"
        try:
            recipe = load(TINY, config_overrides(config, base) + items)
            plan = make_plan(recipe)
            choices = for_target(recipe, plan, target)
            errors = [f for f in validate(recipe, plan, target, choices=choices) if f.severity == "error"]
        except RecipeError as e:
            assert field and located(field, items, [(p.file, p.field) for p in e.problems]), f"{what}: unlocated {e}"
            return "refused"
        except DtlaunchError as e:
            leaf = [s for s in field.split(".") if s not in ("0", KEY)][-1] if field else "?"
            assert leaf in str(e) or any(i in str(e) for i in items), f"{what}: unlocated {e}"
            return "refused"
        if errors:
            if field and not located(field, items, [(f.file, f.field) for f in errors]):
                # the field's section alone may not go with this configuration (targets.slurm.ssh with submitit)
                assert {f.rule for f in errors} <= self.scaffold_errors(config, field, base), (
                    f"{what}: unlocated {errors}"
                )
                return "n/a"
            assert field, errors
            return "refused"
        art = render(recipe, choices.shipped if choices else plan, target, choices)  # validate passed: it renders
        out = art.write(base / "job")
        executable = [
            n
            for n in ("launch.sh", "job.sbatch", "step.sh", "submitit_setup.sh", "submitit.json", "task.yaml")
            if n in art.files
        ]
        if field and not any(MARK in art.files[n] for n in executable):
            shutil.rmtree(base)
            return "rendered"  # the payload is data only (plan.json, recipe.yaml): nothing that runs holds it
        self.run_job(config, out, what)
        shutil.rmtree(base)
        return "ran"

    def scaffold_errors(self, config: str, field: str, base: Path) -> set[str]:
        """The rules the configuration refuses with the field's section and no payload."""
        items = [f"{k}={json.dumps(v)}" for k, v in sections(base).items() if field.startswith(k + ".")]
        r = load(TINY, config_overrides(config, base) + items)
        return {f.rule for f in validate(r, make_plan(r), CONFIGS[config][0]) if f.severity == "error"}

    def run_job(self, config: str, out: Path, what: str, extra_env=None) -> list[subprocess.CompletedProcess]:
        reset_calls(self.root)
        results = execute(config, out, self.root, extra_env)
        log = "\n".join(r.stdout[-1500:] + r.stderr[-1500:] for r in results)
        self.no_marker(out.parent, what + "\n" + log)
        rc = results[-1].returncode
        # it ran to the launch, or stopped on purpose, saying why (never a shell error half way)
        assert rc == 0 or "dtlaunch: error" in log, f"{what}: exit {rc}\n{log}"
        want = "deepspeed.launcher.runner" if CONFIGS[config][1][:2] == DS else "launcher.runtime.elastic"
        launches = [c for c in recorded(self.root) if want in c.argv]
        assert rc != 0 or launches, f"{what}: no launch recorded\n{log}"
        if config == SSH and rc == 0:
            self.check_remote(launches[0], what)
        return results

    def check_remote(self, head: Call, what: str) -> None:
        """The pdsh command ran, and the remote interpreter got the head's values and words unchanged."""
        reset_calls(self.root)
        try:
            p, words = pdsh_launch(head, self.root, self.monkeypatch)
        except ValueError as e:  # runner.py's split of a line without '=': a line break inside a value
            raise AssertionError(f"{what}: DeepSpeed cannot read the .deepspeed_env the script wrote ({e})") from None
        self.no_marker(Path(head.cwd).parent, what)
        (remote,) = recorded(self.root) or [None]
        assert remote is not None, f"{what}: the pdsh command did not reach the interpreter\n{p.stdout}{p.stderr}"
        assert remote.argv[-len(words) :] == words, f"{what}: {remote.argv} does not end with {words}"
        sent = {line.split("=", 1)[0] for line in Path(head.cwd, ".deepspeed_env").read_text().splitlines()}
        for name in sent & {"DTLAUNCH_RUN_ID", "DTLAUNCH_RUN_DIR", "DTLAUNCH_PLAN", "DTLAUNCH_CHECKPOINT_DIR", KEY}:
            assert remote.env.get(name) == head.env.get(name), f"{what}: {name} {remote.env.get(name)!r}"
        self.remote = remote

    def no_marker(self, where: Path, what: str) -> None:
        hits = [p for p in (self.root, Path.cwd(), Path("/"), Path("/tmp")) if (p / MARK).exists()]
        hits += list(where.rglob(MARK))
        assert not hits, f"a payload ran as shell code ({hits}): {what}"


@pytest.fixture
def harness(tmp_path, monkeypatch):
    from launcher.render import package
    from launcher.targets.sky import render as sky
    from launcher.targets.slurm import common as slurm

    wheel = functools.cache(package.build_wheel)  # the same bytes for every render: built once
    monkeypatch.setattr(sky, "build_wheel", wheel)
    monkeypatch.setattr(slurm, "build_wheel", wheel)
    return Harness(tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- the tests


def test_every_configuration_runs_to_its_launch_against_the_stubs(harness):
    """The harness itself: each configuration renders and runs to its launch (and, head-only, through pdsh to
    the remote interpreter), so a case that runs clean means something."""
    for config in CONFIGS:
        assert harness.case(config, None, None) == "ran", config
    # the head-only launch's workers see the job's contract (launcher.init() finds the plan by DTLAUNCH_PLAN)
    assert {"DTLAUNCH_PLAN", "DTLAUNCH_RUN_DIR", "DTLAUNCH_CHECKPOINT_DIR"} <= set(harness.remote.env)
    base = harness.root / "sections"
    for name, value in [*sections(base).items(), ("targets.sky.data_mounts", [ITEM])]:  # the cases' scaffolding
        load(TINY, [f"{name}={json.dumps(value)}"])


def test_shell_payloads_in_every_string_field_are_refused_located_or_stay_data(harness):
    fields = string_fields()
    assert len(fields) >= 50 and "checkpoint.dir" in fields and "env.DTL_FUZZ" in fields, fields
    start, outcomes, problems, names = time.monotonic(), {}, [], list(PAYLOADS)
    for i, field in enumerate(fields):
        for j, config in enumerate(CONFIGS):
            # every payload in every field of the head-only launch (values reach every node's shell there);
            # elsewhere the payloads take turns, so each field meets several and every config all of them
            chosen = names if config == SSH else [names[(i + j) % len(names)]]
            for name in chosen:
                try:
                    outcomes[(field, config, name)] = harness.case(config, field, PAYLOADS[name])
                except AssertionError as e:
                    problems.append(f"[{field} / {config} / {name}] {str(e)[:700]}")
    assert not problems, f"{len(problems)} cases failed:\n" + "\n".join(problems[:40])
    ran = {k for k, v in outcomes.items() if v == "ran"}
    # what must have reached a running script: the fields R06 and the review named, on the head-only launch
    for field in ("checkpoint.dir", "env.DTL_FUZZ", "entrypoint.args.0", "name"):
        assert any(f == field for f, _, _ in ran), (field, sorted(ran)[:20])
    print(
        f"\n{len(outcomes)} cases: {sum(v == 'refused' for v in outcomes.values())} refused, "
        f"{sum(v == 'rendered' for v in outcomes.values())} data only, {len(ran)} run; "
        f"{time.monotonic() - start:.1f} s"
    )


def test_the_head_only_launch_refuses_unsafe_values_at_run_time(harness):
    """What validate cannot see: a run id exported at launch, and a recipe rendered despite validate (--force).
    The script stops before it writes .deepspeed_env, saying why, and nothing runs."""
    base = harness.root / "runtime"
    base.mkdir()
    r = load(TINY, config_overrides(SSH, base))
    out = render(r, make_plan(r), "sky").write(base / "job")
    refused = set()
    for name, payload in PAYLOADS.items():  # run_job: no marker; what runs reaches the remote side unchanged
        (out / ".deepspeed_env").unlink(missing_ok=True)
        res = harness.run_job(SSH, out, f"DTLAUNCH_RUN_ID={payload!r}", {"DTLAUNCH_RUN_ID": payload})
        if res[-1].returncode:
            assert res[-1].returncode == 2 and not (out / ".deepspeed_env").exists(), res[-1].stderr
            assert "DTLAUNCH_RUN_ID" in res[-1].stderr and "deepspeed_ssh" in res[-1].stderr, res[-1].stderr
            refused.add(name)
    assert refused == set(PAYLOADS) - {"squote"}, refused  # single quotes are plain text inside double quotes
    bad_dir = f"{base}/ck/{PAYLOADS['subst']}/{{run_id}}"
    forced = load(TINY, config_overrides(SSH, base) + [f"checkpoint.dir={json.dumps(bad_dir)}"])
    assert any(f.rule == "deepspeed-ssh-values" for f in validate(forced, make_plan(forced), "sky"))
    out = render(forced, make_plan(forced), "sky").write(base / "forced")
    res = harness.run_job(SSH, out, "forced checkpoint.dir")
    assert res[-1].returncode == 2 and "DTLAUNCH_CHECKPOINT_DIR" in res[-1].stderr, res[-1].stderr


def test_validate_names_the_field_line_and_fix_of_what_the_head_only_launch_would_run(run_cli, tmp_path):
    ssh = [
        "--set",
        "parallelism.strategy=zero2",
        "--set",
        "parallelism.launcher=deepspeed",
        "--set",
        "targets.sky.deepspeed_ssh=true",
    ]
    item = "checkpoint.dir=/checkpoints/$(touch PWNED)/{run_id}"
    code, out, _ = run_cli("validate", TINY, "-t", "sky", *ssh, "--set", item)
    assert code == 1 and f"--set {item}: error [deepspeed-ssh-values] checkpoint.dir: " in out, out
    assert "holds '$'" in out and "fix: remove those characters from checkpoint.dir" in out, out
    # in a file: the line of the entry itself (an entrypoint argument, an env value)
    (tmp_path / "train.py").write_text("print('hi')\n")
    text = TINY.read_text() + (
        "entrypoint:\n  script: train.py\n  args: ['a b; c', '--out=x;id']\nenv:\n  OK: 'a b'\n  BAD: '`id`'\n"
    )
    lines = text.splitlines()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    code, out, _ = run_cli("validate", recipe, "-t", "sky", *ssh)
    assert code == 1, out
    assert f"{recipe}:{lines.index('  BAD: ' + repr('`id`')) + 1}: error [deepspeed-ssh-env] env.BAD: " in out, out
    args_line = lines.index("  args: ['a b; c', '--out=x;id']") + 1  # with a space DeepSpeed quotes it: fine
    assert f"{recipe}:{args_line}: error [deepspeed-ssh-values] entrypoint.args.1: '--out=x;id' holds ';'" in out, out
