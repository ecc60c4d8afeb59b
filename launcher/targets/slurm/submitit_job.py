"""`targets.slurm.submit: submitit`: the job submitit runs, the executor that submits it, and submitting a
rendered directory. The only module that imports submitit; nothing imports this module at package import
(launcher.targets.slurm.backend and launcher.api import it inside functions), so plan/validate/render never do.

In the job, one process runs in the batch step: submitit's python, exec'd by submitit's batch script after
it sourced submitit_setup.sh (the same batch-level shell as job.sbatch). `StepJob` runs the same srun line
as job.sbatch (one `bash step.sh` per node, each running torchrun) and then makes job.sbatch's decisions,
in the same order and with the same ledgers under jobs/$SLURM_JOB_ID, so the exit-code contract and
`dtlaunch status` read the same either way:

* srun exits 0: done; the summary is the job's result (`job.result()`).
* USR2 (the time limit's --signal=B:USR2@N, or a preemption that signals the job) reaches only this
  process. submitit's handler calls `StepJob.checkpoint()`, which forwards USR2 once to the steps
  (`scancel --signal=USR2`, steps only), where torchrun (--signals-to-handle) passes it to the workers
  without restarting them; they checkpoint and exit 42. Then a time limit continues in the next
  allocation if this one made progress, and a preemption is requeued at most max_requeues times, both by
  returning a DelayedSubmission: submitit's own requeue. Never a second signal to torchrun: a repeated one
  cuts its shutdown short and leaves the workers' checkpoint unfinished.
* TERM is SLURM ending the job (scancel, its own requeue, a preemption): the steps get it from SLURM and
  checkpoint; this process records it and leaves without a result, so a cancel ends the job for good and
  a requeue by SLURM reruns the same pickle.
* a hang (43) or a node's failure (44), no signal: job.sbatch's bad-node policy, from the same template
  (exported by submitit_setup.sh, run in a child bash): the nodes named (a 44's rank records, a hang's
  culprits from the flight-recorder dumps) are excluded and the job requeued without them, up to
  targets.slurm.max_excluded_nodes; past that, a failure like any other.
* any other exit: a failure, requeued (`scontrol requeue`) until max_failures attempts have failed, never
  for CONFIG (2).
  A failure ends in `TrainingFailed` (job.result() raises it with the code and the ranks' messages), and
  the process exits with the contract code, so sacct shows 43 for a hang, not Python's 1.
"""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import submitit
from submitit.core.utils import FailedJobError
from submitit.helpers import Checkpointable, DelayedSubmission
from submitit.slurm.slurm import SlurmExecutor

from ...errors import BackendError, DtlaunchError
from ...jobenv import METRICS_FILE, RUN_DIR, ExitCode, exited_record
from .. import require_secrets
from ..slurm_decisions import JobFiles, Outcome, decide, seconds_left
from .request import SLURM_SECRETS

if TYPE_CHECKING:
    from ..registry import JobRecord
    from .request import SlurmRequest, SubmititSpec

LOG_NAME = "{job_id}_0_log.out"  # submitit's log of task 0 (stdout and stderr, stderr_to_stdout)


def _log(msg: str) -> None:
    print(f"dtlaunch[submitit]: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the job


class TrainingFailed(DtlaunchError):
    """The job's failure, as job.result() raises it: the code, why, and each rank's own message."""

    def __init__(self, code: int, message: str, fix: str | None = None):
        self.exit_code = int(code)
        super().__init__(f"exit {int(code)} ({ExitCode.name_of(int(code))}): {message}", fix)


def _fail(code: int, message: str, fix: str | None = None) -> TrainingFailed:
    """The exception to raise, with the process's exit status set to the contract code: submitit pickles the
    exception for job.result() and re-raises it, Python would then exit 1; this atexit hook (run after the
    traceback is printed) exits with `code` instead, so sacct and the ledgers agree."""

    def exit_with_code() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code))

    atexit.register(exit_with_code)
    return TrainingFailed(code, message, fix)


class _Finished(BaseException):
    """Raised from checkpoint() (inside submitit's USR2 handler) when the training had finished after all:
    __call__ catches it and returns the summary instead of requeueing. BaseException, so submitit's
    `except Exception` never pickles it as an error."""

    def __init__(self, summary: dict):
        super().__init__("finished")
        self.summary = summary


class StepJob(Checkpointable):
    """The job submitit pickles: the per-node torchrun step under srun, and job.sbatch's decisions after it.
    Only `settings` (plain data from submitit.json) is pickled, fresh for every requeue; no torch here."""

    def __init__(self, settings: dict):
        self.settings = dict(settings)
        self._reset()

    def _reset(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._rc: int | None = None
        self._term = False
        self._busy = False  # the outcome is being decided: a further USR2 must not start a second decision
        self._checkpoint_at_start: int | None = None

    def __getstate__(self) -> dict:
        return {"settings": self.settings}

    def __setstate__(self, state: dict) -> None:
        self.settings = state["settings"]
        self._reset()

    # ---------------------------------------------------------------- running the step

    def _srun_argv(self) -> list[str]:
        """The rendered srun words, their $VARIABLES taken from the environment the preamble exported."""
        argv = [os.path.expandvars(w) for w in self.settings["srun"]]
        unset = [w for w in argv if "$" in w]
        if unset:
            raise _fail(
                ExitCode.CONFIG,
                f"the srun line still has unset variables after expansion: {unset}",
                "submitit_setup.sh exports them; run it from submitit's batch script, not by hand",
            )
        return argv

    def _cleanup(self) -> None:
        """The job ends for good: remove what it leaves on the nodes (job.sbatch runs the same words)."""
        argv = [os.path.expandvars(w) for w in self.settings["cleanup"]]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            if p.returncode:
                _log(f"could not remove the job's container on every node: {(p.stderr or p.stdout).strip()[-500:]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            _log(f"could not remove the job's container on every node: {e}")

    def _wait_srun(self) -> None:
        """The only thread that touches the Popen object: a signal handler in the main thread must not
        (Popen.wait takes a lock the interrupted main thread could hold); it reads self._rc."""
        assert self._proc is not None
        self._rc = self._proc.wait()

    def _hook_signals(self) -> None:
        """Keep submitit's handlers (USR2 -> checkpoint(), TERM -> logged and ignored) and add: TERM is
        recorded (SLURM is ending the job), and a USR2 that arrives while the outcome is being decided is
        dropped instead of starting a second checkpoint() inside the first."""
        on_usr2, on_term = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)

        def usr2(signum, frame):
            if self._busy:
                _log("SIGUSR2 again while the outcome is being decided: ignored")
                return
            if callable(on_usr2):
                on_usr2(signum, frame)

        def term(signum, frame):
            self._term = True
            if callable(on_term):
                on_term(signum, frame)

        signal.signal(signal.SIGUSR2, usr2)
        signal.signal(signal.SIGTERM, term)

    def __call__(self) -> dict:
        self._reset()
        files = JobFiles()
        self._checkpoint_at_start = files.newest_checkpoint()
        self._hook_signals()
        argv = self._srun_argv()
        _log(f"job {files.job_id} attempt {files.restart}: {shlex.join(argv)}")
        try:
            self._proc = subprocess.Popen(argv)  # stdout and stderr: submitit's log of this job
        except OSError as e:
            raise _fail(ExitCode.FAILED, f"cannot run srun: {e}", "the batch step needs SLURM's srun on PATH") from None
        threading.Thread(target=self._wait_srun, name="srun-wait", daemon=True).start()
        try:
            while self._rc is None:
                time.sleep(0.5)  # submitit's USR2 handler, and so checkpoint(), runs here in the main thread
            self._busy = True
            rc = self._rc if self._term else attempt_code(self._rc)
            outcome = Outcome(rc, "TERM" if self._term else None, progress=files.progress(self._checkpoint_at_start))
            return self._act(files, outcome, in_handler=False)
        except _Finished as f:
            return f.summary

    # ---------------------------------------------------------------- submitit's checkpoint hook

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """submitit calls this from its USR2 handler, in the main thread, before it requeues the job."""
        self._busy = True
        files = JobFiles()
        s = self.settings
        left = seconds_left(files.job_id)
        # slurmctld sends the time-limit signal on its 30 s tick, up to 30 s early: allow for it.
        time_limit = 0 <= left <= s["signal_seconds"] + s["time_limit_slack"]
        why = f"time limit, {left}s left" if time_limit else "preemption"
        _log(f"got SIGUSR2 ({why}): asking the training processes to checkpoint")
        if self._proc is not None and self._rc is None:
            # Every step, not this batch process; once: a second signal makes torchrun give up waiting.
            try:
                subprocess.run(["scancel", "--signal=USR2", files.job_id], capture_output=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired) as e:
                _log(f"scancel --signal=USR2 failed ({e}); the training processes may not checkpoint")
            # Bounded: the requeue must happen before the time limit kills this process.
            wait = s["stop_seconds"] if left < 0 else min(s["stop_seconds"], max(5, left - 15))
            deadline = time.time() + wait
            while self._rc is None and time.time() < deadline:
                time.sleep(0.2)
            if self._rc is None:
                _log(
                    f"the training processes did not exit within {wait}s; requeueing from the last complete "
                    "checkpoint (the requeue ends them)"
                )
        # Still running (or never started): act as for a preemption; the next attempt resumes from the
        # newest complete checkpoint.
        rc = ExitCode.PREEMPTED if self._rc is None else self._rc
        outcome = Outcome(rc, "TERM" if self._term else "USR2", time_limit, files.progress(self._checkpoint_at_start))
        return self._act(files, outcome, in_handler=True)

    # ---------------------------------------------------------------- acting on the decision

    def _act(self, files: JobFiles, outcome: Outcome, *, in_handler: bool) -> Any:
        s = self.settings
        files.append("exit_codes", f"{files.restart} {outcome.rc} {outcome.signal or 'none'}")
        _record_exit(outcome.rc)
        if outcome.signal is None and outcome.rc in (ExitCode.HANG, ExitCode.PREFLIGHT):
            _leave_out_bad_nodes(outcome.rc)
        d = decide(
            outcome,
            requeues=files.count("requeues"),
            failures=files.count("failures"),
            max_requeues=s["max_requeues"],
            max_failures=s["max_failures"],
        )
        if d.ledger:  # job.sbatch's lines: "ATTEMPT TIME", and the exit code for a failure
            rc = f" {outcome.rc}" if d.ledger == "failures" else ""
            files.append(d.ledger, f"{files.restart} {int(time.time())}{rc}")
        files.set_state(d.state)
        _log(f"training exited with {outcome.rc} (signal: {outcome.signal or 'none'}): {d.action}: {d.reason}")
        if d.action != "requeue" and self.settings.get("cleanup"):
            self._cleanup()
        if d.action == "done":
            (files.job_dir / "finished").touch()
            summary = files.summary(0)
            if in_handler:
                raise _Finished(summary)
            return summary
        if d.action == "stop":
            raise SystemExit(d.code)  # no result: a cancel ends the job, a requeue by SLURM reruns this pickle
        if d.action == "requeue":
            if in_handler:  # submitit requeues (scontrol requeue) and exits
                return DelayedSubmission(StepJob(self.settings))
            _requeue(files.job_id)
            raise SystemExit(d.code)
        ranks = files.rank_messages()
        raise _fail(
            d.code,
            d.reason + ("; " + "; ".join(ranks) if ranks else ""),
            f"the job's log: {os.environ.get('SUBMITIT_FOLDER', 'the submitit folder')}/"
            + LOG_NAME.format(job_id=files.job_id),
        )


def _record_exit(rc: int) -> None:
    """job.sbatch's `exited` record in the run's metrics, when the run wrote any: the end of the attempt's
    allocated time for the goodput ledger."""
    run_dir = os.environ.get(RUN_DIR)
    metrics = Path(run_dir) / METRICS_FILE if run_dir else None
    if metrics is not None and metrics.is_file():
        try:
            with open(metrics, "a") as f:
                f.write(exited_record(rc, time.time()))
        except OSError:
            pass


def attempt_code(rc: int) -> int:
    """The attempt's code after srun's `rc`, as job.sbatch takes it: what this attempt's records say, read by
    the step script's own function (dtl_outcome, exported by submitit_setup.sh), over the code of a task srun
    ended itself (a node's failed check, a hung rank's node killed after the others' hang)."""
    if rc == 0:
        return rc
    p = subprocess.run(
        ["bash", "-c", 'dtl_outcome "$1"', "dtl_outcome", str(rc)], capture_output=True, text=True, timeout=120
    )
    try:
        return int(p.stdout.strip())
    except ValueError:  # the function is not there (not run from submitit_setup.sh): srun's own code
        return rc


def _leave_out_bad_nodes(rc: int) -> None:
    """job.sbatch's policy after a hang (43) or a node's failure (44), from the same template: the functions
    submitit_setup.sh exported name the nodes (a 44's rank records, a hang's culprits) and requeue the job
    without them, up to targets.slurm.max_excluded_nodes. They exit 44 once the job is requeued (this attempt
    then ends with 44, as job.sbatch's); they return 0 when no node is to be left out."""
    p = subprocess.run(["bash", "-c", 'bad_nodes_after "$1"', "bad_nodes_after", str(rc)], timeout=300)
    if p.returncode != 0:
        raise SystemExit(p.returncode)


def _requeue(job_id: str) -> None:
    """What submitit's own requeue does (outside its signal handler, where there is no DelayedSubmission to
    write: the pickle that is already there is the job to run again)."""
    p = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise _fail(ExitCode.FAILED, f"scontrol requeue {job_id} failed: {p.stderr.strip() or p.stdout.strip()}")


# ----------------------------------------------------------------------------- submitting


class OneTaskSlurmExecutor(SlurmExecutor):
    """One submitit task for the whole job, in the batch step (use_srun=False). Plain SlurmExecutor counts
    nodes x ntasks_per_node tasks: job.result() would assert that a multi-task job needs results(), and
    done() would wait for result pickles that only task 0 ever writes."""

    def _num_tasks(self) -> int:
        return 1


def submit_spec(spec: SubmititSpec, submit_dir: str | Path) -> submitit.Job:
    """Submit a rendered directory's submitit request; the Job to poll, cancel and read results from."""
    d = Path(submit_dir).resolve()
    folder = d / spec.folder
    try:
        ex = OneTaskSlurmExecutor(folder, max_num_timeout=spec.max_num_timeout, python=spec.python)
    except RuntimeError as e:  # submitit looks for srun first
        raise BackendError(
            f"submitit cannot submit from here: {e}",
            fix="run on a machine with the SLURM client (a login node), or use targets.slurm.submit: "
            "sbatch with targets.slurm.ssh",
        ) from None
    params = dict(spec.parameters)
    params["setup"] = [f"source {shlex.quote(str(d / spec.setup_script))}"]
    try:
        ex.update_parameters(**params)
        return ex.submit(StepJob(dict(spec.step)))
    except FailedJobError as e:  # sbatch refused: its stderr is the message
        raise BackendError(
            f"sbatch rejected the job (submitted by submitit): {str(e).strip()}",
            fix=f"read the batch script submitit wrote: {folder}/*_submission.sh",
        ) from None
    except ValueError as e:  # a parameter submitit does not know
        raise BackendError(f"submitit refused the parameters of {d / 'submitit.json'}: {e}") from None


def submit(request: SlurmRequest, submit_dir: str | Path) -> submitit.Job:
    """`up` and launcher.submit(): the request render made, from this machine."""
    if request.submitit is None:
        raise BackendError("this SLURM request is not for submitit", fix="render with targets.slurm.submit: submitit")
    if request.settings.ssh:
        raise BackendError(
            "targets.slurm.submit: submitit submits from this machine; it cannot go through targets.slurm.ssh",
            fix="run on the login node, or use targets.slurm.submit: sbatch",
        )
    require_secrets(request.secrets, SLURM_SECRETS)
    return submit_spec(request.submitit, submit_dir)


def job(folder: str | Path, job_id: str) -> submitit.Job:
    """The submitit Job of an earlier submission (e.g. from `dtlaunch status`), to poll or read results."""
    return submitit.SlurmJob(folder=Path(folder), job_id=str(job_id), tasks=[0])


def record(j: submitit.Job, job_name: str, submit_dir: str | Path, dependency: str | None = None) -> JobRecord:
    """The registry's record: status/logs/down follow a submitit job like any SLURM job, by its id."""
    from ..registry import JobRecord
    from .request import SlurmHandle

    d = str(Path(submit_dir).resolve())
    handle = SlurmHandle(d, job_name, submit="submitit", submitit_folder=str(j.paths.folder), dependency=dependency)
    return JobRecord(job_name, "slurm", str(j.job_id), d, handle)


def _main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    """`python3 -m launcher.targets.slurm.submitit_job DIR`: submit a rendered directory by hand (not recorded)."""
    from .request import SubmititSpec

    args = sys.argv[1:] if argv is None else argv
    d = Path(args[0] if args else ".")
    try:
        spec = SubmititSpec.from_json((d / "submitit.json").read_text())
        j = submit_spec(spec, d)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot read {d / 'submitit.json'}: {e}", file=sys.stderr)
        return 2
    except DtlaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    out(f"submitted slurm job {j.job_id}; log: {j.paths.folder / LOG_NAME.format(job_id=j.job_id)}")
    return 0


if __name__ == "__main__":
    # Through the importable module: a StepJob of `__main__` would be pickled by value, not by reference.
    from launcher.targets.slurm.submitit_job import _main as main

    sys.exit(main())
