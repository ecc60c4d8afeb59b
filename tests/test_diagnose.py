"""Issue 35, `dtlaunch logs NAME --diagnose`: a run's ending in a few lines, from the records its ranks left. A
real local job (torchrun, 2 gloo ranks) whose rank 1 stops at step 2: rank 0 times out in the step's collective
and reports HANG; rank 1 is ended by its no-progress watchdog without a record of its own (torchrun reports its
exit), and the diagnosis names it as the likely culprit, on its node."""

from __future__ import annotations

import socket

import pytest

from launcher.cli.diagnose import diagnose
from testpaths import RECIPES


@pytest.mark.slow
def test_a_hang_names_the_rank_that_never_reached_the_collective(run_cli, tmp_path):
    run = tmp_path / "run"
    sets = (
        "training.steps=4",
        "training.timeout_seconds=8",
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
    assert f"likely culprit: rank 1 on {host}: no record of its own in this attempt" in text, text


def test_a_directory_without_records_says_so(tmp_path):
    assert diagnose(tmp_path) == [
        f"{tmp_path}: no run records (status/, metrics.jsonl) yet: the job has not started training"
    ]
