"""Property test: generated bad recipes always give a clear error through the real CLI, never a traceback."""

import copy

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

VALID = yaml.safe_load(open("recipes/llama70b.yaml"))

WRONG_VALUES = st.one_of(
    st.integers(min_value=-(10**6), max_value=0),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
)


def paths(d, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from paths(v, prefix + (k,))


ALL_PATHS = list(paths(VALID))


@st.composite
def bad_recipe_text(draw):
    kind = draw(
        st.sampled_from(
            [
                "wrong_value",
                "unknown_key",
                "impossible_layout",
                "syntax",
                "empty",
                "binary",
                "drop_section",
                "not_mapping",
            ]
        )
    )
    doc = copy.deepcopy(VALID)
    if kind == "wrong_value":
        path = draw(st.sampled_from(ALL_PATHS))
        cur = doc
        for k in path[:-1]:
            cur = cur[k]
        cur[path[-1]] = draw(WRONG_VALUES)
    elif kind == "unknown_key":
        path = draw(st.sampled_from([p for p in ALL_PATHS if isinstance(_get(doc, p), dict)] + [()]))
        target = _get(doc, path) if path else doc
        target[draw(st.sampled_from(["micro_bach", "stratgy", "gpus", "foo", "node", "precison", "lr_rate"]))] = 1
    elif kind == "impossible_layout":
        doc["parallelism"].update(
            draw(
                st.sampled_from(
                    [
                        {"tensor": 3},
                        {"data": 7},
                        {"pipeline": 500},
                        {"tensor": 0},
                        {"grad_accum": -2},
                        {"strategy": "zero4"},
                        {"precision": "fp8"},
                        {"offload": "disk"},
                    ]
                )
            )
        )
    elif kind == "drop_section":
        doc.pop(draw(st.sampled_from(["name", "model", "training"])))
    elif kind == "not_mapping":
        return yaml.safe_dump(draw(st.sampled_from([[1, 2], "text", 42])))
    elif kind == "syntax":
        text = yaml.safe_dump(doc)
        cut = draw(st.integers(min_value=1, max_value=len(text) - 1))
        return text[:cut] + draw(st.sampled_from([": : :", "\n  - [", "\t\tbad: {", "'unterminated", "]:"]))
    elif kind == "empty":
        return draw(st.sampled_from(["", "   \n", "# only a comment\n", "---\n"]))
    elif kind == "binary":
        return draw(st.binary(min_size=1, max_size=64)).decode("latin-1") + "\x00"
    return yaml.safe_dump(doc)


def _get(d, path):
    for k in path:
        d = d[k]
    return d


@settings(max_examples=240, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=bad_recipe_text())
def test_bad_recipes_never_traceback(text, run_cli, tmp_path_factory):
    f = tmp_path_factory.mktemp("r") / "bad.yaml"
    f.write_bytes(text.encode("utf-8", "surrogateescape"))
    code, out, err = run_cli("validate", str(f))
    assert "Traceback" not in out + err and "internal error" not in err
    if code == 0:
        return  # the mutation happened to be valid (~5%: e.g. a string where any string goes)
    assert code == 1, (code, out, err)
    errors = [line for line in out.splitlines() if ": error [" in line]
    assert errors, out
    for line in errors:
        assert line.startswith(str(f))  # names the file (and the line, where the YAML has one)
    assert out.count("    fix: ") >= len(errors)  # every error says what to do


def test_plan_on_a_bad_recipe_exits_2_with_file_line_field(run_cli, tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("name: x\nmodel: {preset: tiny}\ntraining:\n  steps: -3\n")
    code, out, err = run_cli("plan", str(f))
    assert code == 2 and f"{f}:4: training.steps" in err and "Traceback" not in err
