"""Review 1170c19 (reliability round 2): R11 reserved env names, R12 internal errors, R13 extra_sbatch that validate
passed and render refused, `--sweep` list values; and a small fuzz over well-typed extreme values, which holds that
validate, plan and render only ever raise dtlaunch's own errors and that what validate passes, render renders."""

from __future__ import annotations

import functools
import json
import time

import pytest

from launcher import jobenv
from launcher.errors import DtlaunchError, RecipeError
from launcher.plan import make_plan
from launcher.prepare import prepare
from launcher.recipe import load, load_text
from launcher.sweep import expand
from launcher.validate import has_errors, validate
from testpaths import RECIPES

TINY = RECIPES / "tiny.yaml"
L70 = RECIPES / "llama70b.yaml"


# ----------------------------------------------------------------------------- R11: reserved env names


@pytest.mark.parametrize(
    "name",
    [
        "DTLAUNCH_ATTEMPT",
        "DTLAUNCH_STATUS",
        "DTLAUNCH_RUN_ID",
        "DTLAUNCH_PLAN",
        "DTLAUNCH_SOMETHING_LATER",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID",
        "MASTER_PORT",
        "MASTER_ADDR",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "GROUP_RANK",
    ],
)
def test_recipe_env_cannot_set_a_variable_dtlaunch_or_torchrun_sets(run_cli, name):
    code, out, _ = run_cli("validate", TINY, "--set", f"env.{name}=mine")
    assert code == 1, out
    assert f"--set env.{name}=mine: error [recipe] env.{name}: " in out, out
    assert f"fix: remove env.{name}: " in out, out


def test_a_reserved_env_name_in_the_file_is_reported_at_its_line():
    text = TINY.read_text() + "env:\n  OMP_PROC_BIND: close\n  DTLAUNCH_CHECKPOINT_DIR: /mine\n"
    line = text.splitlines().index("  DTLAUNCH_CHECKPOINT_DIR: /mine") + 1
    with pytest.raises(RecipeError) as e:
        load_text(text, "r.yaml")
    (p,) = e.value.problems
    assert (p.file, p.line, p.field) == ("r.yaml", line, "env.DTLAUNCH_CHECKPOINT_DIR"), p


def test_ordinary_env_and_the_documented_inputs_still_pass(run_cli):
    code, out, _ = run_cli(
        "validate",
        TINY,
        "--set",
        "env.MY_SETTING=1",
        "--set",
        "env.RANKING=top",
        "--set",
        "env.NCCL_DEBUG=INFO",
        "--set",
        "env.DTLAUNCH_PYTHON=/opt/venv/bin/python",
    )
    assert code == 0, out


def test_every_variable_the_job_contract_names_is_reserved():
    contract = [v for k, v in vars(jobenv).items() if k.isupper() and isinstance(v, str) and v.startswith("DTLAUNCH_")]
    assert len(contract) >= 12
    for name in contract:
        assert (jobenv.env_owner(name) == "dtlaunch") == (name not in jobenv.ENV_INPUTS), name
    assert jobenv.env_owner("DTLAUNCH_LATER") == "dtlaunch" and jobenv.env_owner("MASTER_PORT") == "torchrun"
    assert jobenv.env_owner("RANKING") is None and jobenv.env_owner("DTLAUNCH_PYTHON") is None


# ----------------------------------------------------------------------------- R12: internal errors


def test_a_vocabulary_smaller_than_the_tensor_degree_is_a_located_error_not_a_crash(run_cli):
    code, out, err = run_cli("validate", RECIPES / "llama3-405b.yaml", "--set", "model.vocab=1")
    assert code == 1 and "internal error" not in out + err, out + err
    # the runtime splits the vocabulary evenly over the tensor-parallel ranks: the tp-shape rule says so
    assert "llama3-405b.yaml:10: error [tp-shape] parallelism.tensor: tensor 8 does not divide vocab 1" in out, out
    # planning alone (the user's own entrypoint runs it) gives a plan, with a loss chunk of a fraction of a column
    r = load(RECIPES / "llama3-405b.yaml", ["model.vocab=1"])
    p = make_plan(r)
    assert p.layout.tp > 1 and p.memory.total > 0


# ----------------------------------------------------------------------------- R12/R13: extra_sbatch

BAD_ENTRIES = [
    ("", "is not an sbatch option"),
    ("   ", "is not an sbatch option"),
    ("comment=x", "is not an sbatch option"),
    ("rm -rf /", "is not an sbatch option"),
    ("-", "is not an sbatch option"),
    ("--", "is not an sbatch option"),
    ("--=x", "is not an sbatch option"),
]


@pytest.mark.parametrize("entry,words", BAD_ENTRIES)
def test_an_extra_sbatch_entry_render_refuses_is_refused_located_by_every_command(run_cli, tmp_path, entry, words):
    item = f"targets.slurm.extra_sbatch={json.dumps([entry])}"
    for args in (["validate", L70, "-t", "slurm"], ["render", L70, "-t", "slurm", "-o", tmp_path / "r"], ["plan", L70]):
        code, out, err = run_cli(*args, "--set", item)
        text = out + err
        assert code not in (0, 70) and "internal error" not in text, (args, text)
        # validate lists it as a finding, the others as the error they stop with
        where = "error [recipe] " if args[0] == "validate" else ""
        assert f"--set {item}: {where}targets.slurm.extra_sbatch.0: " in text and words in text, (args, text)
        assert "fix: " in text


@pytest.mark.parametrize(
    "entry,words", [("-w node1", "submitit writes long options only"), ("--comment=a\\b", "backslash")]
)
def test_what_submitit_refuses_in_extra_sbatch_is_refused_located(run_cli, entry, words):
    item = f"targets.slurm.extra_sbatch={json.dumps([entry])}"
    code, out, _ = run_cli("validate", L70, "-t", "slurm", "--set", "targets.slurm.submit=submitit", "--set", item)
    assert code == 1 and words in out and f"--set {item}: error [recipe]" in out, out
    # the same entries are fine for sbatch
    code, _, err = run_cli("validate", TINY, "-t", "slurm", "--set", item)
    assert code == 0, err


def test_an_extra_sbatch_entry_in_the_file_is_reported_at_its_line():
    text = TINY.read_text() + "  slurm:\n    extra_sbatch:\n      - --hold\n      - comment=nightly\n"
    line = text.splitlines().index("      - comment=nightly") + 1
    with pytest.raises(RecipeError) as e:
        load_text(text, "r.yaml")
    (p,) = e.value.problems
    assert (p.file, p.line, p.field) == ("r.yaml", line, "targets.slurm.extra_sbatch.1"), p


def test_the_plan_options_rule_reads_every_entry_the_loader_passes():
    for entry, hit in (
        ("-N 2", True),
        ("--nodes=2", True),
        ("--ntasks-per-node 2", True),
        ("--hold", False),
        ("-w node1", False),
    ):
        r = load(TINY, [f"targets.slurm.extra_sbatch={json.dumps([entry])}"])
        rules = {f.rule for f in validate(r, make_plan(r), "slurm")}
        assert ("slurm-extra-sbatch-plan" in rules) == hit, entry


# ----------------------------------------------------------------------------- --sweep list values


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
    code, out, err = run_cli("plan", TINY, "--sweep", "training.betas=[0.9,0.95],[0.8,0.9]")
    assert code == 0, err


# ----------------------------------------------------------------------------- fuzz: validate = render

EXTREMES = {
    "name": ["x" * 200, "日本語", "-"],
    "run_id": ["a" * 128],
    "model.vocab": [1, 2, 3, 7],
    "model.heads": [1, 3],
    "model.kv_heads": [1],
    "model.hidden": [1, 8],
    "model.ffn_hidden": [1],
    "model.seq_len": [1, 2, 100_000_000],
    "model.layers": [1, 100_000],
    "model.rope_theta": [1e-9],
    "model.architecture": ["gpt"],
    "training.global_batch": [1, 3, 10**9],
    "training.micro_batch": [1_000_000],
    "training.steps": [1, 10**12],
    "training.tokens": [1],
    "training.warmup_steps": [10**12],
    "training.timeout_seconds": [1],
    "training.data.num_tokens": [2],
    "parallelism.strategy": ["ddp", "fsdp_grad_op", "hybrid", "zero1", "zero3"],
    "parallelism.precision": ["fp16", "fp32"],
    "parallelism.offload": ["optimizer", "params"],
    "parallelism.activation_checkpointing": ["none", "full"],
    "parallelism.sequence_parallel": [True],
    "parallelism.pipeline_schedule": ["interleaved_1f1b"],
    "parallelism.launcher": ["deepspeed"],
    "parallelism.tensor": [3, 1024],
    "parallelism.pipeline": [2, 1024],
    "parallelism.data": [1, 10_000_000],
    "parallelism.grad_accum": [1_000_000],
    "resources.accelerator": ["cpu:1", "H100:1", "T4:16"],
    "resources.nodes": [2, 100_000],
    "resources.network": ["tcp"],
    "resources.mfu": [1e-9],
    "resources.gpu_memory_gb": [0.001, 100000],
    "resources.peak_tflops": [0.001],
    "resources.storage_gbps_per_node": [0.001],
    "resources.gpu_mtbf_hours": [1e-6],
    "checkpoint.every": [1, 10**12],
    "checkpoint.keep": [10_000],
    "checkpoint.grace_seconds": [1, 86_400],
    "checkpoint.dir": ["relative/{run_id}", "/x/{run_id}/{run_id}"],
    "targets.local.max_restarts": [0],
    "targets.slurm.extra_sbatch": [
        [""],
        ["comment=x"],
        ["--comment=x"],
        ["-x"],
        ["-"],
        ["--"],
        ["--comment=#x y"],
        ["-w node1"],
        ["--comment=a\\b"],
        ["--hold", "  --hold  "],
        ["--nodes=2"],
        ["-N 2"],
        ["--comment x"],
    ],
    "targets.slurm.time": ["0", "1", "0:1", "00:00:01", "365-00:00:00", "UNLIMITED", "infinite", 10**9],
    "targets.slurm.signal_seconds": [1, 65535],
    "targets.slurm.submit": ["submitit"],
    "targets.slurm.mem": ["0", "1K"],
    "targets.slurm.mem_per_gpu": ["1"],
    "targets.slurm.cpus_per_task": [100_000],
    "targets.slurm.cpus_per_gpu": [10_000],
    "targets.slurm.gpu_request": ["gres"],
    "targets.slurm.exclusive": [False],
    "targets.slurm.max_restarts": [0],
    "targets.slurm.nodelist": ["n[1-99999]"],
    "targets.slurm.container": [{"runtime": "pyxis"}, {"runtime": "apptainer", "image": "/i.sif"}],
    "targets.sky.accelerators": [["A100-80GB:8"], ["T4:1"]],
    "targets.sky.managed": [True],
    "targets.sky.cpus": ["1+"],
    "targets.sky.ports": [[1, "1-65535"]],
    "targets.sky.disk_size": [1],
    "targets.sky.max_restarts": [0],
    "env": [{"DTLAUNCH_ATTEMPT": "x"}, {"TORCHELASTIC_RESTART_COUNT": 3}, {"A": "$(touch x)"}],
}
FUZZ_RECIPES = ["tiny", "llama70b", "llama3-405b"]
TARGETS = ("local", "slurm", "sky")
SUBMITIT = "targets.slurm.submit=submitit"


def _cases():
    for recipe in FUZZ_RECIPES:
        for key, values in EXTREMES.items():
            for v in values:
                yield recipe, [f"{key}={json.dumps(v)}"]
    # pairs that reach deeper: tiny shapes under model parallelism, submitit's own limits, odd extras at scale
    yield "llama70b", ["model.vocab=1", "parallelism.tensor=8"]
    yield "llama70b", ["model.heads=1", "model.kv_heads=1", "parallelism.tensor=1"]
    yield "tiny", ["resources.nodes=100000", 'targets.slurm.extra_sbatch=["-x"]']
    for extra in EXTREMES["targets.slurm.extra_sbatch"]:
        yield "tiny", [SUBMITIT, f"targets.slurm.extra_sbatch={json.dumps(extra)}"]
    for value in ("a\\b", "a'b", "a b", "#x"):
        for field in ("partition", "account", "qos", "constraint"):
            yield "tiny", [SUBMITIT, f"targets.slurm.{field}={json.dumps(value)}"]
    yield "tiny", [SUBMITIT, "targets.slurm.time=0"]
    yield (
        "tiny",
        [
            "parallelism.launcher=deepspeed",
            "parallelism.strategy=zero2",
            "targets.sky.deepspeed_ssh=true",
            "checkpoint.dir=/checkpoints/$(touch PWNED)/{run_id}",
        ],
    )


def test_fuzz_extremes_raise_only_dtlaunch_errors_and_what_validate_passes_renders(monkeypatch):
    from launcher.render import package, sky, slurm

    wheel = functools.cache(package.build_wheel)  # the same bytes for every recipe: built once, not 300 times
    monkeypatch.setattr(sky, "build_wheel", wheel)
    monkeypatch.setattr(slurm, "build_wheel", wheel)
    start, problems = time.monotonic(), []
    for name, overrides in _cases():
        path = RECIPES / f"{name}.yaml"
        try:
            recipe = load(path, overrides)
            plan = make_plan(recipe)
        except DtlaunchError:
            continue
        except Exception as e:  # noqa: BLE001 - the property under test
            problems.append(f"{name} {overrides}: load/plan raised {type(e).__name__}: {e}")
            continue
        for target in TARGETS:
            try:
                findings = validate(recipe, plan, target)
            except DtlaunchError:
                continue  # a refusal in dtlaunch's words (e.g. a SkyPilot fallback that cannot be planned)
            except Exception as e:  # noqa: BLE001
                problems.append(f"{name} {overrides} -t {target}: validate raised {type(e).__name__}: {e}")
                continue
            if has_errors(findings):
                continue
            try:
                prepare(path, overrides, target=target)
            except Exception as e:  # noqa: BLE001 - validate said ok: render must not refuse or crash
                problems.append(f"{name} {overrides} -t {target}: validate ok, render raised {type(e).__name__}: {e}")
    assert not problems, "\n".join(problems)
    assert time.monotonic() - start < 60, time.monotonic() - start
