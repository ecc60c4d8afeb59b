"""Helpers for the SLURM tests: render a recipe into a directory, submit, poll squeue."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from launcher.plan import make_plan
from launcher.recipe import load
from launcher.render import render
from launcher.runtime.checkpoint.disk import complete_steps
from launcher.runtime.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]


def render_to(out: Path, recipe: str = "tiny", overrides=(), python=None):
    """Render recipes/<recipe>.yaml for slurm into out; returns (recipe, artifacts)."""
    r = load(REPO / "recipes" / f"{recipe}.yaml", list(overrides))
    art = render(r, make_plan(r), "slurm")
    art.write(out)
    return r, art


def sbatch(out: Path, *extra) -> str:
    p = sh("sbatch", "--parsable", *extra, "job.sbatch", cwd=out)
    return p.stdout.strip().split(";")[0]


def sh(*argv, check=True, timeout=60, cwd=None, env=None) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"{argv} failed ({p.returncode}): {p.stdout}\n{p.stderr}")
    return p


def squeue_state(job_id: str) -> str:
    return sh("squeue", "-h", "-j", job_id, "-o", "%T", check=False).stdout.strip()


def wait_gone(job_id: str, timeout: float) -> float:
    """Poll squeue until the job has left it (finished); returns the seconds waited."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if squeue_state(job_id) == "":
            return time.time() - t0
        time.sleep(0.5)
    sh("scancel", job_id, check=False)
    raise AssertionError(f"job {job_id} still in squeue after {timeout}s")


# States of a job that slurmctld has not finished with; sacct shows them until slurmdbd records the end.
UNFINISHED = {"PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "COMPLETING", ""}


def sacct_rows(job_id: str, fields: str = "JobID,State,ExitCode", timeout: float = 60) -> list[list[str]]:
    """sacct's rows for a job that has left squeue, once accounting has recorded its end: slurmctld sends
    the end to slurmdbd asynchronously, so on a loaded machine sacct can say PENDING for a job that has
    already failed (seen in CI). The State column must be in `fields`."""
    col = fields.split(",").index("State")

    def rows():
        out = sh("sacct", "-n", "-P", "-j", job_id, "-o", fields, check=False).stdout
        got = [line.split("|") for line in out.splitlines() if line]
        return got if got and all(r[col].split()[0] not in UNFINISHED for r in got) else None

    return wait_for(rows, timeout, f"sacct to record the end of job {job_id}", interval=0.5)


def wait_for(pred, timeout: float, what: str, interval: float = 0.3, explain=None):
    """Poll pred until it is truthy; on a timeout, explain() (if given) says what the job was doing."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f"\n{explain()}" if explain else ""))


def result(job, timeout: float = 240):
    """`job.result()` of a submitit job, without two waits that a user's cluster needs and this one does not.
    submitit asks sacct at 2, 4, 8, 16... s after the last submit (sparing a busy slurmdbd), so a job that ended
    at 9 s is seen at 16; and a job that ended without writing its result (a failure before submitit's python
    ran, a cancel) makes result() wait 15 s for that file, for slow shared filesystems. Here sacct is asked
    every half second and the file is on a local disk. job.result() itself still decides and raises."""
    wait_for(lambda: job.done(force_check=True), timeout, f"submitit job {job.job_id} to end", interval=0.5)
    job._results_timeout_s = 0  # submitit's own tests set it so, for the same reason
    return job.result()


# ----------------------------------------------------------------------------- a submitted job and its records

STEPS, EVERY = 20, 5
TOL = 1e-5


# As on a real cluster, the job's environment is activated by the recipe's setup lines; the submitting
# shell's PATH is not relied on (test_operator.py submits from a PATH without the venv).
VENV_ACTIVATE = str(Path(sys.executable).parent / "activate")


def overrides(partition: str) -> list[str]:
    return [
        f"targets.slurm.partition={partition}",
        "resources.nodes=2",
        "resources.accelerator=cpu:1",
        f"training.steps={STEPS}",
        f"checkpoint.every={EVERY}",
        "training.deterministic=true",
        "targets.slurm.max_requeues=2",
        "targets.slurm.max_restarts=2",
        f'targets.slurm.setup=["source {VENV_ACTIVATE}"]',
    ]


class Job:
    """One submitted job: its id, submit dir and run dir, and readers for what it left there."""

    def __init__(
        self,
        out: Path,
        fault: str | None = None,
        run_id: str | None = None,
        env: dict | None = None,
        sbatch_args: tuple[str, ...] = (),
    ):
        env = {**{k: v for k, v in os.environ.items() if k not in ("DTLAUNCH_FAULT", "DTLAUNCH_RUN_ID")}, **(env or {})}
        if fault:
            env["DTLAUNCH_FAULT"] = fault  # the job inherits it: sbatch's default --export=ALL
        if run_id:
            env["DTLAUNCH_RUN_ID"] = run_id
        p = sh("sbatch", "--parsable", *sbatch_args, "job.sbatch", cwd=out, env=env)
        self.out, self.id = out, p.stdout.strip().split(";")[0]
        self.run = out / "runs" / (run_id or self.id)
        self.jobdir = out / "jobs" / self.id

    def metrics(self) -> list[dict]:
        return read_metrics(self.run) if (self.run / "metrics.jsonl").exists() else []

    def steps(self, after: float = 0.0) -> list[dict]:
        return [r for r in self.metrics() if "event" not in r and "loss" in r and r["time"] > after]

    def events(self, name: str) -> list[dict]:
        return [r for r in self.metrics() if r.get("event") == name]

    def max_step(self) -> int:
        return max((r["step"] for r in self.steps()), default=0)

    def ledger(self, name: str) -> list[str]:
        p = self.jobdir / name
        return p.read_text().splitlines() if p.exists() else []

    def status(self) -> dict[int, dict]:
        return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in (self.run / "status").glob("rank-*.json")}

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted((self.jobdir / "logs").glob("attempt-*.log")))

    def done(self, timeout: float = 240) -> None:
        try:
            wait_gone(self.id, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- job logs ---\n{self.logs()[-4000:]}") from None

    def explain(self) -> str:
        out = self.out / f"tiny-{self.id}.out"
        return f"--- {out.name} ---\n{out.read_text()[-6000:] if out.exists() else '(missing)'}"


def submit(out: Path, partition: str, fault: str | None = None) -> Job:
    render_to(out, "tiny", overrides(partition))
    return Job(out, fault)


def assert_completed(job: Job, attempts: int, steps: int = STEPS) -> None:
    assert job.ledger("state") == ["COMPLETED"], job.explain()
    assert (job.jobdir / "finished").exists()
    assert len(job.ledger("attempts")) == attempts, job.ledger("attempts")
    end = job.events("end")
    assert [e["step"] for e in end] == [steps], job.explain()
    st = job.status()
    assert sorted(st) == [0, 1] and all(s["code"] == 0 and s["step"] == steps for s in st.values()), st
    assert complete_steps(job.run / "checkpoints")[-1] == steps


def assert_same_losses(records: list[dict], reference: dict[int, float]) -> None:
    assert records, "no steps logged"
    for r in records:
        assert abs(r["loss"] - reference[r["step"]]) <= TOL, (r["step"], r["loss"], reference[r["step"]])


def release_after_requeue(job: str, requeued_at: float) -> None:
    """Skip SLURM's ~121 s requeue hold. Not in the requeue's own second: slurmd then refuses the job ("already
    killed, do not launch batch job") and it ends FAILED."""
    wait_for(lambda: "PENDING" in squeue_state(job), 30, "the job to be pending after the requeue")
    time.sleep(max(0.0, requeued_at + 3.0 - time.time()))
    sh("scontrol", "update", f"JobId={job}", "StartTime=now")


# A cluster's shared filesystem (NFS, Lustre) for absolute checkpoint directories. Not under /tmp: on a real
# cluster /tmp is each node's own disk, and validate rightly refuses it for a multi-node job's checkpoints.
SHARED_ROOT = Path(os.environ.get("DTLAUNCH_TEST_SHARED_ROOT", "/srv/dtlaunch-tests"))
# Unlike tmp_path, this root outlives the session: a session that was killed leaves its directories behind, and
# SLURM numbers jobs from 1 again on a fresh cluster, so a directory named only after the test (and the job id)
# would hold an earlier session's checkpoints and the job would resume from them. Each session gets its own
# subdirectory: xdist gives all of a run's workers one PYTEST_XDIST_TESTRUNUID; without xdist, a fresh uuid.
SESSION = os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex
STALE_AFTER_S = 24 * 3600
_created: set[Path] = set()


def shared_dir(tmp: Path) -> Path:
    """The test's directory on the 'shared filesystem': this session's, named after its tmp_path, which is unique
    within one worker's base directory (two workers can both have a 'test_x0')."""
    d = SHARED_ROOT / SESSION / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{tmp.name}"
    d.mkdir(parents=True, exist_ok=True)
    _created.add(d)
    return d


def clean_shared_root() -> None:
    """At a worker's end: its own test directories, and whatever killed sessions left over a day ago.

    Not the whole session directory: the other xdist workers of this session may still be using theirs."""
    for d in _created:
        shutil.rmtree(d, ignore_errors=True)
    _created.clear()
    if SHARED_ROOT.is_dir():
        for s in SHARED_ROOT.iterdir():
            try:
                stale = time.time() - s.stat().st_mtime > STALE_AFTER_S
            except FileNotFoundError:
                continue
            if stale:
                shutil.rmtree(s, ignore_errors=True)
            elif s.name == SESSION:
                try:
                    s.rmdir()  # only if empty: another worker may just have made its first directory in it
                except OSError:
                    pass
