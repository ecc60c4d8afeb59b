"""The hostile inputs of the reliability review that the generic property test (tests/test_hostile.py) only
checks for "no traceback, no hang": each one here must be refused by `validate` as a located recipe error
(the file and line, or the --set item, and the field), never accepted, never an internal error."""

from __future__ import annotations

import pytest

from testpaths import RECIPES

TINY = (RECIPES / "tiny.yaml").read_text()
DEEP = 5000

# finding -> (YAML appended to / replacing part of the tiny recipe, or None; --set items; text the error names)
CASES = {
    "F16-deep-set": (None, [f"env.X={'[' * DEEP}{']' * DEEP}"], "--set env.X"),
    "F16-recursive-alias": ("secrets: &r [*r]\n", [], "through YAML aliases"),
    "F16-deep-mapping": ("extra: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", [], "tiny.yaml"),
    "F17-huge-int": (None, ["training.steps=" + "9" * 400], "training.steps"),
    "F17-inf-mtbf": (None, ["resources.gpu_mtbf_hours=.inf"], "gpu_mtbf_hours"),
    "F18-inf-gpu-memory": (None, ["resources.gpu_memory_gb=.inf"], "gpu_memory_gb"),
    "F19-heads": (None, ["model.heads=3", "model.kv_heads=3"], "model"),
    "F19-betas": (None, ["training.betas=[2, 3]"], "training.betas"),
    "F19-seed": (None, [f"training.seed={2**70}"], "training.seed"),
    "F19-timeout": (None, [f"training.timeout_seconds={10**15}"], "training.timeout_seconds"),
    "F20-inf-lr": (None, ["training.lr=.inf"], "training.lr"),
    "F20-tiny-storage": (None, ["resources.storage_gbps_per_node=1e-300"], "storage_gbps_per_node"),
    "F21-duplicate-key": ("name: again\n", [], "name"),
    "F22-empty-count": (None, ["resources.accelerator='H100:'"], "the count after ':'"),
    "F22-fullwidth-digit": (None, ["resources.accelerator=H100:８"], "in ASCII digits"),
    "F23-bool-as-int": (None, ["parallelism.tensor=true"], "parallelism.tensor"),
    "F23-bool-nodes": (None, ["resources.nodes=true"], "resources.nodes"),
    "F27-nul-in-env": ('env: {A: "x\\0y"}\n', [], "env"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_review_finding_is_a_located_recipe_error(case, run_cli, tmp_path):
    extra, sets, names = CASES[case]
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY + (extra or ""))
    code, out, err = run_cli("validate", path, *[a for s in sets for a in ("--set", s)])
    text = out + err
    assert code == 1, f"{case}: exit {code}, expected a recipe error:\n{text[-2000:]}"
    assert "internal error" not in text and "Traceback" not in text, text[-2000:]
    assert names in text, f"{case}: the error does not name {names!r}:\n{text[-2000:]}"


def test_a_checkpoint_of_another_recipe_is_refused_unless_allowed():
    """F26's third run: a checkpoint written by another recipe (here another learning rate and data) in the same
    directory is refused with what differs, unless checkpoint.resume_changed_recipe allows it; the length of
    training and the world size may change freely."""
    from launcher.runtime.checkpoint.compat import check_compatible, identity
    from launcher.runtime.failures import ConfigError

    base = {
        "model": {"preset": "tiny"},
        "training": {"lr": 3e-3, "seed": 0, "steps": 40, "data": {"source": "synthetic", "num_tokens": 200000}},
    }
    other = {
        "model": {"preset": "tiny"},
        "training": {"lr": 1e-4, "seed": 0, "steps": 80, "data": {"source": "synthetic", "num_tokens": 999}},
    }

    def meta(r):
        return {
            "format": 1,
            "shape": "tiny",
            "family": "torch",
            "strategy": "fsdp",  # noqa: E731
            "world_size": 2,
            "identity": identity(r),
        }

    with pytest.raises(ConfigError, match=r"different recipe.*training\.data\.num_tokens.*training\.lr") as e:
        check_compatible(meta(base), meta(other), world_size=2, deepspeed=False, allow_changed_recipe=False, fmt=1)
    assert "resume_changed_recipe" in e.value.fix
    notes = check_compatible(meta(base), meta(other), world_size=2, deepspeed=False, allow_changed_recipe=True, fmt=1)
    assert any("recipe changed (allowed): training.lr" in n for n in notes), notes
    longer = {**base, "training": {**base["training"], "steps": 400}}
    # no ConfigError: a longer run on another world size is the same run
    check_compatible(meta(base), meta(longer), world_size=4, deepspeed=False, allow_changed_recipe=False, fmt=1)
