"""Review 1170c19 (reliability round 2): R11 reserved env names, R12 internal errors, R13 extra_sbatch that validate
passed and render refused, `--sweep` list values. The fuzz over well-typed extreme values (only dtlaunch's own
errors; what validate passes, render renders) is the `extreme` category of tests/test_hostile.py."""

from __future__ import annotations

import json

import pytest

from launcher import jobenv
from launcher.cli.sweep import expand
from launcher.errors import DtlaunchError, RecipeError
from launcher.plan import make_plan
from launcher.recipe import load, load_text
from launcher.validate import validate
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
