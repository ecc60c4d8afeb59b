"""Chaos on the local SLURM cluster: one job, rendered by `dtlaunch render --target slurm` and submitted once,
meets fault after fault from outside, as a cluster brings them, and must end exactly where an undisturbed run
of the same steps ends.

bench/chaos.py drives the same faults through a supervisor that relaunches torchrun itself, with most of them
injected from inside the run (DTLAUNCH_FAULT). Here nothing inside the job is told anything: the faults come
from outside, and what restarts the run is the job script (torchrun's restarts within an allocation, SLURM's
requeue across them) on a real slurmctld with three slurmd nodes (scripts/slurm-local.sh; a job of two nodes,
so that a hang's culprit node can be excluded and the job still run):

    rank_kill           SIGKILL to one rank's process: torchrun restarts the workers within the allocation
    node_loss           SIGKILL to every process of one node's share of the job (its torchrun and its rank)
    preemption          `scancel --signal=USR2 --batch` (what a preempting scheduler or --signal sends): the ranks
                        checkpoint and exit 42, the job script requeues the job
    time_limit          the job's TimeLimit lowered to end within ~2 minutes: slurmctld's USR2 before the limit,
                        checkpoint, continuation in a new allocation (the limit is then restored, as the next
                        allocation would have its own)
    hang                SIGSTOP to one rank: the others' collective timeout ends the attempt (43), the culprit
                        named from the flight-recorder dumps
    corrupt_checkpoint  both nodes' processes SIGKILLed, then the newest checkpoint's data corrupted before the
                        requeued job starts: the resume falls back past it
    kill_in_checkpoint  SIGKILL to every rank while a save is being written (seen as its uncommitted directory)
    slow_checkpoint     the ranks frozen (SIGSTOP) for 3 s while a save is written (storage that stalls), then
                        a rank killed
    launcher_kill       SIGKILL to one node's torchrun agent: its worker must not outlive it
    full_disk           the checkpoint disk (a tmpfs of its own) filled: the next save fails, the ranks exit 46,
                        which no job script retries; the bench frees the disk and submits the run again by its
                        id, as a person would

The cluster is started with a credential lifetime of 5 s (SLURM_LOCAL_CRED_EXPIRE), which sets SLURM's hold on
a requeued job to 6 s instead of 121 s; nothing else is done for the job between faults. The undisturbed run
is bench/chaos.py's reference (the same model, data, batch and steps on 2 ranks with gloo: the sums are the
same, so the weights are bit for bit the same); DTLAUNCH_CHAOS_REFERENCE names one already made.

Run as root (the tmpfs, the cluster's daemons): `python bench/run.py --only chaos_slurm --update` (30-60 min for
the full run with the reference given, ~20 more to make the reference; CI's smoke run has the packages, from
scripts/install-system.sh).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import chaos as C

import _torchrun as T
from launcher.jobenv import tail_records

NODES = 3  # the job takes 2: one node can be excluded after a hang and the job still runs
SLOW_SECONDS = 3.0
TIME_LIMIT_MIN = 120  # the job's own time limit
CLUSTER = {  # a cluster of its own: never the developer's default instance, nor the tests'
    "SLURM_LOCAL_ROOT": "/tmp/dtlaunch-slurm-chaos",
    "SLURM_LOCAL_CTLD_PORT": "9817",
    "SLURM_LOCAL_DBD_PORT": "9819",
    "SLURM_LOCAL_SLURMD_PORT_BASE": "9830",
    "SLURM_LOCAL_DB_PORT": "3607",
    "SLURM_LOCAL_NODES": str(NODES),
    "SLURM_LOCAL_CRED_EXPIRE": "5",
    "SLURM_LOCAL_ACCOUNTING": "none",  # the job script asks squeue and scontrol only; no database to start
}
SCRIPT = T.ROOT / "scripts" / "slurm-local.sh"


def sh(*argv: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"chaos: {' '.join(argv)} failed ({p.returncode}): {p.stdout}{p.stderr}")
    return p


@contextmanager
def cluster():
    env = {**os.environ, **CLUSTER}
    sh("bash", str(SCRIPT), "stop", "--purge", check=False, timeout=180, env=env)
    sh("bash", str(SCRIPT), "start", timeout=300, env=env)
    saved = dict(os.environ)
    for line in (Path(CLUSTER["SLURM_LOCAL_ROOT"]) / "env.sh").read_text().splitlines():
        if line.startswith("export "):
            k, _, v = line[len("export ") :].partition("=")
            os.environ[k] = v.strip("'\"")
    try:
        yield os.environ["SLURM_LOCAL_PARTITION"]
    finally:
        os.environ.clear()
        os.environ.update(saved)
        sh("bash", str(SCRIPT), "stop", "--purge", check=False, timeout=180, env=env)


@dataclass
class Proc:
    pid: int
    env: dict[str, str]
    cmd: str

    @property
    def node(self) -> str:
        return self.env.get("SLURMD_NODENAME", "")

    @property
    def in_step(self) -> bool:  # a process of the training step (srun's task), not the batch shell's
        return "SLURM_STEP_ID" in self.env and self.env.get("SLURM_STEP_ID") not in ("", "batch")

    @property
    def worker(self) -> bool:
        return "LOCAL_RANK" in self.env and "launcher.runtime.train" in self.cmd

    @property
    def agent(self) -> bool:
        return "launcher.runtime.elastic" in self.cmd


def procs(mark: str) -> list[Proc]:
    out = []
    for pid, raw in C.marked(mark):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
        out.append(Proc(pid, env, cmd))
    return out


def _workers(mark: str) -> dict[int, Proc]:
    return {int(p.env["RANK"]): p for p in procs(mark) if p.worker and p.env.get("RANK", "").isdigit()}


def _kill(ps: list[Proc], sig: int = signal.SIGKILL) -> list[int]:
    done = []
    for p in ps:
        try:
            os.kill(p.pid, sig)
            done.append(p.pid)
        except ProcessLookupError:
            pass
    return done


def _state(job: str) -> str:
    return sh("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip()


class Run:
    """The job (its id changes only when the run is submitted again) and the run directory it trains in."""

    RUN_ID = "chaos"

    def __init__(self, out: Path, mark: str):
        self.out, self.mark = out, mark
        self.dir = out / "runs" / self.RUN_ID
        self.job = ""
        self.jobs: list[str] = []

    def submit(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "DTLAUNCH_FAULT"}
        env.update(DTLAUNCH_RUN_ID=self.RUN_ID, DTLAUNCH_CHAOS_MARK=self.mark)
        env.update(T.env({}))  # the benchmarks' torch settings (threads, warnings)
        p = sh("sbatch", "--parsable", "job.sbatch", cwd=self.out, env=env)
        self.job = p.stdout.strip().split(";")[0]
        self.jobs.append(self.job)

    def alive(self) -> bool:
        return bool(_state(self.job))

    def finished(self) -> bool:  # polled every few ms while a save is awaited: the file's end only
        return any(r.get("event") == "end" for r in tail_records(self.dir))

    def step(self) -> int:
        return C._last_step(self.dir)

    def time_limit(self, minutes: int | str) -> None:
        sh("scontrol", "update", f"JobId={self.job}", f"TimeLimit={minutes}")

    def run_seconds(self) -> int:
        info = sh("scontrol", "-o", "show", "job", self.job).stdout
        m = re.search(r"RunTime=(?:(\d+)-)?(\d+):(\d+):(\d+)", info)
        if not m:
            raise RuntimeError(f"chaos: no RunTime in {info!r}")
        d, h, mi, s = (int(x or 0) for x in m.groups())
        return ((d * 24 + h) * 60 + mi) * 60 + s

    def log(self, line: str) -> None:
        with open(self.out / "chaos.log", "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {line}\n")


def _render(out: Path, steps: int, partition: str) -> None:
    """The bench's recipe for two one-rank nodes of the local cluster, rendered as `dtlaunch render` does."""
    import yaml

    sys.path.insert(0, str(T.ROOT))
    from launcher.plan import make_plan
    from launcher.recipe import load_text
    from launcher.render import render

    rec = C._recipe(steps)
    rec["resources"] = {"accelerator": "cpu:1", "nodes": 2, "network": "loopback"}
    rec["targets"] = {
        "slurm": {
            "partition": partition,
            "time": TIME_LIMIT_MIN,
            "max_requeues": 1000,
            "max_failures": 1000,
            "max_restarts": 100,
            "max_excluded_nodes": 1,
            "setup": [f"source {Path(sys.executable).parent / 'activate'}"],
        }
    }
    r = load_text(yaml.safe_dump(rec), source="<chaos_slurm recipe>")
    render(r, make_plan(r), "slurm").write(out)


def _wait_for_save(run: Run, timeout: float) -> bool:
    """Until a save is being written (an uncommitted step directory), polled fast: True when one is."""
    from launcher.runtime.checkpoint import disk

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not run.finished():
        if disk.partial_dirs(run.dir / "checkpoints"):
            return True
        time.sleep(0.005)
    return False


def _during_save(kind: str, run: Run, rng: random.Random, at: int) -> dict:
    """The checkpoint faults: at the next save, every rank killed, or frozen for a while and a rank killed later."""
    if not _wait_for_save(run, 120):
        return {"missed": "no save began"}
    now = list(_workers(run.mark).values())
    if kind == "kill_in_checkpoint":
        return {"killed": _kill(now)}
    _kill(now, signal.SIGSTOP)
    time.sleep(SLOW_SECONDS)
    _kill(now, signal.SIGCONT)
    target = run.step() + rng.randint(3, 3 * C.EVERY)
    C.wait_for(lambda: run.step() >= target or run.finished(), 300, f"step {target}")
    return {"stalled_s": SLOW_SECONDS, **_inject("rank_kill", run, rng, at)}


def _inject(kind: str, run: Run, rng: random.Random, at: int) -> dict:
    """The fault, from outside; what was done."""
    rank = rng.randint(0, 1)
    workers = _workers(run.mark)
    if kind == "rank_kill":
        return {"killed": _kill([workers[rank]]), "rank": rank}
    if kind in ("node_loss", "corrupt_checkpoint", "launcher_kill"):
        node = workers[rank].node
        step = [p for p in procs(run.mark) if p.in_step]
        if kind == "launcher_kill":
            return {"killed": _kill([p for p in step if p.agent and p.node == node]), "node": node}
        victims = [p for p in step if p.node == node] if kind == "node_loss" else step
        got = {"killed": _kill(victims), "node": node if kind == "node_loss" else "all"}
        if kind == "corrupt_checkpoint":
            C.wait_for(lambda: not _workers(run.mark), 30, "the killed ranks to be gone")
            got["corrupted_step"] = C._corrupt_newest(run.dir / "checkpoints")
        return got
    if kind == "preemption":
        sh("scancel", "--signal=USR2", "--batch", run.job)
        return {"signal": "USR2"}
    if kind == "time_limit":
        minutes = math.ceil((run.run_seconds() + 90) / 60)  # ends 30-90 s from now; USR2 comes before it
        run.time_limit(minutes)
        return {"time_limit_min": minutes}
    if kind == "hang":
        return {"stopped": _kill([workers[rank]], signal.SIGSTOP), "rank": rank}
    if kind in ("kill_in_checkpoint", "slow_checkpoint"):
        return _during_save(kind, run, rng, at)
    if kind == "full_disk":
        ballast = run.dir / "checkpoints" / ".ballast"
        while run.alive():  # kept full until the job ends (another tenant's data)
            C._fill(ballast)
            time.sleep(0.1)
        ballast.unlink(missing_ok=True)  # a person frees the disk and submits the run again
        run.submit()
        return {"resubmitted_as": run.job}
    raise ValueError(kind)


def _recovered(run: Run, since: float, kind: str, timeout: float) -> float:
    """Until the run trains again after the fault: an attempt started after `since` (every fault here ends the
    attempt it strikes) and logged a step. Meanwhile, what a cluster does: after a lowered time limit, the next
    allocation gets the job's own limit back. Returns when that step was logged."""
    restored = kind != "time_limit"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not restored and "PENDING" in _state(run.job):
            run.time_limit(TIME_LIMIT_MIN)
            restored = True
        recs = tail_records(run.dir)  # polled: what came after the fault is at the file's end
        starts = [r["time"] for r in recs if r.get("event") == "start" and r["time"] > since]
        if starts and restored:
            steps = [r["time"] for r in recs if "loss" in r and r.get("time", 0) > starts[0] and "event" not in r]
            if steps:
                return steps[0]
        if run.finished():
            return time.time()
        if not run.alive():
            raise RuntimeError(f"chaos: job {run.job} ended after {kind} without finishing the run")
        time.sleep(0.5)
    raise RuntimeError(f"chaos: the run did not train again within {timeout:.0f}s of {kind}")


def chaos(steps: int, faults: int, seed: int, out: Path) -> dict:
    from safetensors.torch import load_file

    rec = C._recipe(steps)
    ref = C._reference(rec, out / "reference", max(600.0, 2.0 * steps))
    mark = f"chaos-{uuid.uuid4().hex}"
    jobdir = out / "job"
    run = Run(jobdir, mark)
    # mounted before the cluster starts: each slurmd has a private mount namespace, copied from this one then
    C._checkpoint_disk(run.dir / "checkpoints")
    try:
        with cluster() as partition:
            _render(jobdir, steps, partition)
            try:
                return _chaos(run, ref, steps, faults, seed, load_file)
            finally:
                for j in run.jobs:
                    sh("scancel", j, check=False)
                C.wait_for(lambda: not procs(mark), 60, "the job's processes to end", 0.5)
    finally:
        subprocess.run(["umount", "--lazy", str(run.dir / "checkpoints")], capture_output=True)


def _chaos(run: Run, ref, steps: int, faults: int, seed: int, load_file) -> dict:
    from launcher.runtime.checkpoint import disk
    from launcher.runtime.checkpoint.lock import RunLock
    from launcher.runtime.goodput import attempts, ledger

    rng = random.Random(seed)
    ats = C.fault_steps(steps, faults, rng)  # a lowered time limit lets the run train past the next one's step
    happened: list[dict] = []
    run.submit()
    for kind, planned in zip(C.schedule(faults, seed), ats, strict=True):
        at = max(planned, run.step() + 1)
        if kind == "corrupt_checkpoint":
            at = max(at, 2 * C.EVERY + 2)
        if at >= steps - C.EVERY:  # the run is ending: a fault now might find it gone
            break
        C.wait_for(lambda at=at: run.step() >= at or not run.alive(), 1800, f"step {at}", 0.1)
        if not run.alive():
            raise RuntimeError(f"chaos: job {run.job} ended before step {at}")
        t0 = time.time()
        done = _inject(kind, run, rng, at)
        run.log(f"{kind} at step {run.step()}: {done}")
        back = _recovered(run, time.time(), kind, 600)
        happened.append({"kind": kind, "at_step": at, "t0": t0, "job": run.job, "back_s": round(back - t0, 2), **done})
        print(f"chaos_slurm: {happened[-1]}", flush=True)
    C.wait_for(lambda: not run.alive(), 3600, "the job to end", 1.0)
    records = C._records(run.dir)
    if not run.finished():
        raise RuntimeError(f"chaos: the run did not finish: see {run.out}")
    _costs(records, happened)
    a, b = load_file(str(ref.run_dir / "model.safetensors")), load_file(str(run.dir / "model.safetensors"))
    identical = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    final = {r["step"]: r["loss"] for r in records if "loss" in r and isinstance(r.get("step"), int)}
    ref_losses = {r["step"]: r["loss"] for r in ref.metrics() if "loss" in r and isinstance(r.get("step"), int)}
    same_losses = final == {k: v for k, v in ref_losses.items() if k <= steps}
    time.sleep(2)  # slurmstepd's last kills
    orphans = [(p.pid, p.cmd[:80]) for p in procs(run.mark)]
    partials = [p.name for p in disk.partial_dirs(run.dir / "checkpoints")]
    lock = RunLock(run.dir / "checkpoints")
    lock_free = lock.acquire("chaos-check") is None
    lock.release()
    temps = [str(p) for p in run.dir.rglob("*.tmp*")]
    led = ledger(records)
    kinds = sorted({h["kind"] for h in happened})
    with open(run.out / "chaos.jsonl", "w") as f:
        for h in happened:
            f.write(json.dumps(h) + "\n")
    problems = [
        *([] if identical else ["the final weights differ from the undisturbed run's"]),
        *([] if same_losses else ["a step's loss differs from the undisturbed run's"]),
        *([f"orphaned processes: {orphans}"] if orphans else []),
        *([f"partial checkpoints left: {partials}"] if partials else []),
        *([] if lock_free else ["the checkpoint lock is still held"]),
        *([f"temporary files left: {temps}"] if temps else []),
        *(f"{h['kind']}: {h['missed']}" for h in happened if "missed" in h),
    ]
    tried = len(attempts(records))  # the ledger's attempts: each from its start event
    print(
        f"chaos_slurm: {len(happened)} faults of {len(kinds)} kinds over {steps} steps, jobs {run.jobs}, "
        f"{tried} attempts, allocated {led['allocated']:.0f}s, goodput {led['goodput']:.3f} (useful / elapsed, "
        f"the queue between allocations included: {led['goodput_elapsed']:.3f} of {led['elapsed']:.0f}s); "
        f"weights bit-identical: {identical}; losses identical: {same_losses}; "
        f"{'clean' if not problems else 'PROBLEMS: ' + '; '.join(problems)}"
    )
    if problems:
        raise RuntimeError("chaos_slurm: " + "; ".join(problems) + f" (run: {run.out})")
    return {
        "faults": len(happened),
        "kinds": kinds,
        "attempts": tried,
        "jobs": len(run.jobs),
        "steps": steps,
        "ledger": {k: round(v, 2) for k, v in led.items()},
        "goodput": led["goodput"],
        "identical": identical,
        "events": happened,
    }


def _costs(records: list[dict], happened: list[dict]) -> None:
    """Each fault's cost from the ledger's attempts: the attempt it struck (the last to start before it) trained
    steps that the next one redid, and the time from its last trained step to the next attempt's first."""
    from launcher.runtime.goodput import attempts, kept_steps

    runs = attempts(records)
    for h in happened:
        i = max((j for j, a in enumerate(runs) if a.start <= h["t0"]), default=None)
        if i is None or i + 1 >= len(runs):
            continue
        a, b = runs[i], runs[i + 1]
        h["lost_steps"] = (a.last_step or a.from_step) - a.from_step - kept_steps(runs, i)
        if a.last_step_time is not None and b.first_step_start is not None:
            h["recovery_s"] = round(b.first_step_start - a.last_step_time, 2)


def run(quick: bool = False) -> dict:
    # quick (CI's smoke run, ~6 minutes): the schedule's first faults on a short run; full: 20 faults over a run
    # of 30 minutes or so here (the "30-minute chaos run")
    steps, faults = (120, 4) if quick else (5_700, 20)
    keep = os.environ.get("DTLAUNCH_CHAOS_OUT")  # a directory to keep the job, its run and chaos.log in
    with tempfile.TemporaryDirectory(prefix="dtlaunch-chaos-slurm-") as tmp:
        got = chaos(steps, faults, seed=0, out=Path(keep or tmp))
    return C.outcome("chaos_slurm", got)


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
