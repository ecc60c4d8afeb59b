"""One outcome policy (launcher/jobenv.py OUTCOMES) on every submit path: the sbatch job script's rendered
decision function and the submitit job's Python decisions agree on every exit code, signal and count; the
SkyPilot task recovers only on the policy's resume codes and ends a final code's later launches at once; the
README's exit-code table says what the policy says."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher import jobenv
from launcher.jobenv import ExitCode, outcome
from launcher.plan import make_plan
from launcher.recipe import load
from launcher.render import render
from launcher.targets.slurm_decisions import Outcome, decide
from testpaths import RECIPES

CODES = [0, 1, 2, 42, 43, 44, 45, 46, 137, 143]
MAX_REQUEUES, MAX_FAILURES = 2, 3


def rendered(target: str, *sets: str):
    rec = load(RECIPES / "tiny.yaml", list(sets))
    return render(rec, make_plan(rec), target)


def test_the_policy_covers_every_exit_code():
    assert set(jobenv.OUTCOMES) == set(ExitCode)
    assert jobenv.FINAL_CODES == (ExitCode.CONFIG, ExitCode.DIVERGED, ExitCode.STORAGE)
    assert jobenv.RESUME_CODES == (ExitCode.PREEMPTED,)
    assert outcome(137) == outcome(1) == "retry"  # a signal's 128+N, torchrun's own 1


def test_sbatch_and_submitit_decide_alike_on_every_code_signal_and_count():
    """The rendered job.sbatch's dtl_decide (bash, run here) and slurm_decisions.decide (Python, the submitit
    path) over every combination: the same action, state and ledger. A diverged run (45) was retried by the
    submitit path and not by the sbatch path."""
    job = rendered(
        "slurm", f"targets.slurm.max_requeues={MAX_REQUEUES}", f"targets.slurm.max_failures={MAX_FAILURES}"
    ).files["job.sbatch"]
    fn = job[job.index("# >>> dtl_decide") : job.index("# <<< dtl_decide")]
    combos = list(itertools.product(CODES, ("none", "USR2", "TERM"), (0, 1), (0, 1), (0, 1, 2), (0, 1, 2)))
    calls = "\n".join(f"dtl_decide {' '.join(map(str, c))}" for c in combos)
    p = subprocess.run(["bash", "-c", fn + "\n" + calls], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == len(combos)
    for (rc, sig, tl, prog, req, fails), line in zip(combos, lines, strict=True):
        action, state, ledger, _ = line.split(" ", 3)
        d = decide(
            Outcome(rc, None if sig == "none" else sig, bool(tl), bool(prog)),
            requeues=req,
            failures=fails,
            max_requeues=MAX_REQUEUES,
            max_failures=MAX_FAILURES,
        )
        assert (action, state, ledger) == (d.action, d.state, d.ledger or "-"), (rc, sig, tl, prog, req, fails, line)
    for code in jobenv.FINAL_CODES:  # never retried, whatever the counts
        assert decide(Outcome(code), requeues=0, failures=0, max_requeues=9, max_failures=9).action == "fail"


def test_the_time_limit_slack_is_the_policys():
    job = rendered("slurm").files["job.sbatch"]
    rec = load(RECIPES / "tiny.yaml")
    assert f"-le {rec.targets.slurm.signal_seconds + jobenv.TIME_LIMIT_SLACK_S} ]" in job


def _node_env(task: dict, tmp_path: Path, py: Path, task_id: str) -> dict:
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "DTLAUNCH_PYTHON": str(py),
        **{k: str(v) for k, v in task["envs"].items()},
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NODE_IPS": "127.0.0.1",
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NUM_GPUS_PER_NODE": "0",
        "SKYPILOT_TASK_ID": task_id,
    }


@pytest.mark.parametrize("final", [ExitCode.CONFIG, ExitCode.DIVERGED])
def test_skypilot_ends_a_final_codes_later_launches_at_once(tmp_path, final):
    """A managed job recovers on any code outside recover_on_exit_codes while max_restarts_on_errors lasts: 16 x 8
    GPUs relaunched three times for a bad recipe or a diverged loss. The run marks a final code in checkpoint
    storage; the next launch of the same task reads it first and exits with it without starting Python; a new
    task (a new submission) clears it and trains."""
    ckpt = tmp_path / "bucket"
    art = rendered("sky", f"checkpoint.dir={ckpt}/{{run_id}}", "targets.sky.managed=true")
    task = yaml.safe_load(art.files["task.yaml"])
    assert task["resources"]["job_recovery"]["recover_on_exit_codes"] == list(jobenv.RESUME_CODES)
    out = art.write(tmp_path / "job")
    log = tmp_path / "calls"
    py = tmp_path / "py"
    status = f'"${jobenv.STATUS}"'
    env_check = f'case " $* " in *" --check-environment "*) exit 0 ;; esac\nmkdir -p {status}\n'
    if final == ExitCode.CONFIG:  # torchrun's agent checks the node and refuses the plan, recording it as it does
        record = f"{status}/{jobenv.CHECK_RECORD_PREFIX}node1.code"
        launch = env_check + f'echo "{int(ExitCode.CONFIG)} 0 0 own node1" > {record}\nexit {int(ExitCode.CONFIG)}'
    else:  # the ranks stop on a diverged loss, each writing its code where dtl_outcome reads it
        launch = env_check + f'echo "45 9 0" > {status}/rank-00000.code\nexit 1'
    assert "--check-plan=" in task["run"]  # the agent's check, which the CONFIG case stands in for
    py.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\necho "$*" >> {log}\n{launch}\n')
    py.chmod(0o755)

    def launch_task(task_id: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", task["run"]],
            cwd=out,
            env=_node_env(task, tmp_path, py, task_id),
            capture_output=True,
            text=True,
            timeout=60,
        )

    first = launch_task("task-1")
    assert first.returncode == final, first.stdout + first.stderr
    if final == ExitCode.CONFIG:  # the script read the agent's record and says what it means
        assert "the pre-start check failed: its message above says what" in first.stderr, first.stderr
    marker = ckpt / "task-1" / jobenv.FINAL_MARKER
    assert marker.read_text().split() == [str(int(final)), "task-1"]
    calls = log.read_text()
    again = launch_task("task-1")  # SkyPilot's recovery of the same task
    assert again.returncode == final and "never retried" in again.stderr
    assert log.read_text() == calls  # nothing started: no check, no launcher
    # a new submission under the same run id (the recipe names it) starts afresh
    art2 = rendered("sky", f"checkpoint.dir={ckpt}/{{run_id}}", "run_id=task-1")
    task = yaml.safe_load(art2.files["task.yaml"])
    py.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\necho "$*" >> {log}\nexit 0\n')
    fresh = launch_task("task-2")
    assert fresh.returncode == 0 and not marker.exists(), fresh.stdout + fresh.stderr


def test_the_readme_table_says_what_the_policy_does():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = text[text.index("<!-- exit codes:") :]
    rows = re.findall(r"^\| (\d+) \| (\w+) \| (.*?) \| (.*?) \|$", table, flags=re.M)[: len(ExitCode)]
    assert [int(r[0]) for r in rows] == [int(c) for c in ExitCode]
    for code, _, _, then in rows:
        kind = outcome(int(code))
        assert ("never retried" in then) == (kind == "final"), (code, then)
        assert ("recover_on_exit_codes" in then) == (kind == "resume"), (code, then)
        if kind == "retry":
            assert "max_failures" in then or "like a crash" in then or "as a failure" in then, (code, then)


def test_progress_counts_checkpoints_committed_by_ranks_that_left_no_exit_record(tmp_path):
    """A time limit with progress continues the run in a new allocation; without, it fails. Ranks SIGKILLed at the
    limit write no exit record, so progress is also read from the checkpoints: a step committed since the attempt
    started (job.sbatch's newest_checkpoint, the submitit path's JobFiles, and launcher/runtime/checkpoint/disk.py see the
    same directory alike: committed, not corrupt, not partial)."""
    from launcher.runtime.checkpoint import disk
    from launcher.targets.slurm_decisions import JobFiles

    job = rendered("slurm").files["job.sbatch"]
    fns = job[job.index("newest_checkpoint() {") : job.index('CHECKPOINT_AT_START="$(newest_checkpoint)"')]
    fns += job[job.index("progress() {") : job.index("requeue() {")]
    root = tmp_path / "ckpt"
    for step in (4, 12, 16):
        disk.step_path(root, step).mkdir(parents=True)
        disk.commit(root, step, {"step": step})
    disk.mark_corrupt(disk.step_path(root, 16), "a bad shard")
    disk.step_path(root, 20).mkdir()  # written, never committed
    status = tmp_path / "status"
    status.mkdir()

    def bash(script: str, start: int) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "DTLAUNCH_CHECKPOINT_DIR": str(root),
            "DTLAUNCH_STATUS": str(status),
            "CHECKPOINT_AT_START": str(start),
        }
        return subprocess.run(["bash", "-c", fns + script], env=env, capture_output=True, text=True, timeout=30)

    assert bash("newest_checkpoint", 0).stdout.strip() == str(disk.newest_step(root)) == "12"
    assert bash("progress", 4).returncode == 0 and bash("progress", 12).returncode != 0
    files = JobFiles.__new__(JobFiles)
    files.checkpoint_dir, files.status = str(root), status
    assert files.progress(4) and not files.progress(12)
    (status / "rank-00000.code").write_text("42 14 12\n")  # a rank's own record says it moved on
    assert bash("progress", 12).returncode == 0 and files.progress(12)


def test_the_sky_extra_requires_a_skypilot_that_takes_recover_on_exit_codes():
    """Every managed task names recover_on_exit_codes; SkyPilot 0.11.1's schema refuses the key (it came in 0.11.2),
    so the extra must not allow an older SkyPilot (tests/sky/test_oldest_skypilot.py parses the tasks there)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    (req,) = [Requirement(r) for r in re.findall(r'^sky = \["([^"]+)"\]', text, flags=re.M)]
    assert not req.specifier.contains(Version("0.11.1")) and req.specifier.contains(Version("0.11.2"))
    art = rendered("sky", "targets.sky.managed=true")
    assert "recover_on_exit_codes" in art.files["task.yaml"]


@pytest.mark.parametrize(
    "checks, ranks, rc, expect",
    [
        ({"node1": ExitCode.PREFLIGHT}, {}, 143, ExitCode.PREFLIGHT),  # srun's highest code hid the bad node's
        ({"node1": ExitCode.STORAGE}, {}, 143, ExitCode.STORAGE),
        ({}, {}, 143, 143),
        ({"node1": ExitCode.PREFLIGHT}, {}, 0, 0),  # the job went on without it (another attempt's record)
        # rank 1 hung on node2: rank 0 timed out (43) and ended node1's task; srun killed node2's (137)
        ({}, {0: f"{ExitCode.HANG} 12 0 own node1"}, 137, ExitCode.HANG),
        # a node's task killed from outside (the OOM killer) while its peer only lost the connection: a failure
        ({}, {0: f"{ExitCode.FAILED} 12 0 peer node1"}, 137, ExitCode.FAILED),
    ],
)
def test_sbatch_and_submitit_take_the_attempts_records_over_sruns_code_alike(
    tmp_path, monkeypatch, checks, ranks, rc, expect
):
    """After srun, what the attempt's records say (a node's failed check, the ranks' own codes) is the attempt's
    code, not that of a task srun ended itself: the 143 of tasks it terminated after a failed check, the 137 of
    a hung rank's node it killed after the others' hang. job.sbatch's lines and the submitit path's attempt_code
    (the same dtl_outcome, which submitit_setup.sh exports to it) agree."""
    from launcher.runtime.status import write_check_record

    job = rendered("slurm").files["job.sbatch"]
    setup = rendered("slurm", "targets.slurm.submit=submitit").files["submitit_setup.sh"]
    at = job.index("dtl_outcome() {")
    defn = job[at : job.index("\n}\n", at) + 3]
    assert defn in setup and re.search(r"^export -f .*\bdtl_outcome\b", setup, flags=re.M)
    block = job[job.index('if [ "$rc" -ne 0 ] && [ -z "${SIGNALLED:-}" ]; then') : job.index('echo "$ATTEMPT $rc')]
    status = tmp_path / "status"
    monkeypatch.setenv("DTLAUNCH_STATUS", str(status))
    for node, code in checks.items():
        write_check_record(tmp_path, node, code, "failed")
    status.mkdir(exist_ok=True)
    for rank, line in ranks.items():
        (status / f"rank-{rank:05d}.code").write_text(line + "\n")
    env = dict(os.environ)
    p = subprocess.run(["bash", "-c", f"{defn}rc={rc}\n{block}echo $rc"], env=env, capture_output=True, text=True)
    call = f"from launcher.targets.slurm.submitit_job import attempt_code; print(attempt_code({rc}))"
    q = subprocess.run(
        ["bash", "-c", f'{defn}export -f dtl_outcome\nexec "$0" -c {call!r}', sys.executable],
        env=env,
        capture_output=True,
        text=True,
    )
    assert int(p.stdout.strip()) == int(q.stdout.strip()) == expect, p.stderr + q.stderr
