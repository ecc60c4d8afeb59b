"""Recovery: after a SIGKILL of one rank (DTLAUNCH_FAULT=sigkill:rank=1:step=K) under
`torchrun --max-restarts=1`, the seconds from the kill to the first resumed training step, against a
cold start of the same job (seconds from launching torchrun to the first training step); and the work
lost (steps trained again after the restart).

Each faulty run contains its own cold start: its first attempt is exactly the same job launched from
nothing, on the same machine at the same moment, so the two are naturally interleaved. The kill time is
the fault injector's log line (time.time() just before os.kill), the launch time is taken just before
torchrun starts, and the first step's time is its metrics.jsonl record (end of the step) in both cases.
DDP on the tiny preset, a sync checkpoint every EVERY steps. Targets: ratio <= 1.5; lost work <= EVERY steps.
"""

from __future__ import annotations

import re

import _torchrun as T
from common import result, scratch, stats

TARGET = 1.5
EVERY = 5
KILL_STEP = 13  # steps 1-12 done, checkpoint at 10: steps 11 and 12 are lost


def _analyse(run: T.Run) -> dict:
    ms = run.metrics()
    m = re.search(r"FAULT INJECTION rank \d+: sigkill at step (\d+) \(t=([0-9.]+)\)", run.err)
    if m is None:
        raise RuntimeError(f"no fault injection line in {run.run_dir}/torchrun.log")
    kill_step, t_kill = int(m.group(1)), float(m.group(2))
    resume = [i for i, e in enumerate(ms) if e.get("event") == "resume"]
    if not resume:
        raise RuntimeError(f"the job did not resume after the kill ({run.run_dir}/torchrun.log)")
    first_cold = next(e for e in ms if "loss" in e)
    i = resume[0]
    resumed_from = ms[i]["step"]
    first_after = next(e for e in ms[i:] if "loss" in e)
    done_before = max(e["step"] for e in ms[:i] if "loss" in e)  # completed (and logged) before the kill
    return {
        "cold_start_s": first_cold["time"] - run.t_launch,
        "recovery_s": first_after["time"] - t_kill,
        "kill_step": kill_step,
        "resumed_from": resumed_from,
        "lost_steps": done_before - resumed_from,
        "first_step_s_cold": first_cold["step_time_s"],
        "first_step_s_resumed": first_after["step_time_s"],
        "completed": max(e["step"] for e in ms if "loss" in e),
    }


def run(quick: bool = False) -> dict:
    repeat = 1 if quick else 3
    base = scratch("bench-recovery-")
    rec = T.recipe(training={"steps": KILL_STEP + 3, "log_every": 1}, checkpoint={"every": EVERY, "keep": 2})
    runs = []
    for i in range(repeat):
        r = T.ours(
            rec,
            base / f"run-{i}",
            hwm=False,
            max_restarts=1,
            extra_env={"DTLAUNCH_FAULT": f"sigkill:rank=1:step={KILL_STEP}"},
        ).check()
        runs.append(_analyse(r))
    cold = stats([r["cold_start_s"] for r in runs])
    rec_s = stats([r["recovery_s"] for r in runs])
    lost = max(r["lost_steps"] for r in runs)
    ratio = rec_s["median"] / cold["median"]
    meets = ratio <= TARGET and lost <= EVERY
    print(
        f"recovery: kill -> first resumed step {rec_s['median']:.1f}s (min {rec_s['min']:.1f}, max {rec_s['max']:.1f}) "
        f"vs cold start -> first step {cold['median']:.1f}s (min {cold['min']:.1f}, max {cold['max']:.1f}) -> "
        f"{ratio:.2f}x (target <= {TARGET}); lost {lost} steps (target <= checkpoint interval {EVERY})"
    )
    return result(
        ratio,
        TARGET,
        meets,
        recovery_s=rec_s,
        cold_start_s=cold,
        lost_steps_max=lost,
        checkpoint_every=EVERY,
        lost_target=EVERY,
        lost_meets=lost <= EVERY,
        runs=runs,
        setup="DDP, tiny preset, 2 ranks gloo, torchrun --max-restarts=1, sync checkpoint every "
        f"{EVERY} steps, SIGKILL of rank 1 at the start of step {KILL_STEP}",
    )
