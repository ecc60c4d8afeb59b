"""The job's entry point: `python -m launcher.runtime.train --plan PLAN.json [--run-dir DIR]` (under torchrun,
srun or SkyPilot). It trains exactly the resolved plan that `dtlaunch plan` showed.

Every ending maps to one exit code from launcher.jobenv.ExitCode, with a one-paragraph message instead of a
traceback for anything a user can act on. torchrun itself exits 1 whenever a worker fails, so each rank
also records its code in RUN_DIR/status/rank-NNNNN.json for wrappers that decide requeue vs give up.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from .. import jobenv
from ..errors import DtlaunchError
from ..jobenv import ExitCode
from .status import PEER_LOST, classify, is_oom, rank_from_env, write_check_record, write_status


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launcher.runtime.train", description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="the plan file written by `dtlaunch render` (plan.json)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="where metrics.jsonl, the exported model and checkpoints (by default) go; "
        "default: $DTLAUNCH_RUN_DIR, else the plan file's directory",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check that this machine can run the plan (imports, versions, plan, data, checkpoint "
        "directory), print one line, and exit: 0 ok, 2 not (the job scripts run it before torchrun)",
    )
    # The deepspeed launcher appends --local_rank=N unless started with --no_local_rank; the rank comes
    # from the environment either way.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.check:
        return check(args.plan, args.run_dir)
    rank = rank_from_env()
    from .signals import PreemptionFlag, die_with_parent

    # First things first, before the seconds of importing torch: a preemption signal that arrives during
    # start-up must set the flag (checkpoint at the first step boundary), not kill the process; and if
    # torchrun dies, this worker must not train on alone.
    flag = PreemptionFlag().install()
    die_with_parent()
    from .. import planfile

    try:
        recipe, plan, doc = planfile.read(args.plan)
    except DtlaunchError as e:
        print(f"dtlaunch: rank {rank}: cannot read the plan:\n{e}", file=sys.stderr, flush=True)
        return ExitCode.CONFIG
    run_dir = _run_dir(args.plan, args.run_dir)
    for k, v in recipe.env.items():  # the recipe's plain environment, unless the launcher already set it
        os.environ.setdefault(k, v)
    from .loop import Trainer

    trainer = Trainer(recipe, plan, run_dir, recipe_hash=doc.get("recipe_hash"), flag=flag)
    try:
        code = trainer.run()
        message = "finished"
    except BaseException as exc:  # noqa: BLE001 - every ending becomes an exit code
        step = trainer.current
        job = trainer.job
        code, message = classify(
            exc,
            step,
            job.timeout() if job is not None else None,
            memory_note=memory_note(plan) if is_oom(exc) else None,
        )
        if code == ExitCode.FAILED and not isinstance(exc, (DtlaunchError, KeyboardInterrupt)):
            traceback.print_exc()  # an unexpected error is a bug: keep the traceback for the report
        label = ExitCode.name_of(code)
        print(f"dtlaunch: rank {rank}: exit {code} ({label}): {message}", file=sys.stderr, flush=True)
        write_status(run_dir, rank, code, message, step, trainer.start_step)
        if code == ExitCode.HANG:
            from .hangs import on_hang

            on_hang(rank, nccl=trainer.writes_flight_recorder())
        elif message.startswith(PEER_LOST) and not trainer.writes_flight_recorder():
            from .hangs import dump

            dump(rank, lost_peer=True)  # a peer that timed out waiting for it left: when it got there tells who hung
        sys.stdout.flush()
        sys.stderr.flush()
        # No destroy_process_group on failure: peers may be gone (it would hang), and C++ teardown of a
        # live group can abort the process, replacing our exit code with SIGABRT.
        os._exit(code)
    write_status(run_dir, rank, code, message, trainer.step, trainer.start_step)
    from .dist import shutdown

    shutdown()
    return code


def memory_note(plan) -> str:
    """The plan's memory figure beside this rank's GPU memory when it ran out (when torch can still read it)."""
    mem = plan.memory
    note = f"the plan expected {jobenv.gb(mem.total)} per GPU at its peak ({mem.peak_at})"
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return note
    try:
        dev = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(dev).total_memory
        return (
            f"this GPU: {jobenv.gb(torch.cuda.memory_allocated(dev))} allocated, "
            f"{jobenv.gb(torch.cuda.memory_reserved(dev))} reserved, peak "
            f"{jobenv.gb(torch.cuda.max_memory_allocated(dev))}, of {jobenv.gb(total)}; " + note
        )
    except Exception:  # noqa: BLE001 - a broken device must not hide the error itself
        return note


def _run_dir(plan_path: str, run_dir: str | None) -> Path:
    return Path(run_dir or os.environ.get(jobenv.RUN_DIR) or Path(plan_path).resolve().parent)


def check(plan_path: str, run_dir: str | None = None) -> int:
    """This node against the plan (`launcher.runtime.train --check`, and torchrun's agent before its rendezvous:
    launcher.runtime.elastic --check-plan): print one line, return 0, or the exit code that says what is wrong:
    CONFIG (the plan or the environment), PREFLIGHT (this node's hardware: recorded in jobenv.BAD_NODES),
    STORAGE, or FAILED when the environment cannot import what the check needs."""
    from .. import planfile

    try:
        recipe, plan, _ = planfile.read(plan_path)
    except DtlaunchError as e:
        print(f"dtlaunch: node {jobenv.node_name()}: cannot read the plan:\n{e}", file=sys.stderr, flush=True)
        return ExitCode.CONFIG
    try:
        from .nodecheck import check as check_node

        summary = check_node(recipe, plan, _run_dir(plan_path, run_dir))
    except DtlaunchError as e:  # CONFIG (the plan or the environment) or PREFLIGHT (this node's hardware)
        node = jobenv.node_name()
        print(f"dtlaunch: node {node} cannot run the plan: {e}", file=sys.stderr, flush=True)
        code = e.exit_code if e.exit_code in (ExitCode.PREFLIGHT, ExitCode.STORAGE) else ExitCode.CONFIG
        write_check_record(_run_dir(plan_path, run_dir), node, code, str(e))
        if code == ExitCode.PREFLIGHT:
            _record_bad_node(node)
        return code
    except ImportError as e:  # the job scripts add how to point them at another environment
        print(
            f"dtlaunch: this node cannot run the plan: {e} (install dtlaunch[train] in the job's environment)",
            file=sys.stderr,
            flush=True,
        )
        return ExitCode.FAILED
    print(f"dtlaunch: check ok: {summary}", flush=True)
    write_check_record(_run_dir(plan_path, run_dir), jobenv.node_name(), ExitCode.OK, summary)
    return ExitCode.OK


def _record_bad_node(node: str) -> None:
    """Append this node's name to the job's bad-node file (jobenv.BAD_NODES), which the job script excludes."""
    path = os.environ.get(jobenv.BAD_NODES)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:  # one write of one line: appends from several nodes do not interleave
            os.write(fd, f"{node}\n".encode())
        finally:
            os.close(fd)
    except OSError as e:
        print(f"dtlaunch: WARNING: could not record node {node} in {path}: {e}", file=sys.stderr, flush=True)


def _exit(code: int) -> None:
    """Leave without interpreter teardown: everything is flushed, committed and fsynced by now, and
    tearing down torch/gloo/DeepSpeed state costs seconds per rank (and has aborted processes here)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
