"""torchrun, as the job scripts start it: `python -m launcher.elastic ARGS` == `torchrun ARGS`.

The one difference: when a signal stops torchrun (the preemption USR2, a cancel's TERM), torchrun lets its
SignalException escape as a traceback in every node's log, although stopping is exactly what was asked.
Here that ends in one line and the conventional 128+signal exit status; the workers' own exit codes
(which the job scripts read from the status files) say whether they checkpointed.

When a worker fails, torchrun knows its exit code even if the worker died before writing its status (an
`os._exit`, a crash in native code): that code is kept in the run's record for people, so the failure a
scheduler or submitit reports names it (see `_record_unreported`).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def _record_unreported(failures: dict) -> None:
    """For each failed worker (global rank -> torchrun's ProcessFailure) that left no status record of its
    own in this attempt, write its exit code into run_dir/status/rank-N.json. Only that record for people:
    the per-attempt code file, which the job scripts turn into the job's exit code, stays the workers' own."""
    status, run_dir = os.environ.get("DTLAUNCH_STATUS"), os.environ.get("DTLAUNCH_RUN_DIR")
    if not status or not run_dir:
        return
    from .runtime.status import write_status

    for rank, failure in failures.items():
        code = int(failure.exitcode)
        if code <= 0 or (Path(status) / f"rank-{int(rank):05d}.code").exists():
            continue  # a signal (negative): nothing to report beyond torchrun's own log; or it spoke itself
        write_status(Path(run_dir), int(rank), code, f"exited with code {code} before writing its own status "
                     "(torchrun's report)", None, code_file=False)


def main(argv: list[str] | None = None) -> int:
    from .runtime.signals import die_with_parent

    die_with_parent()  # if the job script that started us is killed, stop the workers (gracefully) too
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as e:
        _record_unreported(e.failures)
        raise  # torchrun's own report and exit status
    except SignalException as e:
        sig = e.sigval
        print(f"dtlaunch: torchrun stopped by {sig.name}; its workers were told to checkpoint and stop",
              file=sys.stderr, flush=True)
        return 128 + int(sig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
