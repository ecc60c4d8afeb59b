"""The goodput ledger: a run's time by cause from its own records. The arithmetic on a hand-built two-attempt
history (every figure below worked out by hand), the CLI on a registered job with the plan's prices, and a real
two-rank run killed after its step-4 checkpoint and resumed: the steps it trained past that checkpoint are
lost work, and the causes add up to the allocated time."""

from __future__ import annotations

import json
import time

import pytest

from launcher.runtime.goodput import checkpoint_stall, ledger, measured_interval, report
from launcher.targets.local.request import LocalHandle
from launcher.targets.registry import JobRecord, Registry
from rt_harness import det_recipe, run_torchrun, write_plan


def _step(step: int, t: float) -> dict:
    return {"step": step, "loss": 1.0, "step_time_s": 1.0, "time": t}


# attempt 1: starts at 100, checks until 102, trains steps 1-10 (1 s each, from 104 to 114) with a 0.5 s
# synchronous save at step 8 (async saves do not stall); killed. Attempt 2 starts at 130, checks until 131, resumes
# step 8 at 133, trains 9-12 (134 to 138), ends at 139.
HISTORY = [
    {"event": "start", "time": 100.0},
    {"event": "preflight", "time": 102.0},
    *[_step(s, 104.0 + s) for s in range(1, 8)],
    {"event": "checkpoint", "step": 8, "seconds": 0.5, "asynchronous": False, "time": 112.5},
    {"event": "checkpoint", "step": 4, "seconds": 3.0, "asynchronous": True, "time": 109.0},
    _step(8, 112.5),
    _step(9, 113.5),
    _step(10, 114.0),
    {"event": "start", "time": 130.0},
    {"event": "preflight", "time": 131.0},
    {"event": "resume", "step": 8, "time": 133.0},
    *[_step(s, 125.0 + s) for s in range(9, 13)],
    {"event": "end", "step": 12, "time": 139.0},
]


def test_the_ledger_of_a_killed_and_resumed_run():
    led = ledger(HISTORY, created=90.0)
    assert led["queue"] == 10.0
    assert led["preflight"] == 2.0 + 1.0
    assert led["startup"] == (104.0 - 102.0) + (133.0 - 131.0)  # to the first step's start (its record less 1 s)
    # attempt 1 trained 10 steps in 114 - 104 - 0.5 = 9.5 s; the next resumed from step 8: 2 of them were lost
    assert led["useful"] == pytest.approx(9.5 * 8 / 10 + (137.0 - 133.0))
    assert led["lost"] == pytest.approx(9.5 * 2 / 10)
    assert led["checkpoint"] == 0.5
    assert led["ending"] == 0.0 + (139.0 - 137.0)
    assert led["recovery"] == 130.0 - 114.0
    assert led["allocated"] == 39.0
    assert led["goodput"] == pytest.approx((7.6 + 4.0) / 39.0)
    parts = sum(led[k] for k in ("preflight", "startup", "useful", "lost", "checkpoint", "ending", "recovery"))
    assert parts == pytest.approx(led["allocated"])


# Attempts 1 and 2 share an allocation (the job script began at 95; torchrun restarted the workers in place at
# 110); the job script saw the training exit at 117 and requeued the job, which waited in the queue until its next
# allocation began at 140; attempt 3 started at 150.
ALLOCATIONS = [
    {"event": "start", "time": 100.0, "allocation_start": 95.0},
    *[_step(s, 100.0 + s) for s in range(1, 6)],
    {"event": "start", "time": 110.0, "allocation_start": 95.0},
    {"event": "resume", "step": 4, "time": 111.0},
    *[_step(s, 107.0 + s) for s in range(5, 9)],
    {"event": "exited", "code": 42, "time": 117.0},
    {"event": "start", "time": 150.0, "allocation_start": 140.0},
    {"event": "resume", "step": 8, "time": 151.0},
    *[_step(s, 143.0 + s) for s in range(9, 11)],
    {"event": "end", "step": 10, "time": 154.0},
]


def test_the_queue_between_allocations_is_not_allocated_time(tmp_path):
    led = ledger(ALLOCATIONS, created=90.0)
    assert led["elapsed"] == 154.0 - 95.0
    assert led["queue"] == (95.0 - 90.0) + (140.0 - 117.0)  # before the first allocation, and after the requeue
    assert led["allocated"] == 59.0 - 23.0
    assert led["startup"] == (100.0 - 95.0) + 0.0 + 1.0 + 1.0  # the job script's front, then each attempt's
    assert led["useful"] == pytest.approx(4.0 + 4.0 + 2.0)  # attempt 1's 5th step was redone by attempt 2
    assert led["lost"] == pytest.approx(1.0)
    assert led["ending"] == 0.0 + (117.0 - 115.0) + (154.0 - 153.0)  # to the job script's `exited` record
    assert led["recovery"] == (110.0 - 105.0) + (150.0 - 140.0)  # the restart in place; the new allocation's front
    parts = sum(led[k] for k in ("preflight", "startup", "useful", "lost", "checkpoint", "ending", "recovery"))
    assert parts == pytest.approx(led["allocated"])
    assert led["goodput"] == pytest.approx(10.0 / 36.0)
    assert led["goodput_elapsed"] == pytest.approx(10.0 / 59.0)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ALLOCATIONS))
    lines = report(tmp_path, created=90.0)
    assert "  goodput = useful / allocated = 27.8%" in lines
    assert "  (useful / elapsed, the queue between allocations included: 16.9% of 59.0s)" in lines
    # without the job script's record of the exit, the first allocation's end is unknown: allocated throughout
    unrecorded = ledger([r for r in ALLOCATIONS if r.get("event") != "exited"], created=90.0)
    assert unrecorded["queue"] == 95.0 - 90.0 and unrecorded["allocated"] == 154.0 - 95.0
    assert unrecorded["recovery"] == (110.0 - 105.0) + (150.0 - 115.0)
    # the same records without the allocation starts: every second from the first start counts
    bare = [{k: v for k, v in r.items() if k != "allocation_start"} for r in ALLOCATIONS]
    assert ledger(bare)["allocated"] == ledger(bare)["elapsed"] == 154.0 - 100.0


def test_an_async_saves_stall_is_what_training_waited_for_it(reference):
    """A synchronous save holds training for all of its time; an async one (FSDP's here) for the wait for the
    previous save and its staging only: each commit records that as `stalled`, which the ledger counts."""
    sync = [e for e in reference("ddp").events("checkpoint")]
    assert sync and all(not e["asynchronous"] and e["stalled"] == e["seconds"] for e in sync), sync
    background = [e for e in reference("fsdp").events("checkpoint") if e["asynchronous"]]
    assert background and all(0 < e["stalled"] < e["seconds"] for e in background), background
    led = ledger(reference("fsdp").metrics())
    assert led["checkpoint"] == pytest.approx(sum(e["stalled"] for e in reference("fsdp").events("checkpoint")))
    # records from before `stalled` was written: an async save counts nothing, a synchronous one its seconds
    assert checkpoint_stall({"seconds": 3.0, "asynchronous": True}) == 0.0
    assert checkpoint_stall({"seconds": 3.0, "asynchronous": False}) == 3.0
    assert checkpoint_stall({"seconds": 3.0, "asynchronous": True, "stalled": 0.25}) == 0.25


def test_the_checkpoint_interval_from_what_happened():
    """One interruption in 39 s allocated, saves of 0.5 s and 3.0 s, steps of 1 s, and a recovery from the last
    step at 114 to the next attempt's first at 133 (19 s): the availability-optimal interval is
    sqrt(2 x 1.75 x (39 + 19) + 1.75^2) = 14.35 s = 14 steps; Young/Daly's sqrt(2 x 1.75 x 39) = 11.68 s. A run
    never interrupted gives no figure."""
    got = measured_interval(HISTORY)
    assert got is not None
    assert got["between_interruptions_s"] == 39.0 and got["write_s"] == 1.75 and got["recovery_s"] == 19.0
    assert got["step_s"] == 1.0
    assert got["young_daly_s"] == pytest.approx(136.5**0.5)
    assert got["interval_s"] == pytest.approx(206.0625**0.5) and got["every"] == 14
    assert measured_interval(HISTORY[-5:]) is None  # one attempt, ended with the run's end: no interruption
    running = [r for r in HISTORY if r.get("event") != "end"]  # the second attempt still running: one interruption
    assert measured_interval(running)["between_interruptions_s"] == 37.0  # type: ignore[index]


def test_the_availability_optimal_interval_maximises_availability():
    """The closed form against the model it comes from, maximised by brute force: tau of work and a write delta
    per cycle, failures at rate 1/M each losing half a cycle and a recovery R. It tends to Young/Daly when delta
    and R are small beside M, and exceeds it when recovery is costly."""
    from launcher.plan.cost import availability_interval, young_daly_interval

    def availability(tau, d, m, r):
        cycle = tau + d
        return tau / (cycle + cycle / m * (cycle / 2 + r))

    for d, m, r in [(60.0, 3600.0, 600.0), (5.0, 28_800.0, 1800.0), (300.0, 7200.0, 60.0), (1.0, 50.0, 20.0)]:
        grid = [x / 100 for x in range(1, 2_000_000, 7)]
        best = max(grid, key=lambda t: availability(t, d, m, r))
        assert availability_interval(d, m, r) == pytest.approx(best, abs=0.1)
    assert availability_interval(1.0, 1e7, 0.0) == pytest.approx(young_daly_interval(1.0, 1e7), rel=1e-4)
    assert availability_interval(60.0, 3600.0, 1800.0) > 1.2 * young_daly_interval(60.0, 3600.0)


def test_status_goodput_prints_each_cause_with_its_cost(run_cli, tmp_path):
    d = tmp_path / "runs" / "big"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in HISTORY))
    # the plan's price: $3,600 for 100 steps of 1 s = $36 per second of the job
    (d / "plan.json").write_text(json.dumps({"plan": {"usd": 3600.0, "steps": 100, "step_seconds": 1.0}}))
    handle = LocalHandle(1, time.time(), "x", str(d / "up.log"), str(d / "exit"))
    Registry().add(JobRecord("big", "local", "7", str(d), handle, 90.0))
    code, out, err = run_cli("status", "big", "--goodput")
    assert code == 0, out + err
    assert "lost work: steps trained again after a failure" in out and "1.9s" in out and "$68.40" in out
    assert "between attempts, allocated: restart, requeue" in out and "16.0s" in out and "$576.00" in out
    assert "goodput = useful / allocated = 29.7%" in out
    assert "checkpoint interval from this run: every 14 steps (14.4s, availability-optimal; Young/Daly 11.7s)" in out
    assert "an interruption every 39.0s, a save 1.75s, a recovery 19.0s, a step 1s" in out
    code, out, err = run_cli("status", "--goodput")
    assert code != 0 and "--goodput needs a job" in out + err


def test_plot_goodput_draws_each_cause_as_its_share_of_the_bar(run_cli, tmp_path):
    from launcher.cli.plot import GOODPUT_GID, goodput_figure

    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in HISTORY))
    fig = goodput_figure(d)
    bars = [p for p in fig.axes[0].patches if p.get_gid() == GOODPUT_GID]
    led = ledger(HISTORY)
    widths = {c.get_label(): c.patches[0].get_width() for c in fig.axes[0].containers}  # a cause's bar and label
    assert len(bars) == len(widths)
    assert widths["training (useful)"] == pytest.approx(led["useful"])
    assert widths["lost work: steps trained again after a failure"] == pytest.approx(led["lost"])
    assert sum(widths.values()) == pytest.approx(led["allocated"])  # one bar: the allocated time, all of it
    assert bars[0].get_x() == 0 and "goodput 29.7%" in fig.axes[0].get_title()
    code, out, err = run_cli("plot", d, "--goodput")
    assert code == 0 and f"wrote {d / 'goodput.png'}" in out, out + err
    assert (d / "goodput.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_checkpoint_adapt_saves_at_the_interval_the_run_history_calls_for(run_dir):
    """A run with checkpoint.adapt whose history holds one interrupted attempt (steps of 2 s, a 0.5 s save, its
    last step 43 s before the restart, which began 60 s after it): the restart saves every 5 or 6 steps instead
    of the planned 100 (sqrt(2 x 0.5 x (M + R) + 0.25) / 2 s with M = 60 + t and R = 43 + t, t the few seconds
    the restart takes to begin), on both ranks alike (a rank saving alone would hang the other)."""
    plan = write_plan(run_dir, det_recipe("ddp", checkpoint={"every": 100, "adapt": True}))
    t0 = time.time() - 60
    history = [
        {"event": "start", "time": t0},
        {"event": "preflight", "time": t0 + 1},
        *({"step": s, "loss": 1.0, "step_time_s": 2.0, "time": t0 + 1 + 2 * s} for s in range(1, 9)),
        {"event": "checkpoint", "step": 4, "seconds": 0.5, "asynchronous": False, "time": t0 + 9.5},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    res = run_torchrun(plan, run_dir)
    assert res.rc == 0, res.output[-3000:]
    [chosen] = res.events("interval")
    assert chosen["planned"] == 100 and chosen["every"] in (5, 6), chosen
    assert chosen["recovery_s"] == pytest.approx(chosen["between_interruptions_s"] - 17, abs=0.01)
    saved = [e["step"] for e in res.events("checkpoint") if e["time"] > t0 + 30 and e["step"] != 12]  # 12: final
    assert saved and all(s % chosen["every"] == 0 for s in saved), saved
    assert f"checkpoint.adapt: saving every {chosen['every']} steps (was 100)" in res.output


@pytest.mark.slow
def test_a_real_run_killed_after_a_checkpoint_recovers_onto_a_fresh_node_and_its_ledger_adds_up(tmp_path):
    """A rank SIGKILLed at step 7 (a checkpoint every 4), the run resumed from step 4: the ledger has lost work
    and a recovery, and its parts add up to the allocated time. The checkpoints are on storage apart from the run
    directory (SkyPilot's bucket beside a node's disk) and the resume runs on a node that never ran the job: the
    records are kept with the checkpoints, so it starts from the run's history and counts both attempts."""
    storage = tmp_path / "bucket" / "run-1"
    first_node, fresh_node = tmp_path / "node-a" / "run", tmp_path / "node-b" / "run"
    recipe = det_recipe("ddp")
    env = {"DTLAUNCH_CHECKPOINT_DIR": str(storage)}
    first = run_torchrun(
        write_plan(first_node, recipe), first_node, env={**env, "DTLAUNCH_FAULT": "sigkill:rank=1:step=7"}
    )
    assert first.rc != 0
    kept = (storage / "metrics.jsonl").read_text()
    assert '"event": "checkpoint"' in kept and '"step": 4' in kept
    again = run_torchrun(write_plan(fresh_node, recipe), fresh_node, env=env)
    assert again.rc == 0, again.output[-3000:]
    records = again.metrics()
    assert [r["event"] for r in records if r.get("event") in ("start", "resume", "end")] == [
        "start",
        "start",
        "resume",
        "end",
    ]
    assert [e["step"] for e in again.events("resume")] == [4]
    led = ledger(records)
    assert led["lost"] > 0 and led["useful"] > 0 and led["recovery"] > 0
    parts = sum(led[k] for k in ("preflight", "startup", "useful", "lost", "checkpoint", "ending", "recovery"))
    assert parts == pytest.approx(led["allocated"], rel=1e-6)
    assert 0 < led["goodput"] < 1
    lines = report(fresh_node)
    assert lines[0] == f"goodput of {fresh_node} (2 attempt(s)):" and "$" not in "".join(lines)  # a CPU run
    assert (storage / "metrics.jsonl").read_text() == (fresh_node / "metrics.jsonl").read_text()  # the end kept too
