"""The CLI as a user runs it: fast paths import nothing heavy, JSON contract, rendered scripts execute safely."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli.sweep import expand
from launcher.errors import DtlaunchError
from testpaths import RECIPES

# pydantic: imported only to list a broken recipe's mistakes (launcher/recipe/problems.py); the schema is
# msgspec's, and a stray import would bring its start-up back to every command unseen.
HEAVY = ("torch", "deepspeed", "sky", "submitit", "paramiko", "transformers", "pydantic", "jinja2")
PY = sys.executable


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["plan", RECIPES / "llama70b.yaml"],
        ["plan", RECIPES / "llama70b.yaml", "--json"],
        ["validate", RECIPES / "llama70b.yaml", RECIPES / "tiny.yaml"],
        ["render", RECIPES / "tiny.yaml", "--target", "local", "-o", "{tmp}/r"],
        [
            "render",
            RECIPES / "tiny.yaml",
            "--target",
            "slurm",
            "--set",
            "targets.slurm.submit=submitit",
            "-o",
            "{tmp}/s",
        ],
        ["plan", RECIPES / "llama70b.yaml", "--set", "targets.sky.accelerators=[A100-80GB:8]"],
        [
            "render",
            RECIPES / "llama70b.yaml",
            "--target",
            "sky",
            "--set",
            "targets.sky.accelerators=[A100-80GB:8]",
            "--set",
            "resources.image=nvcr.io/nvidia/pytorch:24.05-py3",
            "--force",
            "-o",
            "{tmp}/k",
        ],
        [
            "render",
            RECIPES / "tiny.yaml",
            "--target",
            "slurm",
            "--set",
            "resources.image=org/train:1",
            "--set",
            "targets.slurm.container={runtime: pyxis}",
            "--set",
            "targets.slurm.submit=submitit",
            "-o",
            "{tmp}/c",
        ],
    ],
)
def test_fast_commands_import_nothing_heavy(args, tmp_path):
    args = [str(a).replace("{tmp}", str(tmp_path)) for a in args]
    heavy = [m for m in HEAVY if not (m == "jinja2" and args[0] == "render")]  # render's templates need Jinja
    code = (
        "import sys\n"
        "from launcher.cli import main\n"
        f"sys.argv = ['dtlaunch'] + {args!r}\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"heavy = [m for m in {heavy!r} if m in sys.modules]\n"
        "print('HEAVY=' + ','.join(heavy), file=sys.stderr)\n"
    )
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY=\n" in r.stderr or r.stderr.rstrip().endswith("HEAVY="), r.stderr


def test_plan_json_contract(run_cli):
    code, out, _ = run_cli("plan", RECIPES / "llama70b.yaml", "--json")
    assert code == 0
    d = json.loads(out)
    for k, t in {
        "params": int,
        "world_size": int,
        "dp": int,
        "tp": int,
        "pp": int,
        "strategy": str,
        "reasons": list,
        "memory": dict,
        "candidates": list,
        "time": dict,
        "cost": dict,
        "checkpoint": dict,
    }.items():
        assert isinstance(d[k], t), k
    for k in ("params", "grads", "optimizer", "activations", "buffers", "total", "gpu", "fits"):
        assert k in d["memory"]
        assert all(k in c["memory"] for c in d["candidates"])
    m = d["memory"]
    assert m["total"] == pytest.approx(
        sum(m[k] for k in ("params", "grads", "optimizer", "activations", "buffers")), abs=8
    )
    assert m["fits"] and m["total"] <= m["gpu"]
    assert d["params"] == 70_553_706_496 and d["world_size"] == 64
    assert set(d["time"]) >= {"flops_per_step", "step_seconds", "total_hours"} and d["cost"]["usd"] > 0
    assert d["checkpoint"]["every_steps"] >= 1


def test_plan_table_shows_choice_and_reasons(run_cli):
    code, out, _ = run_cli("plan", RECIPES / "llama70b.yaml")
    assert code == 0
    assert "* fsdp" in out or "* hybrid" in out
    assert "why:" in out and "fits:" in out and "cost: $" in out


def test_render_writes_plan_and_launch_script(run_cli, tmp_path):
    code, out, _ = run_cli("render", RECIPES / "tiny.yaml", "--target", "local", "-o", tmp_path / "r")
    assert code == 0
    files = {p.name for p in (tmp_path / "r").iterdir()}
    assert {"plan.json", "recipe.yaml", "launch.sh"} <= files
    doc = json.loads((tmp_path / "r" / "plan.json").read_text())
    assert doc["plan"]["layout"]["strategy"] == "fsdp" and doc["recipe"]["name"] == "tiny"


def test_bad_flag_and_unknown_target_are_clear(run_cli):
    code, _, err = run_cli("render", RECIPES / "tiny.yaml", "--target", "moon")
    assert code == 2 and "moon" in err and "Traceback" not in err
    code, _, err = run_cli("plan", RECIPES / "nope.yaml")
    assert code == 2 and "file not found" in err


def _stub_python(tmp_path: Path) -> Path:
    """A stand-in interpreter that records its argv, one per line (a real executable, not a mock of our code)."""
    stub = tmp_path / "fakepython"
    stub.write_text(
        f'#!/bin/sh\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
        'for a in "$@"; do printf \'%s\\n\' "$a"; done > "$DTLAUNCH_RUN_DIR/argv"\n'
        'env > "$DTLAUNCH_RUN_DIR/env"\n'
    )
    stub.chmod(0o755)
    return stub


def test_rendered_launch_script_quotes_hostile_values(run_cli, tmp_path):
    marker = tmp_path / "pwned"
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(
        f'name: "x; touch {marker}"\n'
        "model: {preset: micro}\n"
        "resources: {accelerator: 'cpu:2', network: loopback}\n"
        "training: {steps: 2}\n"
        f'env: {{EVIL: \'$(touch {marker})\', QUOTE: "it\'s \\"quoted\\" `touch {marker}`"}}\n'
    )
    out = tmp_path / "r with space"
    code, _, err = run_cli("render", recipe, "--target", "local", "-o", out)
    assert code == 0, err
    env = dict(os.environ, DTLAUNCH_PYTHON=str(_stub_python(tmp_path)))
    r = subprocess.run(["bash", str(out / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    argv = (out / "argv").read_text().splitlines()
    assert argv[:2] == ["-m", "launcher.runtime.elastic"]  # torchrun, with one line instead of a traceback on a signal
    assert "--nproc-per-node=2" in argv and "--rdzv-backend=c10d" in argv
    assert argv[argv.index("--plan") + 1] == str(out / "plan.json")
    endpoint = next(a for a in argv if a.startswith("--rdzv-endpoint="))
    assert endpoint.startswith("--rdzv-endpoint=127.0.0.1:") and int(endpoint.rsplit(":", 1)[1]) > 0
    job_env = dict(line.split("=", 1) for line in (out / "env").read_text().splitlines() if "=" in line)
    assert job_env["EVIL"] == f"$(touch {marker})"
    assert job_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    (exit_code,) = (out / "status").glob("*/exit_code")
    assert exit_code.read_text().strip() == "0"


def test_secret_values_never_written(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "s3cr3t-value-123")
    recipe = tmp_path / "s.yaml"
    recipe.write_text(
        "name: s\nmodel: {preset: micro}\nresources: {accelerator: 'cpu:2'}\n"
        "training: {steps: 2}\nsecrets: [WANDB_API_KEY]\n"
    )
    code, _, _ = run_cli("render", recipe, "--target", "local", "-o", tmp_path / "r")
    assert code == 0
    for f in (tmp_path / "r").iterdir():
        assert "s3cr3t-value-123" not in f.read_text()


def test_sweep_renders_one_plan_per_array_task(run_cli, tmp_path):
    code, out, err = run_cli(
        "render",
        RECIPES / "tiny.yaml",
        "-t",
        "slurm",
        "--sweep",
        "training.seed=1,2",
        "--sweep",
        "training.lr=0.001,0.002",
        "-o",
        tmp_path / "a",
    )
    assert code == 0, err
    seeds_lrs = set()
    for i in range(4):
        d = json.loads((tmp_path / "a" / f"task-{i}" / "plan.json").read_text())["recipe"]["training"]
        seeds_lrs.add((d["seed"], d["lr"]))
    assert seeds_lrs == {(1, 0.001), (1, 0.002), (2, 0.001), (2, 0.002)}
    assert "#SBATCH --array=0-3" in (tmp_path / "a" / "job.sbatch").read_text()
    code, _, err = run_cli("render", RECIPES / "tiny.yaml", "-t", "local", "--sweep", "training.seed=1,2")
    assert code == 2 and "--target slurm" in err


def test_every_sweep_task_is_validated_and_none_shares_a_checkpoint_directory(run_cli, tmp_path):
    """Each array task is its own recipe: validate runs on every one (it ran on the base recipe only, so DDP with
    optimizer offload was written as a task); a fixed checkpoint.dir would be shared by every task (concurrent
    tasks refuse each other's lock, a later one resumes an earlier one's final checkpoint)."""
    code, out, err = run_cli(
        "render",
        RECIPES / "tiny.yaml",
        "-t",
        "slurm",
        "--set",
        "parallelism.strategy=ddp",
        "--sweep",
        "parallelism.offload=none,optimizer",
        "-o",
        tmp_path / "a",
    )
    assert code != 0 and not (tmp_path / "a").exists(), out + err
    assert "sweep task 1 (parallelism.offload=optimizer):" in err and "[offload-ddp]" in err
    assert "sweep task 0" not in err
    code, out, err = run_cli(
        "render",
        RECIPES / "tiny.yaml",
        "-t",
        "slurm",
        "--set",
        "checkpoint.dir=/shared/ckpt",
        "--sweep",
        "training.seed=1,2",
        "-o",
        tmp_path / "b",
    )
    assert code != 0 and "has no {run_id}" in err and "checkpoint.dir=/shared/ckpt/{run_id}" in err, out + err
    code, out, err = run_cli(
        "render",
        RECIPES / "tiny.yaml",
        "-t",
        "slurm",
        "--set",
        "checkpoint.dir=/shared/ckpt/{run_id}",
        "--sweep",
        "training.seed=1,2",
        "-o",
        tmp_path / "c",
    )
    assert code == 0, out + err


def test_plan_sweep_lists_every_combination(run_cli):
    code, out, _ = run_cli(
        "plan",
        RECIPES / "llama3-8b.yaml",
        "--sweep",
        "resources.nodes=1,2",
        "--sweep",
        "parallelism.strategy=ddp,fsdp",
        "--json",
    )
    rows = json.loads(out)
    assert code == 0 and len(rows) == 4
    assert {(r["world_size"], r["strategy"]) for r in rows} == {(8, "ddp"), (8, "fsdp"), (16, "ddp"), (16, "fsdp")}


def test_plan_says_what_it_does_not_model_and_its_units(run_cli):
    """float8 linears, torch.compile and context parallelism have no term in the figures: the plan says so, in
    the printed table and in `--json`, with the unit (GB = 1e9 bytes) and the bytes per parameter it uses."""
    code, out, _ = run_cli("plan", RECIPES / "llama70b.yaml", "--json")
    assert code == 0
    d = json.loads(out)
    left_out = " ".join(d["not_modelled"])
    for thing in ("float8", "torch.compile", "context parallelism"):
        assert thing in left_out
    assert d["units"]["gb_bytes"] == 10**9 and d["units"]["bytes_per_param_mixed_adam"] == 16
    code, out, _ = run_cli("plan", RECIPES / "llama70b.yaml")
    assert code == 0
    line = " ".join(out[out.index("not modelled:") :].split())  # rich wraps at the terminal's width
    assert all(t in line for t in ("float8", "torch.compile", "context parallelism", "GB = 1e9 bytes"))


def test_names_without_ascii_get_distinct_run_directories(run_cli, tmp_path):
    """Names that a scheduler cannot take (CJK, emoji, dots) never collapse into one job name, so two such
    recipes never share a run directory and its checkpoints."""
    from launcher.recipe import load

    names = ["模型训练", "🚀🚀", "..", ".", "tiny run", "tiny-run"]
    jobs = {n: load(RECIPES / "tiny.yaml", [f"name={json.dumps(n)}"]).job_name for n in names}
    assert len(set(jobs.values())) == len(names), jobs
    for job in jobs.values():
        assert job and job.replace("-", "").replace("_", "").replace(".", "").isascii() and job[0].isalnum(), job
    outs = []
    for n in names[:4]:
        code, out, err = run_cli("render", RECIPES / "tiny.yaml", "-t", "local", "--set", f"name={json.dumps(n)}")
        assert code == 0, err
        outs.append(out.split(" to ", 1)[1].split(":", 1)[0])
    assert len(set(outs)) == 4, outs


def test_render_refuses_a_recipe_validate_finds_errors_in(run_cli, tmp_path):
    """A rendered job must be runnable: errors stop `render` (nothing written) unless --force says otherwise."""
    bad = ["--set", "parallelism.tensor=3"]  # 2 CPU ranks cannot hold tensor groups of 3
    code, _, err = run_cli("render", RECIPES / "tiny.yaml", "-t", "local", "-o", tmp_path / "r", *bad)
    assert code != 0 and "validation found errors" in err and "--force" in err, err
    assert not (tmp_path / "r").exists()
    code, _, err = run_cli("render", RECIPES / "tiny.yaml", "-t", "local", "-o", tmp_path / "f", "--force", *bad)
    assert code == 0 and "despite validation errors" in err and (tmp_path / "f" / "launch.sh").exists(), err


def test_local_launch_without_an_exported_secret_stops_before_training(run_cli, tmp_path):
    """A recipe's secret that the shell does not export ends the local launch with exit 2 and its name,
    before torchrun starts (as the SLURM script and the SkyPilot backend do)."""
    code, _, err = run_cli(
        "render", RECIPES / "tiny.yaml", "-t", "local", "-o", tmp_path / "r", "--set", "secrets=[MY_API_TOKEN]"
    )
    assert code == 0, err
    env = {k: v for k, v in os.environ.items() if k != "MY_API_TOKEN"}
    p = subprocess.run(["bash", str(tmp_path / "r" / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "MY_API_TOKEN is not set" in p.stderr, (p.returncode, p.stderr)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_up_over_a_rendered_directory_says_so_and_leaves_no_stale_files(run_cli, tmp_path):
    """`up` into a directory `render` wrote replaces it with a note, and what the earlier render produced
    that this job does not (a sweep's task-N directories) is gone: the directory is exactly what is submitted."""
    out = tmp_path / "job"
    code, _, err = run_cli(
        "render",
        RECIPES / "tiny.yaml",
        "-t",
        "slurm",
        "-o",
        out,
        "--sweep",
        "training.seed=1,2",
        "--set",
        "targets.slurm.partition=debug",
    )
    assert code == 0, err
    assert any(p.name.startswith("task-") for p in out.iterdir())
    code, _, err = run_cli(
        "up", RECIPES / "tiny.yaml", "-t", "slurm", "-o", out, "--dry-run", "--set", "targets.slurm.partition=debug"
    )
    assert code == 0, err
    assert "replacing the files `dtlaunch render` wrote" in err, err
    assert not any(p.name.startswith("task-") for p in out.iterdir()), sorted(p.name for p in out.iterdir())


def test_a_steps_override_on_a_tokens_recipe_says_how_to_unset_tokens(run_cli):
    code, _, err = run_cli("plan", RECIPES / "llama70b.yaml", "--set", "training.steps=100")
    assert code != 0 and "--set training.tokens=null" in err, err
    code, out, err = run_cli(
        "plan",
        RECIPES / "llama70b.yaml",
        "--set",
        "training.tokens=null",
        "--set",
        "training.steps=100",
        "--set",
        "resources.nodes=16",
    )
    assert code == 0 and "100 steps" in out, err


def test_render_prints_a_summary_and_show_prints_the_scripts(run_cli, tmp_path):
    code, out, err = run_cli("render", RECIPES / "llama70b.yaml", "-t", "slurm", "-o", tmp_path / "q")
    assert code == 0, err
    assert len(out.splitlines()) <= 3 and "#SBATCH" not in out, out
    code, out, err = run_cli("render", RECIPES / "llama70b.yaml", "-t", "slurm", "-o", tmp_path / "s", "--show")
    assert code == 0 and "#SBATCH" in out and len(out.splitlines()) > 50, err


def test_a_bad_plan_ends_a_local_launch_once_with_2_before_torchrun(run_cli, tmp_path):
    """The plan is checked once before torchrun starts: exit 2 at once, never torchrun's retries."""
    code, _, err = run_cli(
        "render", RECIPES / "tiny.yaml", "-t", "local", "-o", tmp_path / "r", "--force", "--set", "parallelism.tensor=3"
    )
    assert code == 0, err
    p = subprocess.run(["bash", str(tmp_path / "r" / "launch.sh")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "ChildFailedError" not in p.stderr and "the pre-start check failed" in p.stderr, p.stderr[-2000:]
    assert "DTLAUNCH_PYTHON" not in p.stderr  # the plan is wrong, not the interpreter


def test_a_loaded_recipe_plans_submits_and_validates_as_its_file_does(tmp_path):
    """`launcher.submit(Recipe)` and `dtlaunch up FILE` go through one function (launcher.prepare). A Recipe read
    back through YAML marked every field as written: without its `tensor:` line, the 405B recipe planned from the
    file chooses tensor 8 (fits), the same recipe as an object kept tensor 1 (does not fit)."""
    from launcher.prepare import prepare
    from launcher.recipe import load

    text = "\n".join(
        line
        for line in (RECIPES / "llama3-405b.yaml").read_text().splitlines()
        if not line.strip().startswith("tensor:")
    )
    f = tmp_path / "r.yaml"
    f.write_text(text)
    by_path = prepare(f, (), "slurm")
    by_object = prepare(load(f), (), "slurm")
    assert by_path.plan.layout.tp == 8 and by_path.plan.memory.fits
    assert by_object.plan.layout == by_path.plan.layout
    assert by_object.artifacts.files["plan.json"] == by_path.artifacts.files["plan.json"]
    # overrides apply to the object as to the file
    assert prepare(load(f), ["parallelism.tensor=4"], "slurm").plan.layout.tp == 4


def test_up_dry_run_prints_a_summary_and_the_script_only_with_show(run_cli, tmp_path):
    args = ("up", RECIPES / "tiny.yaml", "-t", "slurm", "-o", tmp_path / "d", "--dry-run")
    code, out, err = run_cli(*args, "--set", "targets.slurm.partition=debug")
    assert code == 0, err
    assert out.splitlines()[0] == "dry run: slurm job tiny: fsdp on 2 ranks (1 node(s) x 2 cpu), 40 steps", out
    assert "would run in it: sbatch --parsable job.sbatch" in out and "#SBATCH" not in out
    code, out, err = run_cli(*args, "--show", "--set", "targets.slurm.partition=debug")
    assert code == 0, err
    assert f"# ---- {tmp_path / 'd' / 'job.sbatch'}" in out and "#SBATCH --partition=debug" in out


def test_a_bracketed_sweep_value_is_one_item(run_cli):
    assert expand(["training.betas=[0.9,0.95],[0.8, 0.9]", "training.seed=1,2"]) == [
        ["training.betas=[0.9,0.95]", "training.seed=1"],
        ["training.betas=[0.9,0.95]", "training.seed=2"],
        ["training.betas=[0.8, 0.9]", "training.seed=1"],
        ["training.betas=[0.8, 0.9]", "training.seed=2"],
    ]
    assert expand(["env={A: '1,2'},{A: 3}"]) == [["env={A: '1,2'}"], ["env={A: 3}"]]
    assert expand(["name='a,b',c"]) == [["name='a,b'"], ["name=c"]]
    assert expand(["name=it's,b"]) == [["name=it's"], ["name=b"]]  # a quote inside a word is text
    for bad in ("training.betas=[0.9,0.95", "training.betas=0.9]", "a=[1,2],", "a=1,,2"):
        with pytest.raises(DtlaunchError, match="--sweep"):
            expand([bad])
    code, out, err = run_cli("plan", RECIPES / "tiny.yaml", "--sweep", "training.betas=[0.9,0.95],[0.8,0.9]")
    assert code == 0, err
