"""Recipe loading: every error names file, line and field, says what is wrong and how to fix it."""

import pytest

from launcher import jobenv
from launcher.errors import RecipeError
from launcher.recipe import load, load_text
from testpaths import RECIPES

GOOD = """name: r
model:
  preset: tiny
training:
  steps: 10
"""


def problems(text, **kw):
    with pytest.raises(RecipeError) as e:
        load_text(text, "r.yaml", **kw)
    return e.value.problems


def test_good_recipe_loads_with_defaults():
    r = load_text(GOOD)
    assert r.parallelism.strategy == "auto" and r.resources.nodes == 1 and r.model.shape().layers == 4


def test_unknown_key_suggests_the_right_one_with_line():
    [p] = problems(GOOD.replace("  steps: 10", "  steps: 10\n  micro_bach: 2"))
    assert p.line == 6 and p.field == "training.micro_bach"
    assert "did you mean 'micro_batch'" in p.message
    assert "allowed keys" in p.fix


def test_unknown_top_level_section():
    [p] = problems(GOOD + "resource:\n  nodes: 2\n")
    assert "did you mean 'resources'" in p.message and p.line == 6


def test_wrong_type_names_field_and_line():
    [p] = problems(GOOD.replace("steps: 10", "steps: ten"))
    assert p.field == "training.steps" and p.line == 5


def test_negative_numbers_and_bad_accelerator():
    ps = problems(GOOD + "resources:\n  nodes: -1\n  accelerator: H10:8\n")
    fields = {p.field: p for p in ps}
    assert "resources.nodes" in fields and fields["resources.nodes"].line == 7
    assert "did you mean 'H100'" in fields["resources.accelerator"].message


def test_unknown_preset_lists_known_ones():
    [p] = problems(GOOD.replace("preset: tiny", "preset: llama3-7b"))
    assert "llama3-8b" in p.message and p.line == 3


def test_missing_required_sections():
    ps = problems("name: x\n")
    assert {p.field for p in ps} == {"model", "training"}
    assert all("add `" in p.fix for p in ps)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "empty"),
        ("name: [unclosed\n", "YAML syntax error"),
        ("- a\n- b\n", "must be a mapping"),
        ("just a string", "must be a mapping"),
    ],
)
def test_malformed_files(text, needle):
    [p] = problems(text)
    assert needle in p.message


def test_binary_and_missing_files(tmp_path):
    b = tmp_path / "x.yaml"
    b.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    with pytest.raises(RecipeError) as e:
        load(b)
    assert "binary" in str(e.value) or "NUL" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load(tmp_path / "nope.yaml")
    assert "file not found" in str(e.value)


def test_overrides_are_yaml_typed_and_validated():
    r = load_text(GOOD, overrides=["training.steps=7", "resources.nodes=2", "env.FOO=bar"])
    assert r.training.steps == 7 and r.resources.nodes == 2 and r.env == {"FOO": "bar"}
    ps = problems(GOOD, overrides=["training.stepz=7"])
    assert "did you mean 'steps'" in ps[0].message


def test_secrets_are_names_only():
    [p] = problems(GOOD + "secrets: ['WANDB_API_KEY=abc123']\n")
    assert "names only" in p.message


def test_schema_is_json_schema(run_cli):
    import json

    code, out, _ = run_cli("schema")
    s = json.loads(out)
    assert code == 0 and "model" in s["properties"] and s["additionalProperties"] is False


def test_a_recipe_round_trips_through_json_unchanged():
    """A checkpoint and a plan file keep the recipe as JSON; the copy read back must equal the recipe's own
    dict, or a resume would see its own recipe as another (a tuple is not equal to the list JSON gives back)."""
    import json

    from launcher.recipe import parse

    r = load_text(GOOD + "env: {A: 1, B: true}\n")
    d = r.to_dict()
    assert json.loads(json.dumps(d)) == d
    again = parse(json.loads(json.dumps(d)))
    assert again == r and again.to_dict() == d and again.digest() == r.digest()


def test_every_mistake_is_listed_not_only_the_first():
    ps = problems(
        GOOD.replace("  steps: 10", "  steps: 10\n  lr: -1\n  micro_bach: 2\n  tokens: 5")
        + "resources: {nodes: true, accelerator: H1000:8}\nparallelism: {strategy: zero4}\n"
        + "secrets: [A=b]\n"
    )
    by_field = {p.field: p for p in ps}
    # training's own check (steps and tokens both set) holds whatever else is wrong in it, and a failed
    # section check does not end the search: secrets, checked at the top level, is still reached.
    assert set(by_field) == {
        "training.lr",
        "training.micro_bach",
        "training",
        "resources.nodes",
        "resources.accelerator",
        "parallelism.strategy",
        "secrets",
    }, [p.render() for p in ps]
    assert by_field["training.lr"].line == 6 and "> 0" in by_field["training.lr"].message
    assert "only one of `steps`" in by_field["training"].message
    assert "true/false" in by_field["resources.nodes"].message
    assert "did you mean 'H100'" in by_field["resources.accelerator"].message
    assert "did you mean 'zero3'" in by_field["parallelism.strategy"].message


def test_every_bad_item_of_a_list_is_listed_at_its_own_index_and_line():
    """A bad item is taken out alone (not its whole list), so the list's later bad items are reported too,
    at their indices and lines in the file, not the shrunk copy's; a fixed-length list's own length rule,
    broken only by that taking out, is not reported."""
    text = (
        GOOD.replace("  steps: 10", "  steps: 10\n  betas: [0.9, x]") + "secrets: [A=b, 3, C=d]\n"
        "targets:\n  slurm:\n    setup:\n      - ok\n      - 1\n      - fine\n      - {a: 2}\n      - [x]\n"
    )
    ps = problems(text)
    got = {p.field: p for p in ps}
    assert set(got) == {
        "training.betas.1",
        "targets.slurm.setup.1",
        "targets.slurm.setup.3",
        "targets.slurm.setup.4",
        "secrets.1",
    }, [p.render() for p in ps]
    line_of = {t: n for n, t in enumerate(text.splitlines(), 1)}
    for index, item, kind in [(1, "1", "whole number"), (3, "{a: 2}", "mapping"), (4, "[x]", "a list")]:
        p = got[f"targets.slurm.setup.{index}"]
        assert kind in p.message and p.line == line_of[f"      - {item}"], p.render()


def test_past_the_listed_mistakes_the_rest_are_counted():
    from launcher.recipe.limits import MAX_PROBLEMS

    extra = "".join(f"  unknown_{i}: 1\n" for i in range(MAX_PROBLEMS + 5))
    with pytest.raises(RecipeError) as e:
        load_text(GOOD.replace("  steps: 10\n", "  steps: 10\n" + extra), "r.yaml")
    assert len(e.value.problems) == MAX_PROBLEMS and e.value.more == 5
    assert {p.field for p in e.value.problems} <= {f"training.unknown_{i}" for i in range(MAX_PROBLEMS + 5)}


def test_validate_says_how_many_problems_it_did_not_list(tmp_path, run_cli):
    import json

    from launcher.recipe.limits import MAX_PROBLEMS

    f = tmp_path / "r.yaml"
    f.write_text(GOOD + "targets: {slurm: {setup: [" + ", ".join(["1"] * (MAX_PROBLEMS + 7)) + "]}}\n")
    code, out, _ = run_cli("validate", f)
    assert code == 1 and out.count("targets.slurm.setup.") == MAX_PROBLEMS and "... and 7 more problem(s)" in out
    code, out, _ = run_cli("validate", f, "--format", "json")
    [res] = json.loads(out)
    assert code == 1 and len(res["findings"]) == MAX_PROBLEMS and res["more"] == 7


def test_a_line_break_in_an_sbatch_value_is_named_as_such():
    [p] = problems(GOOD + 'targets: {slurm: {partition: "gpu\\ntouch /tmp/pwned"}}\n')
    assert p.field == "targets.slurm.partition" and "single line" in p.message


@pytest.mark.parametrize(
    "override",
    [
        'targets.slurm.partition="gpu\\n"',
        'targets.slurm.gpu_type="a100\\n"',
        'secrets=["A\\n"]',
        'run_id="r1\\n"',
        'resources.socket_ifname="eth0\\n"',
        'targets.slurm.extra_sbatch=["--comment=x\\n"]',
    ],
)
def test_a_trailing_line_break_is_refused_too(override):
    """`$` in a Python pattern also matches before a final line break: the patterns end with \\Z instead."""
    ps = problems(GOOD, overrides=[override])
    assert ps and ps[0].field.startswith(override.split("=")[0]), [p.render() for p in ps]


def test_numbers_and_booleans_yaml_left_as_text_are_read():
    """PyYAML reads `1e-4` (no dot) as text; a learning rate is written that way."""
    r = load_text(GOOD.replace("  steps: 10", "  steps: 10\n  lr: 1e-4\n  deterministic: 'true'"))
    assert r.training.lr == 1e-4 and r.training.deterministic is True
    [p] = problems(GOOD.replace("  steps: 10", "  steps: true"))
    assert "true/false" in p.message


def test_later_mistakes_are_found_past_a_missing_field_a_text_key_and_an_alias():
    ps = problems(
        GOOD + "targets: {slurm: {container: {mounts: [/a]}}}\nenv: {1: x}\n"
        "parallelism: &p {tensor: 0}\ncheckpoint: *p\n"
    )
    fields = {p.field for p in ps}
    assert {"targets.slurm.container.runtime", "env", "parallelism.tensor", "checkpoint.tensor"} <= fields, [
        p.render() for p in ps
    ]


# ----------------------------------------------------------------------------- env: the names dtlaunch and torchrun set

TINY = RECIPES / "tiny.yaml"


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
    (p,) = problems(text)
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


def test_the_mistakes_are_listed_in_the_files_order():
    """The schema lists resources before training; a reader goes down the file."""
    ps = problems("name: x\nmodel: {preset: tiny}\ntraining: {steps: ten, micro_bach: 2}\nresources: {nodes: true}\n")
    assert [(p.line, p.field) for p in ps] == [
        (3, "training.steps"),
        (3, "training.micro_bach"),
        (4, "resources.nodes"),
    ], [p.render() for p in ps]
