"""`dtlaunch plan --compare deepspeed`: DeepSpeed's own estimators (the installed DeepSpeed, called for real) beside
the planner's model states, every difference with its reason, and a clear error when DeepSpeed is missing."""

import json
import os
import subprocess
import sys

import pytest

from testpaths import RECIPES, ROOT

ZERO3 = RECIPES / "llama2-13b-zero3.yaml"


def _compare(run_cli, *sets):
    args = ["plan", ZERO3, "--compare", "deepspeed", "--json"]
    for s in sets:
        args += ["--set", s]
    code, out, err = run_cli(*args)
    d = json.loads(out)  # stdout is JSON only: DeepSpeed's import-time log goes to stderr
    # a layout that does not fit is still compared; plan exits 1 for it, as validate does
    assert code == (1 if any(f["severity"] == "error" for f in d["findings"]) else 0), err
    return d, d["compare"]["deepspeed"]


def _rows(c):
    return {r["term"]: r for r in c["rows"]}


def _check_reasons(c):
    for r in c["rows"]:
        if abs(r["dtlaunch_bytes"] - r["deepspeed_bytes"]) >= 0.005e9:
            assert r["why"], f"{r['term']} differs without a reason"


def test_zero3_offload_against_deepspeeds_own_estimate(run_cli):
    d, c = _compare(run_cli)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs  # after: its log is not ours

    a = c["arguments"]
    assert a["total_params"] == d["params"] and a["num_nodes"] * a["num_gpus_per_node"] == d["world_size"]
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        total_params=a["total_params"],
        largest_layer_params=a["largest_layer_params"],
        num_gpus_per_node=a["num_gpus_per_node"],
        num_nodes=a["num_nodes"],
        cpu_offload=True,
        cpu_offload_params=False,
    )
    rows = _rows(c)
    total = rows.pop("model states per GPU")
    assert total["deepspeed_bytes"] == gpu and c["deepspeed_cpu_bytes_per_node"] == cpu
    # the per-term split of DeepSpeed's figure adds up to what DeepSpeed returns
    assert sum(r["deepspeed_bytes"] for r in rows.values()) == pytest.approx(gpu, abs=len(rows))
    assert total["dtlaunch_bytes"] == pytest.approx(sum(r["dtlaunch_bytes"] for r in rows.values()), abs=len(rows))
    # ZeRO-Offload: on the GPU only the 16-bit weights' partition, in both
    assert rows["16-bit weights (partition)"]["dtlaunch_bytes"] == pytest.approx(2 * d["params"] / 8, rel=1e-6)
    for term in ("16-bit gradients", "fp32 gradients (optimizer step)", "fp32 weights + Adam moments"):
        assert rows[term]["dtlaunch_bytes"] == 0 == rows[term]["deepspeed_bytes"], term
    assert d["memory"]["grads"] == 0 and d["memory"]["optimizer"] == 0
    _check_reasons(c)
    assert "Estimated memory needed for params, optim states and gradients" in c["printed"]


def test_zero2_without_offload_agrees_on_states_and_says_when_fp32_grads_live(run_cli):
    d, c = _compare(run_cli, "parallelism.strategy=zero2", "parallelism.offload=none")
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    n = d["params"]
    _, gpu = estimate_zero2_model_states_mem_needs(total_params=n, num_gpus_per_node=4, num_nodes=2, cpu_offload=False)
    rows = _rows(c)
    assert rows["model states per GPU"]["deepspeed_bytes"] == gpu
    # 2 + 18/8 bytes per parameter in both: same figures, but the fp32 gradients are only alive in the step
    assert rows["model states per GPU"]["dtlaunch_bytes"] == pytest.approx(gpu, rel=1e-6)
    fp32 = rows["fp32 gradients (optimizer step)"]
    assert fp32["dtlaunch_bytes"] == pytest.approx(4 * n / 8, rel=1e-6) and "optimizer step" in fp32["why"]
    _check_reasons(c)


def test_zero1_reasons_its_whole_gradients(run_cli):
    _, c = _compare(run_cli, "parallelism.strategy=zero1", "parallelism.offload=none")
    g = _rows(c)["16-bit gradients"]
    assert g["dtlaunch_bytes"] == pytest.approx(8 * g["deepspeed_bytes"], rel=1e-6)
    assert "ZeRO-1" in g["why"]
    assert any("no ZeRO-1 estimator" in n for n in c["notes"])
    _check_reasons(c)


def test_text_output_shows_deepspeed_then_the_table(run_cli):
    code, out, err = run_cli("plan", ZERO3, "--compare", "deepspeed")
    assert code == 0, err
    ds = out.index("Estimated memory needed for params")  # DeepSpeed's own print, verbatim
    table = out.index("Model states per GPU in GB (1e9 bytes)")
    assert out.index("Per-device memory") < ds < table  # after the plan itself
    assert "why: " in out[table:] and "GiB" in out


def test_a_plan_deepspeed_does_not_estimate_is_refused_clearly(run_cli):
    code, _, err = run_cli("plan", RECIPES / "llama70b.yaml", "--compare", "deepspeed")
    assert code != 0
    assert "error:" in err and "ZeRO" in err and "parallelism.strategy=zero3" in err
    assert "Traceback" not in err


def test_compare_with_sweep_is_a_usage_error(run_cli):
    code, _, err = run_cli("plan", ZERO3, "--compare", "deepspeed", "--sweep", "training.micro_batch=1,2")
    assert code == 2 and "--compare" in err and "Traceback" not in err


# A meta-path finder placed first makes `import deepspeed` fail exactly as it does where DeepSpeed is not installed.
NO_DEEPSPEED = """
import sys
class NoDeepSpeed:
    def find_spec(self, name, path=None, target=None):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoDeepSpeed())
from launcher.cli import main
sys.argv = ["dtlaunch"] + sys.argv[1:]
main()
"""


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_without_deepspeed_says_how_to_install_it(json_flag):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [sys.executable, "-c", NO_DEEPSPEED, "plan", str(ZERO3), "--compare", "deepspeed", *json_flag],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode not in (0, 70), r.stderr  # a user error, not a bug of ours
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert "needs DeepSpeed" in r.stderr and "pip install" in r.stderr
    if json_flag:
        assert r.stdout == ""  # no half-written JSON
