"""What a submitit job decides after its srun, and the files it decides from: the same decisions, in the same
order, with the same ledgers under jobs/$SLURM_JOB_ID as job.sbatch's bash, so that the exit-code contract
and `dtlaunch status` read the same whichever way the job was submitted. No submitit import: the decisions
are tested as plain functions.

Part of the SLURM target (slurm/submitit_job.py runs it), kept at this path outside slurm/: the decision block
of every rendered job.sbatch (slurm/templates/_decide.sh.j2) names this file as its twin, and job scripts
rendered and submitted before keep naming it."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DtlaunchError
from ..jobenv import ExitCode, outcome
from .slurm.timelimit import parse_time

# ----------------------------------------------------------------------------- the decisions (pure)


@dataclass(frozen=True)
class Outcome:
    """How one allocation's training ended."""

    rc: int  # srun's exit code: each node's step.sh exits with its workers' own code
    signal: str | None = None  # "USR2" (forwarded to the steps by checkpoint()), "TERM" (SLURM), None
    time_limit: bool = False  # the USR2 came with the time limit close
    progress: bool = False  # some rank got past the step it resumed from


@dataclass(frozen=True)
class Decision:
    action: str  # done | requeue | stop | fail
    state: str  # jobs/ID/state: COMPLETED | REQUEUED | STOPPED | PREEMPTED | FAILED
    code: int  # the job's exit code
    reason: str
    ledger: str | None = None  # the ledger this attempt is counted in: continuations | requeues | failures


def decide(o: Outcome, *, requeues: int, failures: int, max_requeues: int, max_failures: int) -> Decision:
    """job.sbatch's decisions after its srun (its rendered dtl_decide), from the same policy (jobenv.OUTCOMES).
    `requeues` and `failures` count earlier attempts."""
    if o.rc == ExitCode.OK:
        return Decision("done", "COMPLETED", 0, "finished")
    if o.signal == "TERM":
        return Decision(
            "stop",
            "STOPPED",
            o.rc,
            "SLURM is ending this job (scancel, its own requeue or a "
            "preemption): the training processes checkpointed on SIGTERM; no requeue follows",
        )
    if outcome(o.rc) == "resume" or o.signal == "USR2":
        if o.time_limit:
            # A long run spans several allocations: continuing after a time limit is not a failure, as long
            # as each allocation moves the run forward.
            if o.progress:
                return Decision("requeue", "REQUEUED", o.rc, "time limit reached with a checkpoint", "continuations")
            return Decision(
                "fail",
                "FAILED",
                o.rc,
                "time limit reached without progress (no step completed in this allocation); raise targets.slurm.time",
            )
        if requeues < max_requeues:
            return Decision("requeue", "REQUEUED", o.rc, "preempted, checkpoint written", "requeues")
        return Decision("fail", "PREEMPTED", o.rc, f"preempted, but max_requeues={max_requeues} is used up")
    n = failures + 1
    if outcome(o.rc) == "final":
        return Decision(
            "fail",
            "FAILED",
            o.rc,
            f"exit code {o.rc} is never retried (the same recipe, data or loss would end the same way)",
            "failures",
        )
    if n < max_failures:
        return Decision("requeue", "REQUEUED", o.rc, f"failure {n} of at most {max_failures}", "failures")
    return Decision(
        "fail",
        "FAILED",
        o.rc,
        f"training failed with exit code {o.rc} (failures: {n}, max_failures={max_failures})",
        "failures",
    )


# ----------------------------------------------------------------------------- the job's files


class JobFiles:
    """What the preamble (submitit_setup.sh) exported, and the ledgers job.sbatch also keeps."""

    def __init__(self, environ=os.environ):
        try:
            self.job_id = environ["SLURM_JOB_ID"]
            self.job_dir = Path(environ["JOB_DIR"])
            self.run_dir = Path(environ["DTLAUNCH_RUN_DIR"])
            self.status = Path(environ["DTLAUNCH_STATUS"])
            self.attempt = environ["DTLAUNCH_ATTEMPT"]
        except KeyError as e:
            raise DtlaunchError(
                f"{e.args[0]} is not set: this runs in the batch step of a job submitted with "
                "targets.slurm.submit: submitit, after submitit_setup.sh",
                fix="submit with `dtlaunch up` or launcher.submit()",
            ) from None
        self.restart = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
        self.run_id = environ.get("DTLAUNCH_RUN_ID", "")
        self.checkpoint_dir = environ.get("DTLAUNCH_CHECKPOINT_DIR", str(self.run_dir / "checkpoints"))

    def count(self, ledger: str) -> int:
        p = self.job_dir / ledger
        return len(p.read_text().splitlines()) if p.exists() else 0

    def append(self, ledger: str, line: str) -> None:
        with open(self.job_dir / ledger, "a") as f:
            f.write(line + "\n")

    def set_state(self, state: str) -> None:
        (self.job_dir / "state").write_text(state + "\n")

    def codes(self) -> list[tuple[int, int, int]]:
        """This attempt's "CODE STEP START_STEP" per rank (what step.sh's dtl_outcome reads)."""
        out = []
        for p in sorted(self.status.glob("rank-*.code")):
            try:
                code, step, start = (int(x) for x in p.read_text().split()[:3])
            except (OSError, ValueError):
                continue
            out.append((code, step, start))
        return out

    def newest_checkpoint(self) -> int:
        from ..runtime.checkpoint.disk import newest_step

        return newest_step(Path(self.checkpoint_dir))

    def progress(self, checkpoint_at_start: int | None = None) -> bool:
        """Did this attempt move the run forward: a rank got past the step it resumed from, or a checkpoint newer
        than the one there was when the attempt started was committed (ranks SIGKILLed at a time limit write no
        exit record, but their periodic checkpoints count)."""
        if any(step > start for _, step, start in self.codes()):
            return True
        return checkpoint_at_start is not None and self.newest_checkpoint() > checkpoint_at_start

    def rank_messages(self) -> list[str]:
        """The ranks' own words for this attempt (run_dir/status/rank-N.json): failures first, the earliest
        first (usually the cause; the peers' communication errors follow from it)."""
        recs = []
        for p in sorted((self.run_dir / "status").glob("rank-*.json")):
            try:
                rec = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if rec.get("attempt") == self.attempt:
                recs.append(rec)
        recs.sort(key=lambda r: (r.get("code") in (ExitCode.OK, ExitCode.PREEMPTED), r.get("time", 0)))
        return [
            f"rank {r.get('rank')}: exit {r.get('code')} ({ExitCode.name_of(int(r.get('code', 1)))})"
            + (f" at step {r['step']}" if r.get("step") is not None else "")
            + f": {r.get('message')}"
            for r in recs
        ]

    def summary(self, code: int) -> dict[str, Any]:
        return {
            "state": "COMPLETED" if code == 0 else "FAILED",
            "exit_code": code,
            "job_id": self.job_id,
            "run_id": self.run_id,
            "run_dir": str(self.run_dir),
            "checkpoint_dir": self.checkpoint_dir,
            "metrics": str(self.run_dir / "metrics.jsonl"),
            "attempts": self.restart + 1,
            "step": max((step for _, step, _ in self.codes()), default=None),
            **{ledger: self.count(ledger) for ledger in ("continuations", "requeues", "failures")},
        }


def seconds_left(job_id: str) -> int:
    """Seconds before this job's time limit, -1 if unknown or unlimited (as job.sbatch's seconds_left)."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%L"], capture_output=True, text=True, timeout=30
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return -1
    if not out or not out[0][:1].isdigit():  # UNLIMITED, NOT_SET, INVALID
        return -1
    try:
        return parse_time(out[0])
    except ValueError:
        return -1
