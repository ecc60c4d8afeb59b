"""Recipes and runs for the GPU suite: the runtime tests' harness, on this machine's GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from rt_harness import TORCHRUN, deep_merge, free_port, kill_tree, recipe_dict, torchrun_env, write_plan

DRIVER = Path(__file__).with_name("gpu_driver.py")


def accelerator() -> str:
    """The catalog's name for this machine's GPU (the plan's memory budget and dense peak)."""
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    for key, sku in (
        ("H200", "H200"),
        ("H100", "H100"),
        ("B200", "B200"),
        ("A100", "A100-80GB" if "80GB" in name else "A100"),
        ("L40S", "L40S"),
        ("L4", "L4"),
        ("A10G", "A10G"),
    ):
        if key in name:
            return sku
    return "H100"


def gpu_recipe(gpus: int = 1, **over) -> dict:
    """The runtime tests' tiny recipe on `gpus` GPUs of this node, bf16, logging every step."""
    base = recipe_dict(
        resources={"accelerator": f"{accelerator()}:{gpus}", "network": "best"},
        parallelism={"precision": "bf16"},
        training={"preflight": False, "timeout_seconds": 120, "init_timeout_seconds": 300},
    )
    return deep_merge(base, over)


def run_cases(root: Path, nproc: int, cases: list[tuple[str, dict, dict]], timeout: float = 900) -> dict[str, Path]:
    """Run (name, recipe, env) cases one after another in one torchrun world of `nproc` GPUs (gpu_driver.py);
    each case's run dir gets result-rank0.json and placement-rank{r}.json."""
    root.mkdir(parents=True, exist_ok=True)
    spec, dirs = [], {}
    for name, rec, env in cases:
        d = root / name
        spec.append({"plan": str(write_plan(d, rec)), "run_dir": str(d), "env": env})
        dirs[name] = d
    (root / "cases.json").write_text(json.dumps(spec))
    cmd = [
        TORCHRUN,
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--max-restarts=0",
        str(DRIVER),
        str(root / "cases.json"),
    ]
    t0 = time.monotonic()
    env = torchrun_env()
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
    (root / "torchrun.log").write_text(out + "\n----- stderr -----\n" + err)
    print(
        f"\n{len(cases)} cases on {nproc} GPU(s) in {time.monotonic() - t0:.0f}s, rc {proc.returncode}", file=sys.stderr
    )
    return dirs


def result(d: Path) -> dict:
    r = d / "result-rank0.json"
    log = (d.parent / "torchrun.log").read_text()[-4000:] if (d.parent / "torchrun.log").exists() else ""
    assert r.exists(), f"{d.name} did not run:\n{log}"
    res = json.loads(r.read_text())
    assert res["error"] is None, res["error"]
    return res


def steps(d: Path) -> list[dict]:
    return [m for m in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
