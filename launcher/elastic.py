"""torchrun, as the job scripts start it: `python -m launcher.elastic ARGS` == `torchrun ARGS`.

The one difference: when a signal stops torchrun (the preemption USR2, a cancel's TERM), torchrun lets its
SignalException escape as a traceback in every node's log, although stopping is exactly what was asked.
Here that ends in one line and the conventional 128+signal exit status; the workers' own exit codes
(which the job scripts read from the status files) say whether they checkpointed.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .runtime.signals import die_with_parent

    die_with_parent()  # if the job script that started us is killed, stop the workers (gracefully) too
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as e:
        sig = e.sigval
        print(f"dtlaunch: torchrun stopped by {sig.name}; its workers were told to checkpoint and stop",
              file=sys.stderr, flush=True)
        return 128 + int(sig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
