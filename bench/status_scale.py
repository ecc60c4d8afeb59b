"""`dtlaunch status` over a registry of 1,000 local jobs: most long finished (no exit code: LOST), a few running.

Prints the wall time of `dtlaunch status --json` as a subprocess (interpreter start included) and of the rows
alone, in-process. Run: .venv/bin/python bench/status_scale.py [ROWS]
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import scratch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def fill(home: Path, rows: int, live: int) -> list[subprocess.Popen]:
    """`rows` registry rows in `home`; `live` of them are real processes carrying their attempt's marker."""
    from launcher.jobenv import ATTEMPT
    from launcher.targets.local import backend as local
    from launcher.targets.local.request import LocalHandle
    from launcher.targets.registry import JobRecord, Registry

    reg = Registry(home / "registry.db")
    run_dir = home / "run"
    procs = []
    for i in range(rows):
        attempt = f"up-bench-{i}"
        if i < live:
            p = subprocess.Popen(["sleep", "600"], env={**os.environ, ATTEMPT: attempt}, start_new_session=True)
            procs.append(p)
            pid, created = p.pid, local._start_time(p.pid) or time.time()
        else:  # a finished job: its pid gone (or since reused by another process), no exit file
            pid, created = 4_190_000 + i if i % 2 else os.getpid(), time.time() - 86400
        ident = getattr(local, "launcher_identity", None)  # absent before the fix: the bench runs on both
        extra = {"start_id": ident(pid)} if ident and i < live else {}
        handle = LocalHandle(
            pid,
            created,
            attempt,
            str(run_dir / "logs" / f"{attempt}.log"),
            str(run_dir / "status" / attempt / "exit_code"),
            **extra,
        )
        reg.add(JobRecord("bench", "local", str(pid), str(run_dir), handle, time.time() - rows + i))
    return procs


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    home = scratch("dtlaunch-status-bench-")
    os.environ["DTLAUNCH_HOME"] = str(home)
    procs = fill(home, rows, live=5)
    others = [subprocess.Popen(["sleep", "600"]) for _ in range(20)]  # a busier process table
    try:
        n_procs = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit())
        from launcher.cli.jobs import status_cmd

        buf = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(buf):
            status_cmd.callback(None, True)  # what `dtlaunch status --json` runs, without the interpreter's start
        rows_s = time.perf_counter() - t0
        assert len(json.loads(buf.getvalue())) == rows
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "launcher", "status", "--json"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL
        )
        cli_s = time.perf_counter() - t0
        print(
            f"status_scale: {rows} rows, {n_procs} processes: rows {rows_s:.3f} s in-process, "
            f"`dtlaunch status --json` {cli_s:.3f} s"
        )
    finally:
        for p in procs + others:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
