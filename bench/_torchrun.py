"""Shared helper of the training benchmarks: launch `launcher.runtime.train` (ours) and bench/minimal_loops.py
(the hand-written baseline) under the same real torchrun, with the same environment.

Also usable as a torchrun entry script: `_torchrun.py --hwm DIR -- launcher.runtime.train ARGS...` runs
`launcher.runtime.train`'s main() unchanged, then records this rank's peak RSS (VmHWM) in DIR/hwm-RANK.json.
(`launcher.runtime.train` leaves through os._exit, so an atexit hook would never run.)
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
MINIMAL = str(HERE / "minimal_loops.py")
TORCH_EXTENSIONS_DIR = str(Path.home() / ".cache" / "dtlaunch" / "torch_extensions")

# The training benchmarks' workload: the tiny Llama, seq 128, global batch 16 on 2 CPU ranks (grad_accum 2).
BASE_RECIPE = {
    "name": "bench",
    "model": {"preset": "tiny", "seq_len": 128},
    "parallelism": {"strategy": "ddp", "precision": "fp32", "activation_checkpointing": "none", "offload": "none"},
    "resources": {"accelerator": "cpu:2", "nodes": 1, "network": "loopback"},
    "training": {
        "micro_batch": 4,
        "global_batch": 16,
        "steps": 50,
        "lr": 3.0e-3,
        "warmup_steps": 2,
        "timeout_seconds": 120,
        "init_timeout_seconds": 120,
        "log_every": 5,
        "preflight": False,
        "data": {"source": "synthetic", "num_tokens": 400000},
    },
    "checkpoint": {"every": 1_000_000, "keep": 2, "export": "none"},
}


def vmhwm_mb() -> float:
    """Peak resident set size of this process (VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def recipe(**over) -> dict:
    return deep_merge(BASE_RECIPE, over)


def write_plan(run_dir: Path, rec: dict) -> Path:
    """Validate and plan the recipe exactly as `dtlaunch render` does; write the plan file the job reads."""
    import yaml

    sys.path.insert(0, str(ROOT))
    from launcher import planfile
    from launcher.plan import make_plan
    from launcher.recipe import load_text

    r = load_text(yaml.safe_dump(rec), source="<bench recipe>")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "plan.json"
    path.write_text(planfile.dumps(r, make_plan(r)))
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(extra: dict | None = None) -> dict:
    e = dict(os.environ)
    e.pop("DTLAUNCH_FAULT", None)
    e.update(
        {
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "TORCH_EXTENSIONS_DIR": TORCH_EXTENSIONS_DIR,
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": str(ROOT) + os.pathsep + e.get("PYTHONPATH", ""),
        }
    )
    e.update(extra or {})
    return e


def torchrun_cmd(entry: list[str], nproc: int = 2, max_restarts: int = 0) -> list[str]:
    port = free_port()
    return [
        PY,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=b{port}",
        f"--max-restarts={max_restarts}",
        *entry,
    ]


@dataclass
class Run:
    rc: int
    out: str
    err: str
    t_launch: float  # time.time() just before torchrun was started
    seconds: float
    run_dir: Path

    def metrics(self) -> list[dict]:
        p = self.run_dir / "metrics.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []

    def hwm(self) -> dict[int, float]:
        return {
            int(p.stem.split("-")[1]): json.loads(p.read_text())["vmhwm_mb"] for p in self.run_dir.glob("hwm-*.json")
        }

    def check(self) -> Run:
        if self.rc != 0:
            raise RuntimeError(f"torchrun exited {self.rc} in {self.run_dir}:\n{(self.out + self.err)[-3000:]}")
        return self


def torchrun(
    entry: list[str],
    run_dir: Path,
    *,
    nproc: int = 2,
    max_restarts: int = 0,
    extra_env: dict | None = None,
    timeout: float = 600,
) -> Run:
    """Run one torchrun job to completion (killed as a process group after `timeout`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_cmd(entry, nproc, max_restarts)
    t_launch = time.time()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(extra_env),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[bench] torchrun killed after {timeout}s"
    secs = time.monotonic() - t0
    (run_dir / "torchrun.log").write_text(out + "\n----- stderr -----\n" + err)
    return Run(proc.returncode, out, err, t_launch, secs, run_dir)


def ours(rec: dict, run_dir: Path, *, hwm: bool = True, **kw) -> Run:
    """`launcher.runtime.train` on the plan of `rec` (optionally through the VmHWM wrapper)."""
    plan = write_plan(run_dir, rec)
    args = ["--plan", str(plan), "--run-dir", str(run_dir)]
    entry = (
        [__file__, "--hwm", str(run_dir), "--", "launcher.runtime.train", *args]
        if hwm
        else ["-m", "launcher.runtime.train", *args]
    )
    return torchrun(entry, run_dir, **kw)


def minimal(args: list[str], run_dir: Path, **kw) -> Run:
    """bench/minimal_loops.py with `args`; it writes run_dir/minimal-RANK.json itself."""
    return torchrun([MINIMAL, "--out", str(run_dir), *args], run_dir, **kw)


def _wrap(argv: list[str]) -> int:
    """Entry-script mode: run launcher.runtime.train's main() and record this rank's VmHWM afterwards."""
    out = Path(argv[argv.index("--hwm") + 1])
    rest = argv[argv.index("--") + 1 :]
    assert rest[0] == "launcher.runtime.train", rest
    sys.path.insert(0, str(ROOT))
    from launcher.runtime import train

    code = train.main(rest[1:])
    rank = int(os.environ.get("RANK", "0"))
    (out / f"hwm-{rank}.json").write_text(json.dumps({"rank": rank, "vmhwm_mb": vmhwm_mb()}))
    train._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(_wrap(sys.argv))
