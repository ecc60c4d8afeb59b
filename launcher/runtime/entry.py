"""The user's own training code, as the job scripts start it on every rank (under torchrun or DeepSpeed):

    python -m launcher.runtime.entry path/to/train.py ARGS...      (entrypoint.script)
    python -m launcher.runtime.entry --module pkg.train ARGS...     (entrypoint.module)

It runs the code exactly as `python train.py ARGS` / `python -m pkg.train ARGS` would (same `__main__`, same
sys.argv, same sys.path), and adds the one thing a job needs that a script would not do by itself: the
rank's exit code, and how far the run got, go to the status files the job scripts read to decide between
requeue (42 after a checkpoint), restart (43 hang) and giving up (2 bad config, 45 diverged). The code
sees the environment contract (DTLAUNCH_PLAN, DTLAUNCH_RUN_DIR, DTLAUNCH_CHECKPOINT_DIR, DTLAUNCH_RUN_ID)
and may use dtlaunch's library (`launcher.init()`) or not at all.

No preemption handler is installed here: a script that does not use the library keeps Python's default
(TERM ends it at once; its last checkpoint is the resume point), one that does gets the library's flag.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path

USAGE = "usage: python -m launcher.runtime.entry SCRIPT.py [ARGS...] | --module MODULE [ARGS...]"


def _exit_code(value) -> tuple[int, str]:
    """sys.exit's argument as a process exit status, the way the interpreter maps it."""
    if value is None:
        return 0, "finished"
    if isinstance(value, bool):
        return int(value), f"exit {int(value)}"
    if isinstance(value, int):
        return value & 0xFF, "finished" if value == 0 else f"exit {value}"
    print(value, file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return 1, str(value)[:300]


def run(target: str, args: list[str], *, module: bool) -> tuple[int, str]:
    """Run the user's code in this process; (exit code, message) of how it ended."""
    from .status import classify

    sys.argv = [target, *args]
    try:
        if module:
            sys.path.insert(0, os.getcwd())  # what `python -m` does
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            path = Path(target)
            if not path.is_file():
                from ..jobenv import ExitCode

                return ExitCode.CONFIG, f"entrypoint script {target} not found in {os.getcwd()}"
            sys.path.insert(0, str(path.resolve().parent))  # what `python script.py` does
            runpy.run_path(str(path), run_name="__main__")
        return 0, "finished"
    except SystemExit as e:
        return _exit_code(e.code)
    except BaseException as exc:  # noqa: BLE001 - every ending becomes an exit code
        from ..errors import DtlaunchError

        code, message = classify(exc, None)
        if not isinstance(exc, (DtlaunchError, KeyboardInterrupt)):
            traceback.print_exc()
        return code, message


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    module = bool(argv) and argv[0] in ("-m", "--module")
    if module:
        argv.pop(0)
    if not argv or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    target, args = argv[0], argv[1:]

    from .. import jobenv
    from .signals import die_with_parent
    from .status import progress, rank_from_env, write_status

    die_with_parent()  # if torchrun dies, this rank must not train on alone
    code, message = run(target, args, module=module)
    rank = rank_from_env()
    start, step = progress()
    if code != 0:
        print(
            f"dtlaunch: rank {rank}: exit {code} ({jobenv.ExitCode.name_of(code)}): {message}",
            file=sys.stderr,
            flush=True,
        )
    write_status(Path(os.environ.get(jobenv.RUN_DIR) or "."), rank, code, message, step, start)
    if code == jobenv.ExitCode.HANG:
        from .hangs import on_hang

        on_hang(rank)
    return code


if __name__ == "__main__":
    sys.exit(main())
