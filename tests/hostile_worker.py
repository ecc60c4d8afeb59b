"""Runs the hostile cases through the real CLI entry point, in a process with a memory limit, each command
under a time limit. Usage: python hostile_worker.py N SEED OUT.json (results: one record per command)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path

MEMORY_LIMIT = 3 << 30  # address space: a recipe that blows up memory fails here instead of taking the machine
TIME_LIMIT = 20  # seconds per command: anything slower is a hang


class Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise Hang()


def special_file(kind: str, d: Path) -> str:
    if kind.startswith("/dev/"):
        return kind
    p = d / kind.strip("<>")
    if kind == "<dir>":
        p.mkdir()
    elif kind == "<fifo>":
        os.mkfifo(p)
    elif kind == "<symlink-loop>":
        (d / "loop-b").symlink_to(p)
        p.symlink_to(d / "loop-b")
    elif kind == "<big>":
        p.write_text("name: x\n" + "# filler\n" * 200_000)
    elif kind == "<binary>":
        p.write_bytes(os.urandom(4096))
    return str(p)


def run(argv: list[str]) -> tuple[int, str, str, float]:
    from launcher.cli import main

    out, err = io.StringIO(), io.StringIO()
    old = sys.argv
    sys.argv = ["dtlaunch", *argv]
    code = 0
    t0 = time.perf_counter()
    signal.alarm(TIME_LIMIT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Hang:
        code = -1
    finally:
        signal.alarm(0)
        sys.argv = old
    return code, out.getvalue(), err.getvalue(), time.perf_counter() - t0


def main() -> None:
    n, seed, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    signal.signal(signal.SIGALRM, _alarm)
    sys.path.insert(0, str(Path(__file__).parent))
    from hostile import cases

    os.environ["DTLAUNCH_HOME"] = tempfile.mkdtemp(prefix="hostile-home-")
    results = []
    for cid, spec, overrides in cases(n, seed):
        with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
            d = Path(tmp)
            if "special" in spec:
                path = special_file(spec["special"], d)
            else:
                path = str(d / "recipe.yaml")
                Path(path).write_text(spec["recipe"], encoding="utf-8", errors="surrogateescape")
            sets = [a for o in overrides for a in ("--set", o)]
            commands = [["validate", path, *sets], ["plan", path, *sets, "--json"]]
            commands += [
                ["render", path, "-t", t, "--force", "-o", str(d / f"out-{t}"), *sets]
                for t in ("local", "slurm", "sky")
            ]
            for argv in commands:
                code, out, err, secs = run(argv)
                located = code == 0 or path in err or path in out or "--set" in err + out
                results.append(
                    {
                        "case": cid,
                        "command": argv[0] + (f" -t {argv[3]}" if argv[0] == "render" else ""),
                        "code": code,
                        "seconds": round(secs, 3),
                        "traceback": "Traceback" in out + err,
                        "internal": "internal error" in err,
                        "located": located,
                        "err": err[-400:]
                        if (code not in (0, 1, 2, 3) or "internal error" in err or not located)
                        else "",
                    }
                )
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
