"""The job scripts' dtl_outcome (launcher/render/templates/_outcome.sh.j2), run in bash on rank records as the
runtime writes them: a rank that failed only because a peer's connection closed ("peer") does not hide another
rank's hang. Found by `dtlaunch rehearse` on 8 gloo ranks: the ranks that time out first exit and close the
connections the rest wait on, and one of those used to turn the job's 43 into a 1 (retried as a crash)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from launcher.jobenv import ExitCode
from launcher.render.templates import render_template
from launcher.runtime.status import PEER_LOST, classify, write_status


def outcome(tmp_path: Path, records: list[tuple[int, str]], rc: int = 1) -> int:
    status = tmp_path / "attempt"
    for rank, (code, message) in enumerate(records):
        write_status(tmp_path, rank, code, message, step=2, start_step=0)
    script = render_template("_outcome.sh.j2") + '\ndtl_outcome "$1"\n'
    out = subprocess.run(
        ["bash", "-c", script, "outcome", str(rc)],
        env={"DTLAUNCH_STATUS": str(status), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


HANG = (ExitCode.HANG, "a collective timed out during step 2")
PEER = (ExitCode.FAILED, f"{PEER_LOST} during step 2: Connection closed by peer")
CRASH = (ExitCode.FAILED, "training failed during step 2: ValueError: boom")
PREEMPTED = (ExitCode.PREEMPTED, "preempted at step 2")


@pytest.mark.parametrize(
    "records, expect",
    [
        ([HANG, PEER, HANG], ExitCode.HANG),  # the hang explains the lost connection
        ([PEER, PEER], ExitCode.FAILED),  # a peer vanished without a record of its own: a crash
        ([HANG, CRASH], ExitCode.FAILED),  # a rank's own error comes first: the others timed out waiting for it
        ([PREEMPTED, PEER], ExitCode.FAILED),  # a lost peer during a preemption: the checkpoint may be partial
        ([PREEMPTED, PREEMPTED], ExitCode.PREEMPTED),
    ],
)
def test_a_rank_that_only_lost_a_peer_does_not_hide_a_hang(tmp_path, monkeypatch, records, expect):
    monkeypatch.setenv("DTLAUNCH_STATUS", str(tmp_path / "attempt"))
    assert outcome(tmp_path, records) == expect


def test_gloos_closed_connection_is_classified_as_a_lost_peer():
    exc = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:3271"
    )
    code, message = classify(exc, 2, 15)
    assert code == ExitCode.FAILED and message.startswith(PEER_LOST), message
