"""The job's entry point: `python -m launcher.train --plan PLAN.json [--run-dir DIR]` (under torchrun,
srun or SkyPilot). It trains exactly the resolved plan that `dtlaunch plan` showed.

Every ending maps to one exit code from launcher.jobenv.ExitCode, with a one-paragraph message instead of a
traceback for anything a user can act on. torchrun itself exits 1 whenever a worker fails, so each rank
also records its code in RUN_DIR/status/rank-NNNNN.json for wrappers that decide requeue vs give up.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

from . import jobenv
from .errors import DtlaunchError
from .jobenv import ExitCode


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launcher.train", description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="the plan file written by `dtlaunch render` (plan.json)")
    p.add_argument("--run-dir", default=None,
                   help="where metrics.jsonl, the exported model and checkpoints (by default) go; "
                        "default: $DTLAUNCH_RUN_DIR, else the plan file's directory")
    p.add_argument("--check", action="store_true",
                   help="check that this machine can run the plan (imports, versions, plan, data, checkpoint "
                        "directory), print one line, and exit: 0 ok, 2 not (the job scripts run it before torchrun)")
    # The deepspeed launcher appends --local_rank=N unless started with --no_local_rank; the rank comes
    # from the environment either way.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _rank() -> int:
    for k in ("RANK", "SLURM_PROCID", "SKYPILOT_NODE_RANK"):
        if os.environ.get(k, "").isdigit():
            return int(os.environ[k])
    return 0


def status_dir(run_dir: Path) -> Path:
    """Where this attempt's ranks report how they ended: $DTLAUNCH_STATUS, set per attempt by the job scripts."""
    return Path(os.environ.get(jobenv.STATUS) or run_dir / "status" / "manual")


def write_status(run_dir: Path, rank: int, code: int, message: str, step: Optional[int],
                 start_step: Optional[int] = None, code_file: bool = True) -> None:
    """Two records per rank: a JSON one for people (run_dir/status/rank-N.json, the latest), and a one-line
    "CODE STEP START_STEP" file in this attempt's status directory for the job scripts, which pick the job's
    exit code (and whether a time-limited allocation made progress) from it with nothing but `read`.
    code_file=False writes the first only (torchrun's report of a rank that died without its own record)."""
    try:
        d = run_dir / "status"
        d.mkdir(parents=True, exist_ok=True)
        rec = {"rank": rank, "code": code, "name": ExitCode.name_of(code), "message": message, "step": step,
               "start_step": start_step, "time": time.time(), "attempt": os.environ.get(jobenv.ATTEMPT),
               "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)}
        tmp = d / f".rank-{rank:05d}.json.tmp"
        tmp.write_text(json.dumps(rec, indent=2) + "\n")
        os.replace(tmp, d / f"rank-{rank:05d}.json")
        if not code_file:
            return
        a = status_dir(run_dir)
        a.mkdir(parents=True, exist_ok=True)
        tmp = a / f".rank-{rank:05d}.code.tmp"
        tmp.write_text(f"{int(code)} {int(step or 0)} {int(start_step or 0)}\n")
        os.replace(tmp, a / f"rank-{rank:05d}.code")
    except OSError:
        pass  # the exit code still tells the story


def classify(exc: BaseException, step: Optional[int], timeout_s: Optional[float]) -> tuple[int, str]:
    """(exit code, message) for an exception that escaped the training loop."""
    from .runtime.failures import is_comm_error, is_timeout

    where = f"during step {step}" if step else "before the first step"
    if isinstance(exc, DtlaunchError):
        return exc.exit_code, str(exc)
    if is_timeout(exc):
        return ExitCode.HANG, (f"a collective timed out {where} (training.timeout_seconds={timeout_s}): another rank "
                                f"stopped responding or diverged. Underlying error: {str(exc).splitlines()[0][:300]}")
    if is_comm_error(exc):
        text = str(exc)
        mismatch = any(m in text for m in ("preamble", "mismatch", "EnforceNotMet"))
        code = ExitCode.HANG if mismatch else ExitCode.FAILED
        what = "ranks issued mismatched collectives (divergence)" if mismatch else "communication with a peer failed"
        return code, f"{what} {where}: {text.splitlines()[0][:300]}"
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.FAILED, f"interrupted {where}"
    return ExitCode.FAILED, f"training failed {where}: {type(exc).__name__}: {exc}"


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    rank = _rank()
    from . import planfile

    try:
        recipe, plan, doc = planfile.read(args.plan)
    except DtlaunchError as e:
        print(f"dtlaunch: rank {rank}: cannot read the plan:\n{e}", file=sys.stderr, flush=True)
        return ExitCode.CONFIG
    run_dir = Path(args.run_dir or os.environ.get(jobenv.RUN_DIR) or Path(args.plan).resolve().parent)
    if args.check:
        return _check(recipe, plan, run_dir)
    for k, v in recipe.env.items():  # the recipe's plain environment, unless the launcher already set it
        os.environ.setdefault(k, v)
    from .runtime.loop import Trainer

    trainer = Trainer(recipe, plan, run_dir, recipe_hash=doc.get("recipe_hash"))
    try:
        code = trainer.run()
        message = "finished"
    except BaseException as exc:  # noqa: BLE001 - every ending becomes an exit code
        step = trainer.current
        code, message = classify(exc, step, recipe.training.timeout_seconds)
        if code == ExitCode.FAILED and not isinstance(exc, (DtlaunchError, KeyboardInterrupt)):
            traceback.print_exc()  # an unexpected error is a bug: keep the traceback for the report
        label = ExitCode.name_of(code)
        print(f"dtlaunch: rank {rank}: exit {code} ({label}): {message}", file=sys.stderr, flush=True)
        write_status(run_dir, rank, code, message, step, trainer.start_step)
        sys.stdout.flush()
        sys.stderr.flush()
        # No destroy_process_group on failure: peers may be gone (it would hang), and C++ teardown of a
        # live group can abort the process, replacing our exit code with SIGABRT.
        os._exit(code)
    write_status(run_dir, rank, code, message, trainer.step, trainer.start_step)
    from .runtime.dist import shutdown

    shutdown()
    return code


def _check(recipe, plan, run_dir: Path) -> int:
    try:
        from .runtime.check import check

        summary = check(recipe, plan, run_dir)
    except DtlaunchError as e:
        print(f"dtlaunch: this node cannot run the plan: {e}", file=sys.stderr, flush=True)
        return ExitCode.CONFIG
    except ImportError as e:
        print(f"dtlaunch: this node cannot run the plan: {e} (install dtlaunch[train] in the job's environment)",
              file=sys.stderr, flush=True)
        return ExitCode.CONFIG
    print(f"dtlaunch: check ok: {summary}", flush=True)
    return ExitCode.OK


def _exit(code: int) -> None:
    """Leave without interpreter teardown: everything is flushed, committed and fsynced by now, and
    tearing down torch/gloo/DeepSpeed state costs seconds per rank (and has aborted processes here)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
