"""Chaos: one run meets fault after fault, of every kind the field brings, and must end exactly where an
undisturbed run of the same steps ends.

The job: dtlaunch's trainer, DDP on 2 CPU ranks, the tiny Llama, deterministic, a synchronous checkpoint every
EVERY steps. A supervisor relaunches torchrun until the run ends, as a SLURM job script with --requeue does
(this benchmark runs on one machine with local torchrun; the same faults on the local SLURM cluster are tested
one at a time in tests/slurm). Each attempt meets the next fault of a seeded schedule in which every kind
comes round before any repeats:

    rank_kill           one rank SIGKILLed at a step (DTLAUNCH_FAULT=sigkill)
    node_loss           every rank SIGKILLed at once (a node lost: here the whole world)
    preemption          SIGUSR2 to a rank (SLURM's --signal before preemption): all save and exit 42
    time_limit          SIGTERM to torchrun at a step (the allocation's end): the workers save within the grace
    hang                a rank stops at a step; the peers' collective timeout ends the attempt (43)
    corrupt_checkpoint  a rank killed, then the newest checkpoint's data corrupted: resume falls back past it
    kill_in_checkpoint  SIGKILL after a save's files are written, before its commit: the partial is cleaned
    slow_checkpoint     a save that takes seconds longer, then a rank killed
    launcher_kill       SIGKILL to the torchrun agent itself: its workers must not outlive it
    full_disk           the checkpoint disk (a tmpfs of its own: run as root) filled at a step, so the next save
                        fails with ENOSPC and the ranks exit STORAGE (46), which no job script retries: the
                        supervisor frees the disk and resubmits, as a person would

At the end: the exported weights are bit-identical to the undisturbed run's and so is every step's loss;
no process of any attempt is alive (each carries a marker in its environment, looked for in /proc), the
checkpoint lock is free and no partial checkpoint is left; the goodput ledger (launcher/runtime/goodput.py)
gives where the time went, and each fault its cost (the work it lost and the time to the next trained step),
written to RUN/chaos.jsonl. The exactness and cleanliness are hard checks (a failure raises, in --quick too);
goodput >= 0.8 is the target of the full run.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import _torchrun as T
from common import result, scratch

KINDS = (
    "rank_kill",
    "node_loss",
    "preemption",
    "time_limit",
    "hang",
    "corrupt_checkpoint",
    "kill_in_checkpoint",
    "slow_checkpoint",
    "launcher_kill",
    "full_disk",
)
EVERY = 10
TARGET = 0.8
HANG_TIMEOUT_S = 10  # training.timeout_seconds: how long a hang holds the world before the attempt ends
DISK_MB = 128  # the checkpoint disk (a tmpfs): room for `keep` checkpoints and one being written, with margin


def _recipe(steps: int) -> dict:
    return T.recipe(
        training={
            "steps": steps,
            "deterministic": True,
            "log_every": 1,
            "timeout_seconds": HANG_TIMEOUT_S,
            "init_timeout_seconds": 120,
        },
        checkpoint={"every": EVERY, "keep": 3, "export": "safetensors", "grace_seconds": 60},
    )


def schedule(n: int, seed: int, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """n fault kinds: every kind once, in a seeded order, before any repeats."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        round_ = list(kinds)
        rng.shuffle(round_)
        out += round_
    return out[:n]


def fault_steps(steps: int, faults: int, rng: random.Random) -> list[int]:
    """The steps the faults of a run from outside strike, fixed up front: one in each of `faults` equal slices of
    the run before its last two checkpoint intervals, at a seeded place within the slice's middle half. (Drawn one
    after another from where each recovery left the run, the last ones fell past the end and were never injected.)
    A fault whose step the run has already passed strikes at once."""
    width = (steps - 2 * EVERY) / faults
    return [round(width * (i + rng.uniform(0.25, 0.75))) for i in range(faults)]


def wait_for(pred, timeout: float, what: str, interval: float = 0.2):
    """pred()'s first true value, polled every `interval` s; RuntimeError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval)
    raise RuntimeError(f"chaos: timed out after {timeout:.0f}s waiting for {what}")


def outcome(name: str, got: dict) -> dict:
    """A chaos benchmark's record from what its run returned: the goodput is the ratio, the events by kind."""
    goodput = got.pop("goodput")
    events = got.pop("events")
    print(f"{name} ledger: {got['ledger']}")
    return result(goodput, TARGET, goodput >= TARGET, **got, faults_by_kind=[e["kind"] for e in events])


def _last_step(run_dir: Path) -> int:
    """The newest trained step in the records (read from the file's end: this is polled while a run goes on)."""
    from launcher.jobenv import tail_records

    if not (run_dir / "metrics.jsonl").exists():
        return 0
    steps = [r["step"] for r in tail_records(run_dir) if "loss" in r and isinstance(r.get("step"), int)]
    return max(steps, default=0)


def _records(run_dir: Path) -> list[dict]:
    from launcher.jobenv import read_metrics

    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []


def marked(mark: str) -> Iterator[tuple[int, bytes]]:
    """(pid, raw environment) of the live processes whose environment carries the marker (zombies have none)."""
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                raw = (p / "environ").read_bytes()
            except OSError:
                continue
            if mark.encode() in raw:
                yield int(p.name), raw


def _marked(mark: str) -> list[int]:
    return [pid for pid, _ in marked(mark)]


def _codes(run_dir: Path, since: float) -> dict[int, int]:
    """rank -> the exit code its own record gave, for the ranks that wrote one since `since`."""
    out = {}
    for p in (run_dir / "status").glob("rank-*.json"):
        r = json.loads(p.read_text())
        if r.get("time", 0) >= since:
            out[int(r["rank"])] = int(r["code"])
    return out


def _fill(path: Path) -> None:
    """Take all but 1-2 MiB of the disk holding `path` (less than any checkpoint's largest file). A save may be
    writing meanwhile, so what is free is taken again until less than 2 MiB is left."""
    with open(path, "ab") as f:
        for _ in range(100):
            st = os.statvfs(path.parent)
            free = st.f_bavail * st.f_frsize
            if free < 2 << 20:
                return
            try:
                os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_size, free - (1 << 20))
            except OSError as e:
                if e.errno != errno.ENOSPC:  # taken by the save in the meantime: look again
                    raise
        raise RuntimeError(f"chaos: could not fill the disk holding {path}")


def _checkpoint_disk(root: Path) -> None:
    """A disk of its own for the checkpoints, small enough to fill: a tmpfs (mounting needs root, which CI has)."""
    root.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(root)], capture_output=True, text=True
    )
    if p.returncode != 0:
        raise RuntimeError(
            f"chaos: cannot mount a {DISK_MB} MiB tmpfs for the full-disk fault at {root} (run as root): {p.stderr.strip()}"
        )


def _corrupt_newest(root: Path) -> int | None:
    """Flip bytes in the newest complete checkpoint's largest file; its step, None when no older one is left."""
    from launcher.runtime.checkpoint import disk

    steps = disk.complete_steps(root)
    if len(steps) < 2:
        return None
    path = disk.step_path(root, steps[-1])
    victim = max((f for f in path.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    for i in range(0, len(data), max(1, len(data) // 64)):
        data[i] ^= 0xFF
    victim.write_bytes(bytes(data))
    return steps[-1]


def _attempt(
    kind: str, plan: Path, run_dir: Path, rng: random.Random, mark: str, steps: int, limit: float, gap: int
) -> dict:
    """One torchrun attempt meeting `kind` about `gap` steps after the run's newest step; what happened."""
    last = _last_step(run_dir)
    at = last + rng.randint(max(1, gap // 2), max(2, gap * 3 // 2))
    if kind == "corrupt_checkpoint":  # two checkpoints by then: resume falls back to the older (with none, the
        at = max(at, 2 * EVERY + 2)  # runtime refuses to start over by itself: nothing is ever lost silently)
    rank = rng.randint(0, 1)
    fault = {
        "rank_kill": f"sigkill:rank={rank}:step={at}",
        "node_loss": f"sigkill:step={at}",
        "preemption": f"signal:rank={rank}:step={at}:sig=USR2",
        "hang": f"hang:rank={rank}:step={at}",
        "corrupt_checkpoint": f"sigkill:rank={rank}:step={at}",
        "kill_in_checkpoint": "kill_in_checkpoint:rank=0:step=any",
        "slow_checkpoint": f"slow_checkpoint:step=any:seconds=3;sigkill:rank={rank}:step={at}",
    }.get(kind, "")
    entry = ["-m", "launcher.runtime.train", "--plan", str(plan), "--run-dir", str(run_dir)]
    env = T.env({"DTLAUNCH_FAULT": fault, "DTLAUNCH_CHAOS_MARK": mark} if fault else {"DTLAUNCH_CHAOS_MARK": mark})
    t0 = time.time()
    log = open(run_dir / "attempts.log", "a")  # noqa: SIM115 (the child writes to it)
    log.write(f"\n===== attempt: {kind} at step {at} ({fault or 'signal from the supervisor'})\n")
    log.flush()
    proc = subprocess.Popen(
        T.torchrun_cmd(entry), cwd=T.ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    ballast = run_dir / "checkpoints" / ".ballast"
    try:
        if kind in ("time_limit", "launcher_kill", "full_disk"):
            deadline = time.monotonic() + limit
            while proc.poll() is None and _last_step(run_dir) < min(at, steps - 1) and time.monotonic() < deadline:
                time.sleep(0.2)
            if kind == "full_disk":
                # kept full until the attempt ends (another tenant's data): the next save meets ENOSPC and the
                # ranks exit STORAGE (46), even where the save in flight at the fill, or its rotation, frees some
                while proc.poll() is None and time.monotonic() < deadline:
                    _fill(ballast)
                    time.sleep(0.1)
            elif proc.poll() is None:
                proc.send_signal(signal.SIGTERM if kind == "time_limit" else signal.SIGKILL)
    except BaseException:  # the bench itself failed: the attempt must not train on without it
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    # what the attempt left running: a worker that outlived its agent is waited for as long as a real
    # requeue would take to start the next attempt, then counted as an orphan
    deadline = time.monotonic() + 30
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = _marked(mark)
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    corrupted = _corrupt_newest(run_dir / "checkpoints") if kind == "corrupt_checkpoint" else None
    # STORAGE is never retried by a job script: a person frees the disk and resubmits, as this supervisor does
    ballast.unlink(missing_ok=True)
    log.close()
    return {
        "kind": kind,
        "fault": fault,
        "codes": _codes(run_dir, t0),
        "at_step": "first save" if kind == "kill_in_checkpoint" else at if kind != "none" else "-",
        "rc": rc,
        "seconds": round(time.time() - t0, 2),
        "orphans": orphans,
        "corrupted_step": corrupted,
        "reached_step": _last_step(run_dir),
    }


def _costs(run_dir: Path, happened: list[dict]) -> None:
    """Each fault's cost from the ledger's attempts: the work its attempt trained and the next one redid, and the
    time from its attempt's last trained step to the next attempt's first."""
    from launcher.runtime.goodput import attempts, kept_steps

    runs = attempts(_records(run_dir))
    for i, h in enumerate(happened):
        if i + 1 >= len(runs):
            break
        a, b = runs[i], runs[i + 1]
        trained = (a.last_step or a.from_step) - a.from_step
        h["lost_steps"] = trained - kept_steps(runs, i)
        if a.last_step_time is not None and b.first_step_start is not None:
            h["recovery_s"] = round(b.first_step_start - a.last_step_time, 2)


_MADE: dict[str, T.Run] = {}  # plan text -> the undisturbed run made of it in this process


def _reference(rec: dict, where: Path, limit: float):
    """The undisturbed run of the same steps: DTLAUNCH_CHAOS_REFERENCE names one already made (a finished run
    directory whose plan is this recipe's, byte for byte: the run is deterministic), else it is made here."""
    given = os.environ.get("DTLAUNCH_CHAOS_REFERENCE")
    wanted = T.write_plan(where, rec).read_text()
    if not given:
        if wanted not in _MADE:  # one per recipe and process: the SLURM chaos run compares with the same run
            _MADE[wanted] = T.ours(rec, scratch("dtlaunch-chaos-ref-"), hwm=False, timeout=limit)
        return _MADE[wanted].check()
    ref = Path(given)
    if not (ref / "plan.json").is_file() or (ref / "plan.json").read_text() != wanted:
        raise RuntimeError(f"DTLAUNCH_CHAOS_REFERENCE={ref}: not a run of this benchmark's recipe (plan.json differs)")
    if not any(r.get("event") == "end" for r in _records(ref)) or not (ref / "model.safetensors").is_file():
        raise RuntimeError(f"DTLAUNCH_CHAOS_REFERENCE={ref}: the run did not finish")
    return T.Run(0, "", "", 0.0, 0.0, ref)


def chaos(steps: int, faults: int, seed: int, out: Path) -> dict:
    rec = _recipe(steps)
    limit = max(600.0, 2.0 * steps)  # seconds for a whole undisturbed run (a step takes ~0.3 s here)
    ref = _reference(rec, out / "reference", limit)
    run_dir = out / "chaos"
    plan = T.write_plan(run_dir, rec)
    _checkpoint_disk(run_dir / "checkpoints")
    try:
        return _run(rec, ref, plan, run_dir, steps, faults, seed, limit)
    finally:
        subprocess.run(["umount", "--lazy", str(run_dir / "checkpoints")], capture_output=True)


def _run(rec: dict, ref, plan: Path, run_dir: Path, steps: int, faults: int, seed: int, limit: float) -> dict:
    from safetensors.torch import load_file

    from launcher.jobenv import ExitCode
    from launcher.runtime.checkpoint import disk
    from launcher.runtime.checkpoint.lock import RunLock
    from launcher.runtime.goodput import ledger

    rng = random.Random(seed)
    gap = steps // (faults + 1)  # the faults spread over the whole run, one about every `gap` steps
    mark = f"chaos-{uuid.uuid4().hex}"
    happened: list[dict] = []
    for kind in schedule(faults, seed):
        if any(r.get("event") == "end" for r in _records(run_dir)):
            break
        happened.append(_attempt(kind, plan, run_dir, rng, mark, steps, limit, gap))
        print(f"chaos: {happened[-1]}", flush=True)
    for _ in range(3):  # the run's end: undisturbed attempts until it finishes
        if any(r.get("event") == "end" for r in _records(run_dir)):
            break
        happened.append(_attempt("none", plan, run_dir, rng, mark, steps, limit, gap))
    records = _records(run_dir)
    if not any(r.get("event") == "end" for r in records):
        raise RuntimeError(f"the chaos run did not finish: see {run_dir}/attempts.log")
    _costs(run_dir, happened)
    a, b = load_file(str(ref.run_dir / "model.safetensors")), load_file(str(run_dir / "model.safetensors"))
    identical = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    final: dict[int, float] = {}
    for r in records:  # each step's loss as the run finally trained it
        if "loss" in r and isinstance(r.get("step"), int):
            final[r["step"]] = r["loss"]
    ref_losses = {r["step"]: r["loss"] for r in ref.metrics() if "loss" in r and isinstance(r.get("step"), int)}
    same_losses = final == ref_losses
    orphans = sorted({p for h in happened for p in h["orphans"]} | set(_marked(mark)))
    partials = [p.name for p in disk.partial_dirs(run_dir / "checkpoints")]
    lock = RunLock(run_dir / "checkpoints")
    lock_free = lock.acquire("chaos-check") is None
    lock.release()
    temps = [str(p) for p in run_dir.rglob("*.tmp*")]
    led = ledger(records)
    kinds = sorted({h["kind"] for h in happened if h["kind"] != "none"})
    with open(run_dir / "chaos.jsonl", "w") as f:
        for h in happened:
            f.write(json.dumps(h) + "\n")
    problems = [
        *([] if identical else ["the final weights differ from the undisturbed run's"]),
        *([] if same_losses else ["a step's loss differs from the undisturbed run's"]),
        *([f"orphaned processes: {orphans}"] if orphans else []),
        *([f"partial checkpoints left: {partials}"] if partials else []),
        *([] if lock_free else ["the checkpoint lock is still held"]),
        *([f"temporary files left: {temps}"] if temps else []),
        *(
            f"a full disk at step {h['at_step']} did not end the attempt with STORAGE: {h['codes']}"
            for h in happened
            if h["kind"] == "full_disk" and ExitCode.STORAGE not in h["codes"].values()
        ),
    ]
    print(
        f"chaos: {len([h for h in happened if h['kind'] != 'none'])} faults of {len(kinds)} kinds over {steps} steps, "
        f"{len(happened)} attempts, allocated {led['allocated']:.0f}s, goodput {led['goodput']:.3f}; "
        f"weights bit-identical: {identical}; losses identical: {same_losses}; "
        f"{'clean' if not problems else 'PROBLEMS: ' + '; '.join(problems)}"
    )
    for h in happened:
        print(
            f"  {h['kind']:<20} at step {h['at_step']:>5}  rc {h['rc']:>4}  lost {h.get('lost_steps', '-'):>3} steps  "
            f"recovery {h.get('recovery_s', '-')}s"
        )
    if problems:
        raise RuntimeError("chaos: " + "; ".join(problems) + f" (run: {run_dir})")
    return {
        "faults": len([h for h in happened if h["kind"] != "none"]),
        "kinds": kinds,
        "attempts": len(happened),
        "steps": steps,
        "ledger": {k: round(v, 2) for k, v in led.items()},
        "goodput": led["goodput"],
        "identical": identical,
        "events": happened,
    }


def run(quick: bool = False) -> dict:
    # quick: every kind once, on a short run (CI); full: 20 faults over ~25 minutes of this machine (and the
    # undisturbed run of the same steps, ~20 more)
    steps, faults = (200, len(KINDS)) if quick else (4_500, 20)
    with tempfile.TemporaryDirectory(prefix="dtlaunch-chaos-") as tmp:
        got = chaos(steps, faults, seed=0, out=Path(tmp))
    return outcome("chaos", got)


if __name__ == "__main__":
    import sys

    run(quick="--quick" in sys.argv)
