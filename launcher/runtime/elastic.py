"""torchrun, as the job scripts start it: `python -m launcher.runtime.elastic ARGS` == `torchrun ARGS`.

The one difference: when a signal stops torchrun (the preemption USR2, a cancel's TERM), torchrun lets its
SignalException escape as a traceback in every node's log, although stopping is exactly what was asked.
Here that ends in one line and the conventional 128+signal exit status; the workers' own exit codes
(which the job scripts read from the status files) say whether they checkpointed.

Node ranks follow the scheduler (`DTLAUNCH_NODE_RANK`, which the job scripts set from SLURM_NODEID or
SKYPILOT_NODE_RANK): torch's c10d rendezvous numbers nodes in the sort order of their addresses, where `gpu10`
comes before `gpu2` and `10.0.0.12` before `10.0.0.9`, so global rank 0 could land off the node that hosts the
store and pipeline stages would ignore the scheduler's topology-aware order (see `_ranks_follow_scheduler`).

With `--check-plan=PLAN` first, the agent checks its node against the plan before the rendezvous
(see `_check_first`): the job scripts' pre-start check, without a process (and a torch import) of its own.

Until the workers start, a stop signal (one of --signals-to-handle: `dtlaunch down`, a cancel, a preemption)
ends the agent with the PREEMPTED code, as a job stopped before training began: nothing has trained, so nothing
is lost (see `_stop_before_training`). torchrun installs its own handlers, which pass signals to the workers,
only as it starts them; until then a signal would kill the agent, and the job would read as lost.

A worker that ends with a final code (jobenv.OUTCOMES: a bad recipe, a diverged loss, no usable checkpoint,
failing storage), or with a node's fault (PREFLIGHT: jobenv.restarts_in_place), is not restarted: torchrun restarts on any failure while max_restarts lasts, and a restart
of a CONFIG run whose only checkpoint was unusable trained from step 0 (see `_final_codes_stop_restarts`).

When a worker fails and torchrun restarts the group, the survivors get jobenv.RESTART_GRACE_S to exit on
SIGTERM, not torchrun's 30 s, which a hung rank always uses up in full (see `_restarts_do_not_wait_for_the_hung`).

When a worker fails, torchrun knows its exit code even if the worker died before writing its status (an
`os._exit`, a crash in native code): that code is kept in the run's record for people, so the failure a
scheduler or submitit reports names it (see `_record_unreported`).
"""

from __future__ import annotations

import builtins
import os
import signal
import sys
from pathlib import Path

from ..jobenv import ExitCode, node_name


def _record_unreported(failures: dict) -> None:
    """For each failed worker (global rank -> torchrun's ProcessFailure) that left no status record of its
    own in this attempt, write its exit code into run_dir/status/rank-N.json. Only that record for people:
    the per-attempt code file, which the job scripts turn into the job's exit code, stays the workers' own."""
    status, run_dir = os.environ.get("DTLAUNCH_STATUS"), os.environ.get("DTLAUNCH_RUN_DIR")
    if not status or not run_dir:
        return
    from .status import UNREPORTED, write_status

    for rank, failure in failures.items():
        code = int(failure.exitcode)
        if code <= 0 or (Path(status) / f"rank-{int(rank):05d}.code").exists():
            continue  # a signal (negative): nothing to report beyond torchrun's own log; or it spoke itself
        write_status(
            Path(run_dir),
            int(rank),
            code,
            f"exited with code {code} {UNREPORTED}",
            None,
            code_file=False,
        )


def _final_codes_stop_restarts() -> None:
    """Make the agent treat a worker's final exit code as the end: no restarts left. The agent then stops its
    workers and exits, closing the rendezvous, so the other nodes' agents stop at their next rendezvous too
    instead of restarting theirs."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from ..jobenv import restarts_in_place

    monitor = LocalElasticAgent._monitor_workers

    def monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        codes = sorted({int(f.exitcode) for f in (result.failures or {}).values()})
        final = [c for c in codes if c > 0 and not restarts_in_place(c)]
        if final and self._remaining_restarts > 0:
            why = (
                "a node's fault, which a restart on the same node meets again"
                if final[0] == ExitCode.PREFLIGHT
                else "which is never retried"
            )
            print(
                f"dtlaunch: a worker ended with exit code {final[0]}, {why}: not restarting the workers",
                file=sys.stderr,
                flush=True,
            )
            self._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = monitor_workers  # type: ignore[method-assign]  # the patch, on purpose


def _restarts_do_not_wait_for_the_hung() -> None:
    """Give the survivors of a failure jobenv.RESTART_GRACE_S between SIGTERM and SIGKILL, where torchrun
    waits 30 s: when its poll finds a worker failed it closes the rest (`PContext.close()`, no timeout given),
    and a restart, for this node's failure or another node's, stops the group (`_stop_workers`). The signal
    path (a preemption, a cancel) passes its own timeout, --shutdown-timeout (the time to checkpoint), and keeps
    it. A torch whose methods take no timeout keeps its own waits."""
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    from ..jobenv import RESTART_GRACE_S

    close = PContext.close
    if "timeout" in inspect.signature(close).parameters:

        def close_survivors(self, death_sig=None, timeout=None):
            close(self, death_sig, RESTART_GRACE_S if timeout is None else timeout)

        PContext.close = close_survivors  # type: ignore[method-assign]  # the patch, on purpose
    if "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters:

        def stop_workers(self, worker_group, *args, **kwargs):
            self._shutdown(timeout=RESTART_GRACE_S)

        LocalElasticAgent._stop_workers = stop_workers  # type: ignore[method-assign]  # the patch, on purpose


def _ranks_follow_scheduler(node_rank: int) -> None:
    """Make the c10d rendezvous assign node ranks in the scheduler's order. A node's descriptor is (address,
    pid, local id), and the rendezvous ranks participants by sorting descriptors. The local id only keeps two
    handlers of one process apart (each agent makes one): here it carries the scheduler's node rank, and the
    sort goes by it first. Every node of a job runs this same module, so every descriptor carries one."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    def generate(self, local_addr: str | None = None):
        import socket

        return dr._NodeDesc(local_addr or socket.getfqdn(), os.getpid(), node_rank)

    def by_node_rank(participants):
        return builtins.sorted(participants, key=lambda n: (n.local_id, n.addr, n.pid))

    dr._NodeDescGenerator.generate = generate  # type: ignore[method-assign]  # the patch, on purpose
    # The module's one use of sorted(): `enumerate(sorted(state.participants))`; a module global shadows the builtin.
    dr.sorted = by_node_rank  # type: ignore[attr-defined]


CHECK_PLAN = "--check-plan"  # our one flag, first: `--check-plan=PLAN` checks this node before the rendezvous


def _check_first(argv: list[str]) -> tuple[int, list[str]]:
    """Run the pre-start check (launcher.runtime.train.check) here, in the agent, when argv begins with
    `--check-plan=PLAN`: (its exit code, torchrun's own arguments). The agent imports torch anyway, so a node
    checks itself without a Python process (and a job step) of its own, once per agent, before it joins the
    rendezvous; torchrun's in-place restarts keep the agent and do not check again. A node that fails ends its
    agent with the check's code before it joins: the job scripts' srun (--kill-on-bad-exit) then ends the
    other nodes' agents, and the step's exit code is that node's (srun exits with the highest task status)."""
    if not argv or not argv[0].startswith(CHECK_PLAN + "="):
        return 0, argv
    from .train import check

    try:
        import torch  # noqa: F401 - imported before the fork: the check and torchrun share the one import
    except Exception as e:  # ImportError, or OSError for a CUDA library torch cannot load: no retry mends either
        print(f"dtlaunch: node {node_name()}: cannot import torch: {e}", file=sys.stderr, flush=True)
        _record_check(ExitCode.CONFIG, f"cannot import torch: {e}")
        return ExitCode.CONFIG, argv

    # The check runs in a forked child: it may initialise CUDA (a GPU's name, its health), and a context the
    # agent kept would hold memory on every GPU for the whole job.
    pid = os.fork()
    if pid == 0:
        code: int = ExitCode.FAILED
        for sig in _STOPPING:  # the agent stops the child (_stop_before_training); alone, it dies by a signal
            signal.signal(sig, signal.SIG_DFL)
        try:
            code = check(argv[0].split("=", 1)[1])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _CHECKING.append(pid)
    code = int(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    _CHECKING.remove(pid)
    if code not in (0, ExitCode.CONFIG, ExitCode.PREFLIGHT, ExitCode.STORAGE):
        # an environment that cannot import what training needs, a crash: no retry mends these
        print(f"dtlaunch: the pre-start check failed (exit {code}, see above)", file=sys.stderr, flush=True)
        _record_check(ExitCode.CONFIG, f"the pre-start check failed (exit {code}): see the node's log")
        code = ExitCode.CONFIG
    return code, argv[1:]


def _record_check(code: int, message: str) -> None:
    """A check that could not say why itself (torch missing, a crash) recorded as one that failed: the job
    script reads the code of a node whose task srun ended first (status.write_check_record)."""
    from .. import jobenv
    from .status import write_check_record

    write_check_record(Path(os.environ.get(jobenv.RUN_DIR) or "."), node_name(), code, message)


_STOPPING: list[signal.Signals] = []  # the signals _stop_before_training handles
_CHECKING: list[int] = []  # the pid of the check's child while it runs


def _stop_before_training(argv: list[str]) -> None:
    """Until torchrun starts the workers, end the agent on each signal of its --signals-to-handle as a job
    stopped before training began: the check's child (if running) killed, one line, exit PREEMPTED. torchrun
    replaces these handlers with its own (which pass the signal to the workers) as it starts them."""
    names = [a.split("=", 1)[1] for a in argv if a.startswith(("--signals-to-handle=", "--signals_to_handle="))]
    known = signal.Signals.__members__  # an unknown name is torchrun's to refuse
    _STOPPING[:] = [known[n.strip()] for n in (names[-1].split(",") if names else []) if n.strip() in known]

    def stop(signum, _frame):
        for pid in _CHECKING:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        name = signal.Signals(signum).name
        print(f"dtlaunch: stopped by {name} before training began", file=sys.stderr, flush=True)
        os._exit(ExitCode.PREEMPTED)

    for sig in _STOPPING:
        signal.signal(sig, stop)


CHECK_ENVIRONMENT = "--check-environment"  # the batch shell's question: can this interpreter run the agent at all?


def _check_environment() -> int:
    """0 when this interpreter has torch (found, not imported: that is the agent's seconds, on every node) and
    dtlaunch (this module ran); else 1 with what is missing, for the job script's advice on the environment."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        print(f"dtlaunch: {sys.executable} has no torch", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == [CHECK_ENVIRONMENT]:
        return _check_environment()
    from .signals import die_with_parent

    _stop_before_training(argv)
    die_with_parent()  # if the job script that started us is killed, stop the workers (gracefully) too
    code, argv = _check_first(argv)
    if code:
        return code
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from ..jobenv import NODE_RANK

    _final_codes_stop_restarts()
    _restarts_do_not_wait_for_the_hung()
    rank = os.environ.get(NODE_RANK, "")
    if rank.isdigit():
        _ranks_follow_scheduler(int(rank))

    try:
        torchrun(argv)
    except ChildFailedError as e:
        _record_unreported(e.failures)
        raise  # torchrun's own report and exit status
    except SignalException as e:
        sig = e.sigval
        print(
            f"dtlaunch: torchrun stopped by {sig.name}; its workers were told to checkpoint and stop",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(sig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
