"""Helpers for runtime tests: free ports, plan files from recipe dicts, and real torchrun worlds.

A plain module (not conftest) so test files can import it by name; fixtures live in conftest.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

VENV_BIN = Path(sys.executable).parent
TORCHRUN = str(VENV_BIN / "torchrun")
# A persistent cache for DeepSpeed's JIT-built ops, so a compile (~50 s) happens once per machine.
TORCH_EXTENSIONS_DIR = str(Path.home() / ".cache" / "dtlaunch" / "torch_extensions")

# The base recipe of the runtime tests: the tiny preset at seq 64 on 2 CPU ranks, ~0.1-0.2 s per step.
BASE_RECIPE = {
    "name": "rt-test",
    "model": {"preset": "tiny", "seq_len": 64},
    "parallelism": {"strategy": "ddp", "precision": "fp32", "activation_checkpointing": "none", "offload": "none"},
    "resources": {"accelerator": "cpu:2", "nodes": 1, "network": "loopback"},
    "training": {
        "micro_batch": 4,
        "global_batch": 16,
        "steps": 20,
        "lr": 3.0e-3,
        "warmup_steps": 2,
        "timeout_seconds": 60,
        "init_timeout_seconds": 60,
        "log_every": 1,
        "data": {"source": "synthetic", "num_tokens": 60000},
    },
    "checkpoint": {"every": 10, "keep": 10, "export": "safetensors"},
}


def free_port() -> int:
    """A port free right now on 127.0.0.1 (29500 may belong to another job on this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def recipe_dict(**over) -> dict:
    """BASE_RECIPE with nested overrides, e.g. recipe_dict(parallelism={"strategy": "fsdp"})."""
    return deep_merge(BASE_RECIPE, over)


# The deterministic scenario shared by the restart, resume and torn-checkpoint tests: 12 steps,
# a checkpoint every 4 (async for FSDP, so background saves are covered too), all kept.
DET_STEPS = 12
DET_EVERY = 4


def det_recipe(strategy: str, **over) -> dict:
    base = recipe_dict(
        parallelism={"strategy": strategy},
        training={"deterministic": True, "steps": DET_STEPS},
        checkpoint={"every": DET_EVERY, "keep": 10, "async": strategy != "ddp"},
    )
    return deep_merge(base, over)


def write_plan(run_dir: Path, recipe: dict) -> Path:
    """Validate and plan `recipe` exactly as the CLI does, and write the plan file the job reads."""
    from launcher import planfile
    from launcher.plan import make_plan
    from launcher.recipe import load_text

    rec = load_text(yaml.safe_dump(recipe), source="<test recipe>")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "plan.json"
    path.write_text(planfile.dumps(rec, make_plan(rec)))
    return path


@dataclass
class RunResult:
    rc: int
    stdout: str
    stderr: str
    seconds: float
    run_dir: Path
    worker_codes: list[int] = field(default_factory=list)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def metrics(self) -> list[dict]:
        p = self.run_dir / "metrics.jsonl"
        if not p.exists():
            return []
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]

    def losses(self) -> dict[int, float]:
        """step -> loss; a step logged twice (after a restart) keeps the later value."""
        return {m["step"]: m["loss"] for m in self.metrics() if "loss" in m}

    def events(self, name: str) -> list[dict]:
        return [m for m in self.metrics() if m.get("event") == name]

    def statuses(self) -> dict[int, dict]:
        d = self.run_dir / "status"
        return (
            {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in sorted(d.glob("rank-*.json"))}
            if d.is_dir()
            else {}
        )


# What the job scripts start instead of torchrun: the same agent, which does not restart a final exit code.
ELASTIC = [sys.executable, "-m", "launcher.runtime.elastic"]


def torchrun_cmd(
    plan: Path,
    run_dir: Path,
    nproc: int,
    port: int,
    max_restarts: int,
    nnodes: int = 1,
    elastic: bool = False,
    worker: list[str] | None = None,
) -> list[str]:
    """`worker`: a command each rank runs instead of `python -m launcher.runtime.train ...` (given those arguments)."""
    train = ["-m", "launcher.runtime.train", "--plan", str(plan), "--run-dir", str(run_dir)]
    return [
        *(ELASTIC if elastic else [TORCHRUN]),
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=t{port}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2",
        *(["--no-python", *worker, sys.executable, *train] if worker else train),
    ]


def torchrun_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("DTLAUNCH_FAULT", None)
    env.update(
        {
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "TORCH_EXTENSIONS_DIR": TORCH_EXTENSIONS_DIR,
            "PYTHONWARNINGS": "ignore",
        }
    )
    env.update(extra or {})
    return env


def parse_worker_codes(stderr: str) -> list[int]:
    """Worker exit codes from torchrun's failure report (torchrun itself exits 1 on any failure)."""
    return [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)]


def run_torchrun(
    plan: Path,
    run_dir: Path,
    *,
    nproc: int = 2,
    max_restarts: int = 0,
    env: dict | None = None,
    timeout: float = 180,
    nnodes: int = 1,
    elastic: bool = False,
    prefix: list[str] | None = None,
    worker: list[str] | None = None,
    node_env: list[dict] | None = None,
) -> RunResult:
    """Run `python -m launcher.runtime.train` under a real torchrun; never hangs the suite (timeout kills it). `nnodes` > 1:
    that many torchrun agents on this machine, one per simulated node (each starts `nproc` ranks, its LOCAL_* as
    on a node of its own); their outputs are joined, the first agent's exit code is returned. `elastic`: through
    launcher.runtime.elastic, as the job scripts start it; `prefix`: a command that runs it (unshare); `worker`: a command
    that runs each rank (a wrapper that straces one of them); `node_env`: each agent's own variables (a node's name)."""
    port = free_port()
    t0 = time.monotonic()
    cmd = [*(prefix or []), *torchrun_cmd(plan, run_dir, nproc, port, max_restarts, nnodes, elastic, worker)]
    procs = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=torchrun_env({**(env or {}), **(node_env[i] if node_env else {})}),
            start_new_session=True,
        )
        for i in range(nnodes)
    ]
    outs, errs = [], []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            out, err = proc.communicate()
            err += f"\n[test harness] torchrun killed after {timeout}s"
        outs.append(out)
        errs.append(err)
    out, err = "".join(outs), "".join(errs)
    secs = time.monotonic() - t0
    (run_dir / f"torchrun-{int(t0 * 1000)}.log").write_text(out + "\n----- stderr -----\n" + err)
    return RunResult(procs[0].returncode, out, err, secs, run_dir, parse_worker_codes(err))


def start_torchrun(
    plan: Path, run_dir: Path, *, nproc: int = 2, max_restarts: int = 0, env: dict | None = None
) -> subprocess.Popen:
    """Start torchrun in the background (for tests that signal its workers)."""
    cmd = torchrun_cmd(plan, run_dir, nproc, free_port(), max_restarts)
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=torchrun_env(env), start_new_session=True
    )


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (torchrun's workers), from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(d.name))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every descendant: torchrun starts its workers in their own sessions, so
    killing torchrun's process group alone would leave them running."""
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(child_pids(p))
    for p in reversed(seen):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def worker_ranks(torchrun_pid: int) -> dict[int, int]:
    """{RANK: pid} of torchrun's workers, read from their environment."""
    out = {}
    for pid in child_pids(torchrun_pid):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = pid
    return out


def load_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))
