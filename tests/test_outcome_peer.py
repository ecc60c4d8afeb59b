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


def outcome(
    tmp_path: Path,
    records: list[tuple[int, str]],
    rc: int = 1,
    dumps: tuple[int, ...] = (),
    lost_peer: tuple[int, ...] = (),
) -> int:
    status = tmp_path / "attempt"
    for rank, (code, message) in enumerate(records):
        write_status(tmp_path, rank, code, message, step=2, start_step=0)
    for rank in dumps:  # a flight-recorder dump, as NCCL's watchdog or a hung gloo rank leaves it
        (status / f"nccl_trace_rank_{rank}").write_bytes(b"dump")
    for rank in lost_peer:  # the one a gloo rank writes as a lost peer ends it (evidence for the diagnosis only)
        (status / f"lost_peer_trace_rank_{rank}").write_bytes(b"dump")
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
    code, message = classify(exc, 2)
    assert code == ExitCode.FAILED and message.startswith(PEER_LOST), message


@pytest.mark.parametrize("step, start, progressed", [(5, 2, True), (2, 2, False)])
def test_the_slurm_scripts_progress_reads_the_runtimes_code_files(tmp_path, monkeypatch, step, start, progressed):
    """The sbatch script's progress() (did the attempt move the run forward?) on code files as the runtime writes
    them, four fields since the cause was added: a rank past its start step is progress even before a newer
    checkpoint is committed. Reading three fields once took the start step with the cause ("2 own") and never saw
    progress there."""
    import re

    from launcher.plan import make_plan
    from launcher.recipe import load
    from launcher.targets.slurm.sbatch import job_script
    from testpaths import RECIPES

    recipe = load(RECIPES / "tiny.yaml")
    script = job_script(recipe, make_plan(recipe))
    progress = re.search(r"^progress\(\) \{.*?^\}$", script, re.S | re.M)
    assert progress, "the job script has no progress()"
    monkeypatch.setenv("DTLAUNCH_STATUS", str(tmp_path / "attempt"))
    write_status(tmp_path, 0, ExitCode.FAILED, "training failed during step 5: ValueError: boom", step, start)
    body = "newest_checkpoint() { echo 0; }\nCHECKPOINT_AT_START=0\n" + progress.group(0) + "\nprogress\n"
    rc = subprocess.run(
        ["bash", "-c", body], env={"DTLAUNCH_STATUS": str(tmp_path / "attempt"), "PATH": "/usr/bin:/bin"}
    ).returncode
    assert (rc == 0) == progressed


@pytest.mark.parametrize(
    "records, dumps, expect",
    [
        ([PEER], (1,), ExitCode.HANG),  # rank 1 was killed by NCCL's watchdog (a dump, no record): a hang
        ([HANG, CRASH], (0,), ExitCode.FAILED),  # the hung rank's dump does not hide rank 1's own error
        ([PREEMPTED, PREEMPTED], (0,), ExitCode.HANG),
    ],
)
def test_a_flight_recorder_dump_is_a_hang_unless_a_rank_failed_on_its_own(
    tmp_path, monkeypatch, records, dumps, expect
):
    monkeypatch.setenv("DTLAUNCH_STATUS", str(tmp_path / "attempt"))
    assert outcome(tmp_path, records, dumps=dumps) == expect


def test_the_dump_of_a_rank_that_lost_a_peer_is_no_hang(tmp_path, monkeypatch):
    """A crashed rank's peers end on the closed connection and write their rings for the diagnosis: the job's
    outcome is still the crash's (retried as one), not a hang whose culprit would be excluded."""
    monkeypatch.setenv("DTLAUNCH_STATUS", str(tmp_path / "attempt"))
    assert outcome(tmp_path, [PEER, PEER], lost_peer=(0, 1)) == ExitCode.FAILED


@pytest.mark.parametrize("code", [ExitCode.PREFLIGHT, ExitCode.CONFIG, ExitCode.STORAGE])
def test_a_nodes_failed_check_is_the_outcome_of_every_node_whose_task_srun_terminated(tmp_path, monkeypatch, code):
    """A node's check before training fails (no rank starts anywhere); srun ends the other nodes' tasks (their
    torchrun agents waited in the rendezvous: 143). Each of those reads the check's record on the shared status
    and ends with its code, so that srun's exit code (its tasks' highest) is the check's, not 143."""
    from launcher.runtime.status import write_check_record

    monkeypatch.setenv("DTLAUNCH_STATUS", str(tmp_path / "attempt"))
    write_check_record(tmp_path, "node1", code, "CUDA error: uncorrectable ECC error encountered")
    assert outcome(tmp_path, [], rc=143) == code
    write_check_record(tmp_path, "node2", ExitCode.OK, "dtlaunch 0.1.0, ...")  # a passed check changes nothing
    assert outcome(tmp_path, [], rc=143) == code
    assert not (tmp_path / "attempt" / "check-node2.code").exists()
