"""Chaos on simulated SkyPilot VMs under a managed job's recovery: the shorter companion of chaos_slurm.

The run is rendered by `dtlaunch render --target sky` as a managed job (targets.sky.managed, recovery onto fresh
nodes, checkpoints on a bucket) and runs on two of tests/sky/sky_nodes.py's simulated VMs: each its own root
filesystem, PID, mount and network namespaces, the cloud user, the task's setup installing dtlaunch from the
rendered wheel, and the bucket as the only storage two VMs (or two node sets) share. Faults come from outside,
seeded, as a cloud brings them:

    rank_kill           SIGKILL to one rank: torchrun restarts the workers on the same VMs (targets.sky.max_restarts)
    vm_loss             one VM preempted: every process on it gone at once, and its disk (the node set is destroyed)
    hang                SIGSTOP to one rank: the other's collective timeout ends the launch with 43
    corrupt_checkpoint  a VM preempted, and the bucket's newest checkpoint corrupted before the relaunch: the
                        resume falls back past it
    kill_in_checkpoint  SIGKILL to every rank while a save is being written to the bucket (its uncommitted
                        directory): torchrun restarts them

Whenever the VMs' `run` ends without finishing the run, this plays SkyPilot's managed-job controller: a lost VM
is a preemption, always recovered; otherwise SkyPilot's own recovery code decides from the nodes' exit codes
(sky.jobs.recovery_strategy, built from the rendered task.yaml: recover_on_exit_codes, max_restarts_on_errors).
A recovery destroys the node set (its disks with it) and provisions fresh VMs, which run setup and `run` again
with the same SKYPILOT_TASK_ID. At the end: the weights equal an undisturbed run's of the same steps (local
torchrun, 2 ranks: the same sums), no process is left, and the ledger (from the records the runtime keeps on the
bucket) gives the goodput. Not simulated: provisioning (instant here, minutes on a cloud) and the controller's
polling delay; a lost VM's records end at its last checkpoint, so its last seconds count as recovery.

Run as root (namespaces, bridges): `python bench/run.py --only chaos_sky --update`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import chaos as C

import _torchrun as T

sys.path.insert(0, str(T.ROOT / "tests" / "sky"))

TASK_ID = "sky-managed-2026-11-29-00-00-00-000000_bench_1-0"
BUCKET = "s3://dtlaunch-chaos/ckpt"
KINDS = ("rank_kill", "vm_loss", "hang", "corrupt_checkpoint", "kill_in_checkpoint")
RECOVERS_ON_FRESH_VMS = ("vm_loss", "hang", "corrupt_checkpoint")


def _render(out: Path, steps: int) -> None:
    """The bench's chaos recipe on two one-rank VMs, managed, checkpoints on the bucket, rendered as
    `dtlaunch render --target sky` does (the wheel included)."""
    import yaml

    sys.path.insert(0, str(T.ROOT))
    from launcher.plan import make_plan
    from launcher.recipe import load_text
    from launcher.render import render

    rec = C._recipe(steps)
    rec["resources"] = {"accelerator": "cpu:1", "nodes": 2}
    rec["targets"] = {
        "sky": {
            "managed": True,
            "recovery": "fresh_nodes",
            "max_restarts": 100,
            "max_restarts_on_errors": 100,
            "checkpoint_storage": {"bucket": BUCKET},
        }
    }
    r = load_text(yaml.safe_dump(rec), source="<chaos_sky recipe>")
    render(r, make_plan(r), "sky").write(out)


def _workers(mark: str) -> dict[int, int]:
    """rank -> pid of the live training processes (seen from the host: the VMs' PID namespaces nest in it)."""
    out = {}
    for pid, raw in C.marked(mark):
        env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if "LOCAL_RANK" in env and b"launcher.runtime.train" in cmd and env.get("RANK", "").isdigit():
            out[int(env["RANK"])] = pid
    return out


def _kill(pids, sig: int = signal.SIGKILL) -> list[int]:
    done = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            done.append(pid)
        except ProcessLookupError:
            pass
    return done


class Controller:
    """The managed job: the current node set, its launch, and SkyPilot's recovery decision."""

    def __init__(self, job: Path, root: Path, image, mark: str):
        import sky
        from sky import backends
        from sky.jobs.recovery_strategy import StrategyExecutor

        self.job, self.root, self.image, self.mark = job, root, image, mark
        task = sky.Task.from_yaml(str(job / "task.yaml"))
        self.executor = StrategyExecutor.make(
            "dtlaunch-chaos", backends.CloudVmRayBackend(), task, 1, 0, None, set(), asyncio.Lock(), asyncio.Condition()
        )
        self.nodes = None
        self.procs: list = []
        self.launches = 0
        self.recoveries = 0
        self.run_dir = None  # the bucket's copy of the run directory's records and the checkpoints

    def launch(self) -> None:
        """Fresh VMs: provision, setup, run (a managed job's launch and each recovery)."""
        from sky_nodes import SkyNodes

        self.nodes = SkyNodes(self.job, nodes=2, task_id=TASK_ID, root=self.root, image=self.image, netns=True)
        self.nodes.provision()
        for r in self.nodes.setup():
            if r.returncode != 0:
                raise RuntimeError(f"chaos_sky: setup failed ({r.returncode}): {r.stdout[-2000:]}")
        self.run_dir = self.nodes.bucket(BUCKET) / TASK_ID
        self.procs = self.nodes.start({"DTLAUNCH_CHAOS_MARK": self.mark})
        self.launches += 1

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def local_run_dir(self) -> Path | None:
        """The run directory on the VM that hosts rank 0 (its records are current; the bucket's copy is as of
        the last checkpoint)."""
        from sky_nodes import WORKDIR

        for r in range(2):
            d = self.nodes.node_path(r, f"{WORKDIR}/runs/{TASK_ID}")
            if (d / "metrics.jsonl").exists():
                return d
        return None

    def step(self) -> int:
        d = self.local_run_dir()
        return C._last_step(d) if d is not None else 0

    def trains_again(self, since: float) -> bool:
        """An attempt started after `since` and logged a step."""
        from launcher.jobenv import tail_records

        d = self.local_run_dir()
        recs = tail_records(d) if d is not None else []
        starts = [r["time"] for r in recs if r.get("event") == "start" and r["time"] > since]
        return bool(starts) and any("loss" in r and "event" not in r and r["time"] > starts[0] for r in recs)

    def finished(self) -> bool:
        return self.codes() == [0, 0]

    def recover(self, vm_lost: bool, timeout: float) -> dict:
        """Once the launch has ended: the controller's decision, then fresh VMs."""
        codes = self.nodes.wait(self.procs, timeout)
        if not vm_lost and not self.executor.should_restart_on_failure(exit_codes=codes):
            raise RuntimeError(f"chaos_sky: SkyPilot would not recover a launch that ended with {codes}")
        self.nodes.destroy()
        self.recoveries += 1
        self.launch()
        return {"exit_codes": codes, "fresh_vms": True}

    def recovered(self, since: float, vm_lost: bool, timeout: float) -> dict:
        """Until the run trains again after a fault: torchrun's restart on the same VMs, or, when the launch
        ended (or a VM was lost), the controller's recovery onto fresh ones."""
        deadline = time.monotonic() + timeout
        got: dict = {}
        while time.monotonic() < deadline:
            if vm_lost or any(c not in (None, 0) for c in self.codes()):
                got = self.recover(vm_lost, 60)
                vm_lost = False
            if self.trains_again(since):
                return got
            if self.codes() == [0, 0]:
                return got
            time.sleep(0.2)
        raise RuntimeError(f"chaos_sky: the run did not train again within {timeout:.0f}s")

    def close(self) -> None:
        if self.nodes is not None:
            self.nodes.destroy()


def _inject(kind: str, ctl: Controller, rng: random.Random) -> dict:
    """The fault, from outside; what was done. Returns once the run trains again."""
    from launcher.runtime.checkpoint import disk

    t0 = time.time()
    rank = rng.randint(0, 1)
    workers = _workers(ctl.mark)
    vm_lost = kind in ("vm_loss", "corrupt_checkpoint")
    if kind == "rank_kill":
        got = {"killed": _kill([workers[rank]]), "rank": rank}
    elif kind == "hang":
        got = {"stopped": _kill([workers[rank]], signal.SIGSTOP), "rank": rank}
    elif kind == "vm_loss":
        ctl.nodes.kill_node(rank)
        got = {"vm": rank}
    elif kind == "corrupt_checkpoint":
        for r in (rank, 1 - rank):  # both: no rank may save over the corrupted checkpoint before the relaunch
            ctl.nodes.kill_node(r)
        got = {"vm": "all", "corrupted_step": C._corrupt_newest(ctl.run_dir)}
    elif kind == "kill_in_checkpoint":
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not disk.partial_dirs(ctl.run_dir):
            time.sleep(0.005)
        got = {"killed": _kill(_workers(ctl.mark).values())}
    else:
        raise ValueError(kind)
    return {**got, **ctl.recovered(t0, vm_lost, 600)}


def chaos(steps: int, faults: int, seed: int, out: Path) -> dict:
    from safetensors.torch import load_file

    from launcher.runtime.checkpoint import disk
    from launcher.runtime.goodput import attempts, ledger
    from sky_nodes import WORKDIR, build_image, destroy_all

    rec = C._recipe(steps)
    ref = T.ours(rec, out / "reference", hwm=False, timeout=max(600.0, 2.0 * steps)).check()
    job = out / "job"
    _render(job, steps)
    mark = f"chaos-sky-{uuid.uuid4().hex}"
    ctl = Controller(job, out / "nodes", build_image(out / "image"), mark)
    rng = random.Random(seed)
    ats = C.fault_steps(steps, faults, rng)
    happened: list[dict] = []
    try:
        ctl.launch()
        for kind, planned in zip(C.schedule(faults, seed, KINDS), ats, strict=True):
            at = max(planned, ctl.step() + 1, 2 * C.EVERY + 2 if kind == "corrupt_checkpoint" else 0)
            if at >= steps - C.EVERY:
                break
            C.wait_for(
                lambda at=at: ctl.step() >= at or any(c is not None for c in ctl.codes()), 900, f"step {at}", 0.1
            )
            if any(c is not None for c in ctl.codes()):
                raise RuntimeError(f"chaos_sky: the launch ended with {ctl.codes()} before step {at}")
            t0, step = time.time(), ctl.step()
            done = _inject(kind, ctl, rng)
            happened.append({"kind": kind, "at_step": step, "t0": t0, "back_s": round(time.time() - t0, 2), **done})
            print(f"chaos_sky: {happened[-1]}", flush=True)
        codes = ctl.nodes.wait(ctl.procs, max(600.0, 2.0 * steps))
        if codes != [0, 0]:
            raise RuntimeError(f"chaos_sky: the last launch ended with {codes}: see {out}")
        time.sleep(1)
        orphans = [pid for pid, _ in C.marked(mark)]
        records = C._records(ctl.run_dir)
        exports = [ctl.nodes.node_path(r, f"{WORKDIR}/runs/{TASK_ID}/model.safetensors") for r in range(2)]
        exported = next((p for p in exports if p.exists()), None)
        if exported is None:
            raise RuntimeError("chaos_sky: no node exported the model")
        a, b = load_file(str(ref.run_dir / "model.safetensors")), load_file(str(exported))
        identical = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
        partials = [p.name for p in disk.partial_dirs(ctl.run_dir)]
    finally:
        ctl.close()
        destroy_all()
    final = {r["step"]: r["loss"] for r in records if "loss" in r and isinstance(r.get("step"), int)}
    ref_losses = {r["step"]: r["loss"] for r in ref.metrics() if "loss" in r and isinstance(r.get("step"), int)}
    led = ledger(records)
    kinds = sorted({h["kind"] for h in happened})
    problems = [
        *([] if identical else ["the final weights differ from the undisturbed run's"]),
        *([] if final == ref_losses else ["a step's loss differs from the undisturbed run's"]),
        *([f"orphaned processes: {orphans}"] if orphans else []),
        *([f"partial checkpoints left: {partials}"] if partials else []),
    ]
    (out / "chaos_sky.jsonl").write_text("".join(json.dumps(h) + "\n" for h in happened))
    print(
        f"chaos_sky: {len(happened)} faults of {len(kinds)} kinds over {steps} steps, {ctl.launches} launches "
        f"({ctl.recoveries} recoveries onto fresh VMs), {len(attempts(records))} attempts, allocated "
        f"{led['allocated']:.0f}s, goodput {led['goodput']:.3f}; weights bit-identical: {identical}; "
        f"{'clean' if not problems else 'PROBLEMS: ' + '; '.join(problems)}"
    )
    if problems:
        raise RuntimeError("chaos_sky: " + "; ".join(problems) + f" (run: {out})")
    return {
        "faults": len(happened),
        "kinds": kinds,
        "launches": ctl.launches,
        "attempts": len(attempts(records)),
        "steps": steps,
        "ledger": {k: round(v, 2) for k, v in led.items()},
        "goodput": led["goodput"],
        "identical": identical,
        "events": happened,
    }


def run(quick: bool = False) -> dict:
    # quick (a try of the bench, not in the smoke run): two faults on a short run; full: every kind twice
    steps, faults = (100, 2) if quick else (800, 2 * len(KINDS))
    keep = os.environ.get("DTLAUNCH_CHAOS_SKY_OUT")  # a directory to keep the nodes' logs and the bucket in
    with tempfile.TemporaryDirectory(prefix="dtlaunch-chaos-sky-") as tmp:
        got = chaos(steps, faults, seed=0, out=Path(keep or tmp))
    return C.outcome("chaos_sky", got)


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
