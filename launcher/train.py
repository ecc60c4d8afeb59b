"""The job's entry point: `python -m launcher.train --plan PLAN.json [--run-dir DIR]` (under torchrun,
srun or SkyPilot). It trains exactly the resolved plan that `dtlaunch plan` showed.

Every ending maps to one exit code from launcher.exitcodes, with a one-paragraph message instead of a
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

from . import exitcodes
from .errors import DtlaunchError

CODE_NAMES = {exitcodes.OK: "OK", exitcodes.FAILED: "FAILED", exitcodes.CONFIG: "CONFIG", exitcodes.PREEMPTED: "PREEMPTED",
              exitcodes.HANG: "HANG", exitcodes.PREFLIGHT: "PREFLIGHT"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launcher.train", description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="the plan file written by `dtlaunch render` (plan.json)")
    p.add_argument("--run-dir", default=None,
                   help="where metrics.jsonl, the exported model and checkpoints (by default) go; "
                        "default: $DTLAUNCH_RUN_DIR, else the plan file's directory")
    # The deepspeed launcher appends --local_rank=N unless started with --no_local_rank; the rank comes
    # from the environment either way.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _rank() -> int:
    for k in ("RANK", "SLURM_PROCID", "SKYPILOT_NODE_RANK"):
        if os.environ.get(k, "").isdigit():
            return int(os.environ[k])
    return 0


def write_status(run_dir: Path, rank: int, code: int, message: str, step: Optional[int]) -> None:
    try:
        d = run_dir / "status"
        d.mkdir(parents=True, exist_ok=True)
        rec = {"rank": rank, "code": code, "name": CODE_NAMES.get(code, str(code)), "message": message, "step": step,
               "time": time.time(), "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)}
        tmp = d / f".rank-{rank:05d}.json.tmp"
        tmp.write_text(json.dumps(rec, indent=2) + "\n")
        os.replace(tmp, d / f"rank-{rank:05d}.json")
    except OSError:
        pass  # the exit code still tells the story


def classify(exc: BaseException, step: Optional[int], timeout_s: Optional[float]) -> tuple[int, str]:
    """(exit code, message) for an exception that escaped the training loop."""
    from .runtime.failures import is_comm_error, is_timeout

    where = f"during step {step}" if step else "before the first step"
    if isinstance(exc, DtlaunchError):
        return exc.exit_code, str(exc)
    if is_timeout(exc):
        return exitcodes.HANG, (f"a collective timed out {where} (training.timeout_seconds={timeout_s}): another rank "
                                f"stopped responding or diverged. Underlying error: {str(exc).splitlines()[0][:300]}")
    if is_comm_error(exc):
        text = str(exc)
        mismatch = any(m in text for m in ("preamble", "mismatch", "EnforceNotMet"))
        code = exitcodes.HANG if mismatch else exitcodes.FAILED
        what = "ranks issued mismatched collectives (divergence)" if mismatch else "communication with a peer failed"
        return code, f"{what} {where}: {text.splitlines()[0][:300]}"
    if isinstance(exc, KeyboardInterrupt):
        return exitcodes.FAILED, f"interrupted {where}"
    return exitcodes.FAILED, f"training failed {where}: {type(exc).__name__}: {exc}"


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    rank = _rank()
    from . import planfile

    try:
        recipe, plan, doc = planfile.read(args.plan)
    except DtlaunchError as e:
        print(f"dtlaunch: rank {rank}: cannot read the plan:\n{e}", file=sys.stderr, flush=True)
        return exitcodes.CONFIG
    run_dir = Path(args.run_dir or os.environ.get("DTLAUNCH_RUN_DIR") or Path(args.plan).resolve().parent)
    for k, v in recipe.env.items():  # the recipe's plain environment, unless the launcher already set it
        os.environ.setdefault(k, v)
    from .runtime.loop import Trainer

    trainer = Trainer(recipe, plan, run_dir, recipe_hash=doc.get("recipe_hash"))
    try:
        code = trainer.run()
        message = "finished"
    except BaseException as exc:  # noqa: BLE001 - every ending becomes an exit code
        step = getattr(trainer, "current", None)
        code, message = classify(exc, step, recipe.training.timeout_seconds)
        if code == exitcodes.FAILED and not isinstance(exc, (DtlaunchError, KeyboardInterrupt)):
            traceback.print_exc()  # an unexpected error is a bug: keep the traceback for the report
        label = CODE_NAMES.get(code, str(code))
        print(f"dtlaunch: rank {rank}: exit {code} ({label}): {message}", file=sys.stderr, flush=True)
        write_status(run_dir, rank, code, message, step)
        sys.stdout.flush()
        sys.stderr.flush()
        # No destroy_process_group on failure: peers may be gone (it would hang), and C++ teardown of a
        # live group can abort the process, replacing our exit code with SIGABRT.
        os._exit(code)
    write_status(run_dir, rank, code, message, trainer.step)
    from .runtime.dist import shutdown

    shutdown()
    return code


def _exit(code: int) -> None:
    """Leave without interpreter teardown: everything is flushed, committed and fsynced by now, and
    tearing down torch/gloo/DeepSpeed state costs seconds per rank (and has aborted processes here)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
