"""What `plan` prints for the recipes a new user starts with: real parameter counts, a memory unit that shows
the figures, no dollar cost for CPU ranks, and validate's findings with its exit code."""

from __future__ import annotations

import json
import re

import pytest

from launcher.cli.common import duration, seconds
from launcher.cli.planning import count
from launcher.plan import make_plan
from launcher.recipe import load
from launcher.validate import validate
from testpaths import RECIPES

TINY = str(RECIPES / "tiny.yaml")


@pytest.mark.parametrize(
    "n, text",
    [
        (70_553_706_496, "70.55B"),
        (1_240_000_000, "1.24B"),
        (947_328, "0.9M"),
        (600_000, "0.6M"),
        (12_345, "12.3K"),
        (512, "512"),
    ],
)
def test_a_parameter_count_is_written_as_people_write_it(n, text):
    assert count(n) == text


def test_short_spans_are_not_rounded_to_zero_hours():
    assert duration(1427.0) == "1,427.0 h"
    assert duration(37 / 60) == "37 min"
    assert duration(12 / 3600) == "12 s"
    assert seconds(52.94) == "52.9 s" and seconds(0.005) == "5 ms"


def test_plan_of_the_tiny_cpu_recipe_reads_truthfully(run_cli):
    code, out, err = run_cli("plan", TINY)
    assert code == 0, err
    p = make_plan(load(TINY))
    head = out.splitlines()[0]
    assert f"{p.params / 1e6:.1f}M parameters" in head and "0.00B" not in out
    # the chosen layout needs well under 1 GB: the table is in MB, and its figures are not a column of 0.0
    assert "Per-device memory, MB (1e6 bytes)" in out
    chosen = next(line for line in out.splitlines() if line.lstrip().startswith("* "))
    assert float(chosen.split()[-2]) == pytest.approx(p.memory.total / 1e6, abs=0.06)
    # a CPU rank has the host's memory, and no hourly price: no "$0"
    assert re.search(r"this machine has [\d.]+ GB for its 2 rank\(s\) per node", out)
    assert "$" not in out and "cost: none counted (cpu has no hourly price in the catalog)" in out
    assert " steps = 0.0 h" not in out and "write ~0.0 s" not in out


def test_plan_reports_what_validate_refuses_with_validates_exit_code(run_cli, tmp_path):
    """A recipe written from the README: plan used to say "fits" and exit 0 while validate and up refused it for
    a default the user never wrote (training.data.num_tokens)."""
    recipe = tmp_path / "r8b.yaml"
    recipe.write_text(
        "name: r8b\nmodel: {preset: llama3-8b, seq_len: 4096}\nresources: {accelerator: 'A100:8', nodes: 2}\n"
        "training: {global_batch: 256, steps: 100}\n"
    )
    v_code, v_out, _ = run_cli("validate", recipe)
    code, out, err = run_cli("plan", recipe)
    assert v_code == 1 and code == 1
    assert "error [data-too-small] training.data.num_tokens" in v_out
    assert "error [data-too-small] training.data.num_tokens" in err and "validate refuses this recipe" in err
    assert "fits" in out  # the plan itself is still shown, on stdout
    code, out, _ = run_cli("plan", recipe, "--json")
    assert code == 1
    rules = {f["rule"] for f in json.loads(out)["findings"]}
    assert rules == {f.rule for f in validate(load(str(recipe)), make_plan(load(str(recipe))))}
    assert "data-too-small" in rules


def test_a_recipe_validate_passes_plans_with_exit_0_and_its_warnings_on_stderr(run_cli):
    code, out, err = run_cli("plan", RECIPES / "llama70b.yaml")
    assert code == 0
    assert "warning [data-path]" in err and "warning" not in out


def test_an_explicit_shape_is_named_by_its_architecture(run_cli, tmp_path):
    recipe = tmp_path / "shape.yaml"
    recipe.write_text(
        "name: shaped\nmodel: {layers: 4, hidden: 256, ffn_hidden: 688, heads: 4, kv_heads: 4, vocab: 1000, "
        "seq_len: 128}\nresources: {accelerator: 'cpu:2'}\ntraining: {global_batch: 8, steps: 10}\n"
        "targets: {default: local}\n"
    )
    code, out, err = run_cli("plan", recipe)
    assert code == 0, err
    assert out.splitlines()[0].startswith("shaped: llama-style, 4 layers x 256 hidden, ")
