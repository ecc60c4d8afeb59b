"""Issue 35, `dtlaunch logs NAME --diagnose`: a run's ending in a few lines, from the records its ranks left. A
real local job (torchrun, 2 gloo ranks) whose rank 1 stops at step 2: rank 0 times out in the step's collective
and reports HANG; rank 1 is ended by its no-progress watchdog without a record of its own (torchrun reports its
exit), and the diagnosis names it as the likely culprit, on its node."""

from __future__ import annotations

import json
import pickle
import re
import socket
from pathlib import Path

import pytest

from launcher.cli.diagnose import diagnose
from launcher.runtime import hangs
from testpaths import RECIPES


@pytest.mark.slow
def test_a_hang_names_the_rank_that_never_reached_the_collective(run_cli, tmp_path):
    run = tmp_path / "run"
    sets = (
        "training.steps=4",
        "training.timeout_seconds=5",
        "training.preflight=false",
        "env.DTLAUNCH_FAULT=hang:rank=1:step=2",
        "targets.local.max_restarts=0",
    )
    code, out, err = run_cli("up", RECIPES / "tiny.yaml", "-o", run, *(x for s in sets for x in ("--set", s)))
    assert code == 43, out + err
    code, text, err = run_cli("logs", "tiny", "--diagnose")
    assert code == 0, err
    host = socket.gethostname()
    assert "not finished: last logged step 1" in text, text
    assert f"HANG (43) on rank 0 ({host}) at step 2: " in text, text
    # rank 0 timed out in a collective its flight recorder holds and rank 1's (written by its no-progress
    # watchdog, or missing) does not; py-spy took both ranks' stacks, rank 1's stuck in the injected fault
    culprit = re.search(
        rf"likely culprit: rank 1 on {host}: never entered gloo:(\w+) #(\d+) in default_pg, where rank 0 waited", text
    )
    assert culprit, text
    assert re.search(r"\n    rank 1: in Faults.at_step_start \(launcher/runtime/inject.py:\d+\)", text), text
    assert "\n    rank 0: in" not in text, text


def test_a_directory_without_records_says_so(tmp_path):
    assert diagnose(tmp_path) == [
        f"{tmp_path}: no run records (status/, metrics.jsonl) yet: the job has not started training"
    ]


def _dump(*collectives: tuple[str, int, str]) -> bytes:
    """A flight-recorder dump as torch writes one (a pickled dict of plain values), one entry per
    (process group, collective sequence number, name)."""
    entries = [
        {
            "record_id": i,
            "process_group": ("0" if pg == "default_pg" else "1", pg),
            "collective_seq_id": seq,
            "p2p_seq_id": 0,
            "profiling_name": name,
            "is_p2p": False,
            "state": "scheduled",
        }
        for i, (pg, seq, name) in enumerate(collectives)
    ]
    return pickle.dumps({"version": "2.10", "pg_config": {}, "entries": entries})


def test_the_flight_recorder_names_the_rank_behind_and_the_collective_it_missed(tmp_path):
    ahead = _dump(
        ("default_pg", 6, "gloo:all_reduce"), ("default_pg", 7, "gloo:broadcast"), ("control", 3, "gloo:all_gather")
    )
    behind = _dump(("default_pg", 6, "gloo:all_reduce"), ("control", 3, "gloo:all_gather"))
    for rank, data in ((0, ahead), (1, behind), (2, ahead)):
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(data)
    dumps = hangs.read_dumps(tmp_path)
    assert sorted(dumps) == [0, 1, 2]
    assert hangs.verdict(dumps, world=3) == (
        [1],
        "never entered gloo:broadcast #7 in default_pg, where ranks 0, 2 waited; its flight recorder ends before it (rank 1 at #6)",
    )
    # a rank that left no dump is behind too; the other groups are read when the default one agrees
    assert hangs.verdict({0: dumps[0], 2: dumps[2]}, world=3) == (
        [1],
        "never entered gloo:broadcast #7 in default_pg, where ranks 0, 2 waited; rank 1 left no dump",
    )
    sub = hangs.read_dumps(tmp_path)
    sub[1] = hangs.read(tmp_path / "nccl_trace_rank_0")
    sub[2]["entries"].append(
        {"process_group": ("1", "control"), "collective_seq_id": 4, "profiling_name": "gloo:barrier"}
    )
    assert hangs.verdict(sub, world=3) == (
        [0, 1],
        "never entered gloo:barrier #4 in control, where rank 2 waited; its flight recorder ends before it (rank 0 at #3, rank 1 at #3)",
    )
    # every rank at the same collective: the dumps cannot tell
    assert hangs.verdict({0: dumps[0], 1: dumps[2]}, world=2) is None


def test_a_rank_that_reached_the_collective_only_after_the_others_gave_up_is_the_culprit():
    """Rank 0 was stuck outside any collective (committing a checkpoint) while rank 1 waited in the checkpoint
    group's barrier; it got there after rank 1 had timed out (its record's time), and ended on the lost peer."""

    def at(created: float) -> dict:
        d = pickle.loads(_dump(("default_pg", 9, "gloo:all_reduce"), ("checkpoint", 5, "gloo:barrier")))
        d["entries"][-1]["time_created_ns"] = int(created * 1e9)
        return d

    timed_out = 1_800_000_010.0  # when rank 1 wrote its HANG record
    dumps = {0: at(timed_out + 4.0), 1: at(timed_out - 10.0)}
    assert hangs.verdict(dumps, world=2, gave_up=timed_out) == (
        [0],
        "was late to gloo:barrier #5 in checkpoint, where rank 1 waited; it entered it only after a rank had timed "
        "out there",
    )
    # groups made without a description are told apart by their names (their numbers are their own)
    two = {r: pickle.loads(_dump(("default_pg", 9, "gloo:all_reduce"))) for r in (0, 1)}
    for r, (seq_a, seq_b) in {0: (7, 40), 1: (8, 40)}.items():
        two[r]["entries"] += [
            {"process_group": ("5", "undefined"), "collective_seq_id": seq_a, "profiling_name": "gloo:barrier"},
            {"process_group": ("6", "undefined"), "collective_seq_id": seq_b, "profiling_name": "gloo:all_gather"},
        ]
    assert hangs.verdict(two, world=2) == (
        [0],
        "never entered gloo:barrier #8 in group 5, where rank 1 waited; its flight recorder ends before it (rank 0 at #7)",
    )
    # late, but there before anyone gave up (or within the clocks' slack): no culprit; nor when every rank came
    # after (they cannot all be)
    assert hangs.verdict({0: at(timed_out - 1.0), 1: at(timed_out - 10.0)}, world=2, gave_up=timed_out) is None
    assert hangs.verdict({0: at(timed_out + 0.5), 1: at(timed_out - 10.0)}, world=2, gave_up=timed_out) is None
    assert hangs.verdict({0: at(timed_out + 3.0), 1: at(timed_out + 4.0)}, world=2, gave_up=timed_out) is None


def test_a_dump_that_names_a_class_is_not_loaded(tmp_path):
    """A dump is a file on shared storage: reading one runs no code it names (pickle's classes refused)."""
    evil = tmp_path / "nccl_trace_rank_0"
    evil.write_bytes(pickle.dumps({"entries": [], "x": Path("/etc/passwd")}))
    (tmp_path / "nccl_trace_rank_1").write_bytes(b"flight recorder dump (injected)")
    assert hangs.read(evil) is None
    assert hangs.read_dumps(tmp_path) == {}


def test_logs_diagnose_reads_a_directory_of_records_no_recorded_job_ran_in(run_cli, tmp_path):
    """A SkyPilot run's records copied from its checkpoint storage (its nodes gone): `dtlaunch logs DIR
    --diagnose` reads them; a name that is neither a recorded job nor a directory is still an error."""
    kept = tmp_path / "kept"
    (kept / "status").mkdir(parents=True)
    (kept / "metrics.jsonl").write_text('{"step": 6, "loss": 2.5, "time": 1700000000}\n')
    rec = {"rank": 1, "code": 44, "step": 7, "attempt": "0", "time": 1700000001, "node": "vm-2", "message": "GPU lost"}
    (kept / "status" / "rank-00001.json").write_text(json.dumps(rec))
    code, text, err = run_cli("logs", str(kept), "--diagnose")
    assert code == 0, err
    assert "PREFLIGHT (44) on rank 1 (vm-2) at step 7: GPU lost" in text, text
    assert "the node(s) to exclude: vm-2" in text, text
    code, text, err = run_cli("logs", str(tmp_path / "nowhere"), "--diagnose")
    assert code != 0 and "no job named" in err and "Traceback" not in err, (code, text, err)


def test_a_culprit_that_left_no_record_is_placed_by_its_nodes_check_before_training():
    """Two nodes, a rank each: rank 1 hung and its node's task was killed, so neither it nor a neighbour on its
    node left a record with the node's name. Each node's check before training recorded its place in the job
    (node_rank, which its torchrun's ranks follow), so rank 1 is on the node whose place is 1."""
    from launcher.cli.diagnose import hang_culprits
    from launcher.runtime.status import TIMED_OUT

    mine = [
        {
            "rank": 0,
            "code": 43,
            "message": f"{TIMED_OUT} during step 4",
            "step": 4,
            "node": "gpu-a",
            "world_size": 2,
            "local_world_size": 1,
            "time": 1_800_000_000.0,
        }
    ]
    checks = [{"node": "gpu-b", "code": 0, "node_rank": 1}, {"node": "gpu-a", "code": 0, "node_rank": 0}]
    assert hang_culprits(mine, {}, checks)[:2] == ([1], ["gpu-b"])
    assert hang_culprits(mine, {})[:2] == ([1], [])  # without the checks there is no telling where it ran
