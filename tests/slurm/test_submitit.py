"""`targets.slurm.submit: submitit`: rendering (pure), the decisions (pure), and jobs on the real local SLURM.

Nothing is stubbed on the cluster: `launcher.submit` (or `dtlaunch up`) renders, submitit writes its batch
script and runs sbatch, the batch step execs submitit's python from the environment the recipe's setup
line activates, and that python runs the rendered step.sh on node1 and node2 under srun (torchrun, the
real runtime, one CPU rank per node). The submitting process has a PATH without the test venv, as on a
login node: only `targets.slurm.setup` makes torch, submitit and dtlaunch importable in the job.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import submitit

import launcher
from launcher.errors import DtlaunchError
from launcher.jobenv import ExitCode
from launcher.runtime.checkpoint.disk import complete_steps
from launcher.runtime.metrics import read_metrics
from launcher.targets.registry import Registry
from launcher.targets.slurm import submitit_job
from launcher.targets.slurm.request import SubmititSpec
from launcher.targets.slurm_decisions import Outcome, decide
from slurmkit import (
    REPO,
    release_after_requeue,
    render_to,
    result,
    sacct_rows,
    sh,
    shared_dir,
    squeue_state,
    wait_for,
)

TINY = REPO / "recipes" / "tiny.yaml"
VENV_ACTIVATE = str(Path(sys.executable).parent / "activate")
BARE_PATH = "/usr/local/bin:/usr/bin:/bin"  # a login shell with no environment activated
STEPS, EVERY = 12, 4
SUBMITIT = "targets.slurm.submit=submitit"


def cluster_overrides(partition: str, tmp: Path, *extra: str) -> list[str]:
    return [
        f"targets.slurm.partition={partition}",
        "resources.nodes=2",
        "resources.accelerator=cpu:1",
        f"training.steps={STEPS}",
        f"checkpoint.every={EVERY}",
        f"checkpoint.dir={shared_dir(tmp)}/ckpt/{{run_id}}",
        "training.deterministic=true",
        f'targets.slurm.setup=["source {VENV_ACTIVATE}"]',
        "targets.slurm.max_requeues=2",
        *extra,
    ]


class Run:
    """What one submitted job left behind: the run dir, the ledgers under jobs/ID, submitit's log."""

    def __init__(self, job: submitit.Job, out: Path):
        self.job, self.out, self.id = job, out, str(job.job_id)
        self.run = out / "runs" / self.id
        self.jobdir = out / "jobs" / self.id

    def metrics(self) -> list[dict]:
        return read_metrics(self.run) if (self.run / "metrics.jsonl").exists() else []

    def steps(self) -> list[int]:
        return [r["step"] for r in self.metrics() if "event" not in r and "loss" in r]

    def events(self, name: str) -> list[dict]:
        return [r for r in self.metrics() if r.get("event") == name]

    def max_step(self) -> int:
        return max(self.steps(), default=0)

    def ledger(self, name: str) -> list[str]:
        p = self.jobdir / name
        return p.read_text().splitlines() if p.exists() else []

    def log(self) -> str:
        p = self.job.paths.stdout
        return p.read_text(errors="replace") if p.exists() else "(no log)"

    def state(self) -> str:
        """For a timeout's message: the queue's view of the job and the tail of its log."""
        return f"squeue: {squeue_state(self.id)!r}\nlog tail:\n{self.log()[-3000:]}"

    def sacct(self) -> list[list[str]]:
        """Once accounting has recorded the end (sacct_rows)."""
        return sacct_rows(self.id)


@pytest.fixture
def login_shell(monkeypatch):
    """The submitting process as on a login node: no venv on PATH, no leftovers from other tests."""
    monkeypatch.setenv("PATH", BARE_PATH)
    for name in ("VIRTUAL_ENV", "DTLAUNCH_FAULT", "DTLAUNCH_RUN_ID", "DTLAUNCH_PYTHON"):
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------- rendering (pure)


def test_render_ships_the_same_step_a_preamble_and_the_request(tmp_path):
    _, sb = render_to(tmp_path / "sbatch", "tiny", ["resources.nodes=2", "targets.slurm.partition=debug"])
    _, art = render_to(tmp_path / "sub", "tiny", ["resources.nodes=2", "targets.slurm.partition=debug", SUBMITIT])
    assert set(art.files) == {"plan.json", "recipe.yaml", "step.sh", "submitit_setup.sh", "submitit.json"}
    assert art.files["step.sh"] == sb.files["step.sh"]  # every node runs the same torchrun step either way
    for f in ("submitit_setup.sh", "step.sh"):
        p = subprocess.run(["bash", "-n", str(tmp_path / "sub" / f)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        p = subprocess.run(
            ["shellcheck", "-S", "warning", "-s", "bash", str(tmp_path / "sub" / f)], capture_output=True, text=True
        )
        assert p.returncode == 0, p.stdout
    req = art.request
    assert req.submit == "submitit" and req.submitit is not None
    assert SubmititSpec.from_json(art.files["submitit.json"]) == req.submitit  # `up` submits what render wrote
    assert art.submit_command == ["python3", "-m", "launcher.targets.slurm.submitit_job", "."]
    spec = req.submitit
    assert spec.python == 'exec "$PYTHON"' and spec.setup_script == "submitit_setup.sh"
    p = spec.parameters
    assert (p["nodes"], p["ntasks_per_node"], p["cpus_per_task"], p["time"]) == (2, 1, 2, 24 * 60)
    assert p["use_srun"] is False and p["partition"] == "debug" and p["exclusive"] is True and p["mem"] == "0"
    assert p["additional_parameters"] == {"signal": "B:USR2@120", "requeue": True}
    # The srun line is job.sbatch's, word for word.
    srun = " ".join(f'"{w}"' if "$" in w else w for w in spec.step["srun"])
    assert srun in sb.files["job.sbatch"]
    # A run longer than its time limit continues while it makes progress: submitit's cap is out of the way.
    assert spec.max_num_timeout == 40 + 5 + 1  # tiny's 40 steps + max_requeues + 1


def test_the_preamble_is_job_sbatchs_batch_part_from_one_template(tmp_path):
    """Environment, secrets, setup lines, interpreter check and rendezvous: the same shell in both files."""
    over = [
        "resources.nodes=2",
        'targets.slurm.setup=["module load cuda", "source /opt/venv/bin/activate"]',
        "secrets=[HF_TOKEN]",
        "env.FOO=bar",
    ]
    _, sb = render_to(tmp_path / "a", "tiny", over)
    _, art = render_to(tmp_path / "b", "tiny", over + [SUBMITIT])
    job, pre = sb.files["job.sbatch"], art.files["submitit_setup.sh"]
    start = job.index("# ---- identity.")
    shared = job[start : job.index("# ---- signals.")]
    assert shared in pre and len(shared.splitlines()) > 50
    for line in (
        "module load cuda",
        "source /opt/venv/bin/activate",
        '[ -n "${HF_TOKEN+x}" ]',
        "export FOO=bar",
        '"$PYTHON" -m launcher.runtime.elastic --check-environment',
        "MASTER_PORT=$(( 10000 + ",
    ):
        assert line in pre
    assert pre.index("source /opt/venv/bin/activate") < pre.index("--check-environment") < pre.index("import submitit")
    assert 'SUBMIT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"' in pre
    assert pre.rstrip().endswith(
        "export SUBMIT_DIR JOB_DIR ATTEMPT\nexport -f fail exclude_bad_nodes bad_nodes_after dtl_outcome"
    )
    # the bad-node policy: job.sbatch runs it in its batch shell, submitit's python in a child bash (exported)
    a = job.index("# ---- bad nodes:")
    policy = job[a : job.index("\n}\n", job.index("bad_nodes_after() {")) + 3]
    assert policy in pre and "scontrol requeue" in policy and "launcher.cli.diagnose" in policy


def test_hostile_values_stay_data_or_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_TOKEN", "s3cr3t-value-42")
    comment = "a b \"c\" #d $(touch /tmp/pwned) 'e'"
    r, art = render_to(
        tmp_path,
        "tiny",
        [
            SUBMITIT,
            "name=x; touch /tmp/pwned",
            "env.EVIL=$(touch /tmp/pwned-env) `x` ' \" ; rm -rf /",
            "secrets=[MY_TOKEN]",
            f"targets.slurm.extra_sbatch=[{json.dumps('--comment=' + comment)}]",
        ],
    )
    pre = art.files["submitit_setup.sh"]
    assert "export EVIL='$(touch /tmp/pwned-env) `x` '\"'\"' \" ; rm -rf /'" in pre
    params = art.request.submitit.parameters
    assert params["job_name"] == r.job_name and r.job_name.startswith("x-touch-tmp-pwned-")
    assert params["additional_parameters"]["comment"] == comment
    for rel in art.files:
        assert "s3cr3t-value-42" not in (tmp_path / rel).read_text(), rel
    # submitit writes #SBATCH values through shlex.quote: a line break would start a shell command there,
    # and sbatch reads a backslash as an escape even in single quotes.
    for bad, what in (
        ("--comment=x\ntouch /tmp/pwned #", "single line"),
        ("--comment=a\\b", "backslash"),
        ("-w node1", "long options"),
    ):
        with pytest.raises(DtlaunchError, match=what):
            render_to(tmp_path / "bad", "tiny", [SUBMITIT, f"targets.slurm.extra_sbatch=[{json.dumps(bad)}]"])


def test_submitits_batch_script_execs_the_nodes_python(tmp_path):
    """The file submitit will hand to sbatch (built here, not submitted): the setup sources the preamble,
    then `exec` makes the batch process submitit's python, the one --signal=B:USR2@N reaches."""
    _, art = render_to(tmp_path, "tiny", [SUBMITIT, "resources.nodes=2", "targets.slurm.signal_seconds=300"])
    spec = art.request.submitit
    ex = submitit_job.OneTaskSlurmExecutor(
        tmp_path / spec.folder, max_num_timeout=spec.max_num_timeout, python=spec.python
    )
    ex.update_parameters(**spec.parameters, setup=[f"source {tmp_path}/submitit_setup.sh"])
    text = ex._make_submission_file_text(ex._submitit_command_str, "uid")
    assert ex._num_tasks() == 1  # job.result() works for a 2-node job
    assert f"source {tmp_path}/submitit_setup.sh\n" in text
    assert f'exec "$PYTHON" -u -m submitit.core._submit {tmp_path}/submitit' in text
    for line in (
        "#SBATCH --signal=B:USR2@300",
        "#SBATCH --requeue",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={tmp_path}/submitit/%j_0_log.out",
    ):
        assert line + "\n" in text
    assert "srun" not in text.split("# command", 1)[1]  # submitit's own srun is off; the step's srun is ours
    assert "--error" not in text  # one log, stdout and stderr together


def test_sweeps_stay_with_sbatch():
    from launcher.plan import make_plan
    from launcher.recipe import load
    from launcher.targets.slurm.sbatch import render_slurm_array

    items = [load(TINY, [SUBMITIT, f"training.seed={s}"]) for s in (1, 2)]
    with pytest.raises(DtlaunchError, match="submit=sbatch"):
        render_slurm_array([(r, make_plan(r)) for r in items])


def test_importing_launcher_and_finding_submit_imports_neither_submitit_nor_torch():
    code = "import sys, launcher\nf = launcher.submit\nprint([m for m in ('submitit', 'torch') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_submit_takes_a_loaded_recipe_and_always_means_submitit():
    """launcher.submit(Recipe) re-reads the recipe with the overrides, as prepare() does for `up`; the API always
    submits with submitit (its override comes last)."""
    from launcher.api import SUBMITIT
    from launcher.prepare import load_recipe
    from launcher.recipe import load

    r = load_recipe(load(TINY, ["targets.slurm.submit=sbatch"]), ["training.steps=7", SUBMITIT])
    assert (r.targets.slurm.submit, r.training.steps) == ("submitit", 7)
    assert load_recipe(TINY, [SUBMITIT]).targets.slurm.submit == "submitit"


def test_registry_rows_from_before_submitit_still_decode():
    from launcher.targets.registry import _decode

    h = _decode("slurm", json.dumps({"submit_dir": "/x", "job_name": "tiny", "array": False, "ssh": None}))
    assert (h.submit, h.submitit_folder) == ("sbatch", None)


# ----------------------------------------------------------------------------- the decisions (pure)


@pytest.mark.parametrize(
    "outcome,counts,want",
    [
        (Outcome(0), (0, 0), ("done", "COMPLETED", None)),
        (Outcome(42, "TERM"), (0, 0), ("stop", "STOPPED", None)),  # a cancel: never requeued
        (Outcome(1, "TERM"), (0, 0), ("stop", "STOPPED", None)),
        (Outcome(42, "USR2", time_limit=True, progress=True), (5, 0), ("requeue", "REQUEUED", "continuations")),
        (Outcome(42, "USR2", time_limit=True, progress=False), (0, 0), ("fail", "FAILED", None)),
        (Outcome(42, "USR2"), (1, 0), ("requeue", "REQUEUED", "requeues")),
        (Outcome(42, "USR2"), (2, 0), ("fail", "PREEMPTED", None)),  # max_requeues=2 used up
        (Outcome(42), (0, 0), ("requeue", "REQUEUED", "requeues")),  # the steps were signalled, not this process
        (Outcome(1, "USR2"), (0, 0), ("requeue", "REQUEUED", "requeues")),  # as job.sbatch: USR2 means preemption
        (Outcome(43), (0, 1), ("requeue", "REQUEUED", "failures")),  # failure 2 of at most 3
        (Outcome(43), (0, 2), ("fail", "FAILED", "failures")),  # the third failure is the last
        (Outcome(ExitCode.CONFIG), (0, 0), ("fail", "FAILED", "failures")),  # never retried
        (Outcome(ExitCode.DIVERGED), (0, 0), ("fail", "FAILED", "failures")),  # never retried either
    ],
)
def test_decisions_are_job_sbatchs(outcome, counts, want):
    d = decide(outcome, requeues=counts[0], failures=counts[1], max_requeues=2, max_failures=3)
    assert (d.action, d.state, d.ledger) == want
    assert d.code == outcome.rc


# ----------------------------------------------------------------------------- on the cluster

slow = pytest.mark.slow


@slow
def test_two_nodes_complete_and_the_result_is_the_runs_summary(tmp_path, partition, login_shell, run_cli):
    t0 = time.time()
    job = launcher.submit(TINY, target_dir=tmp_path / "out", overrides=cluster_overrides(partition, tmp_path))
    assert isinstance(job, submitit.Job) and job.num_tasks == 1
    summary = result(job)
    took = time.time() - t0
    r = Run(job, tmp_path / "out")
    assert summary["state"] == "COMPLETED" and summary["exit_code"] == 0, r.log()
    assert (summary["attempts"], summary["step"], summary["run_dir"]) == (1, STEPS, str(r.run))
    (start,) = r.events("start")
    (pre,) = r.events("preflight")
    assert start["world_size"] == 2 and pre["ok"] and pre["hosts"] == 2, pre  # one rank on node1, one on node2
    assert r.steps() == list(range(1, STEPS + 1))
    assert complete_steps(Path(summary["checkpoint_dir"]))[-1] == STEPS
    assert (r.run / "model.safetensors").is_file()
    assert r.ledger("exit_codes") == ["0 0 none"] and r.ledger("state") == ["COMPLETED"]
    assert (r.jobdir / "finished").exists()
    # job.result() returns as the batch process ends; slurmctld records the end in accounting a moment later
    accounted = wait_for(
        lambda: (
            (rows := [row[1:] for row in r.sacct() if row[0] in (r.id, f"{r.id}.batch")])
            and all(x[0] != "RUNNING" for x in rows)
            and rows
        ),
        30,
        "sacct to record the end",
    )
    assert accounted == [["COMPLETED", "0:0"]] * 2
    # the batch step ran the interpreter the setup line activated, not the submitting machine's PATH
    assert f"check ok: dtlaunch {launcher.__version__}" in r.log()
    # dtlaunch follows it like any SLURM job
    code, out, _ = run_cli("status", r.id, "--json")
    (row,) = json.loads(out)
    assert code == 0 and (row["state"], row["exit_code"], row["job_state"]) == ("COMPLETED", 0, "COMPLETED"), row
    code, out, _ = run_cli("logs", r.id)
    assert code == 0 and f"done: {STEPS} steps" in out
    print(f"\n2-node submitit job {r.id}: submit -> job.result() {took:.1f}s")


@slow
def test_usr2_checkpoints_requeues_through_submitit_and_resumes(tmp_path, partition, login_shell):
    """What the time limit does (--signal=B:USR2@N to the batch process), without waiting for one."""
    t0 = time.time()
    job = launcher.submit(TINY, target_dir=tmp_path / "out", overrides=cluster_overrides(partition, tmp_path))
    r = Run(job, tmp_path / "out")
    wait_for(lambda: r.max_step() >= 3, 180, "step 3", explain=r.state)
    sh("scancel", "--batch", "--signal=USR2", r.id)
    wait_for(lambda: r.ledger("requeues"), 90, "submitit to requeue the job", explain=r.state)
    requeued_at = time.time()
    assert r.ledger("exit_codes") == ["0 42 USR2"], r.log()
    (pre,) = r.events("preempt")
    saved = pre["step"]
    assert pre["signal"] == "SIGUSR2" and 3 <= saved < STEPS, pre
    assert saved in complete_steps(shared_dir(tmp_path) / "ckpt" / r.id)
    release_after_requeue(r.id, requeued_at)
    summary = result(job)
    took = time.time() - t0
    assert (summary["attempts"], summary["requeues"], summary["continuations"], summary["step"]) == (2, 1, 0, STEPS)
    (resumed,) = r.events("resume")
    assert resumed["step"] == saved and resumed["world_size"] == 2
    assert r.steps() == list(range(1, STEPS + 1))  # nothing lost, nothing redone
    assert r.ledger("exit_codes") == ["0 42 USR2", "1 0 none"]
    assert [a.split()[0] for a in r.ledger("attempts")] == ["0", "1"]
    # the job script's record of each exit, as job.sbatch writes it; two allocations, the queue between them
    assert [(e["code"], e["time"] < resumed["time"]) for e in r.events("exited")] == [(42, True), (0, False)]
    first, second = (e["allocation_start"] for e in r.events("start"))
    assert first < requeued_at < second, (first, requeued_at, second)
    log = r.log()
    assert "Calling checkpoint method" in log and f"Requeued job {r.id}" in log  # submitit's own requeue
    assert log.count("asking the training processes to checkpoint") == 1  # USR2 forwarded once
    print(
        f"\nUSR2 -> checkpoint at step {saved} -> submitit requeue -> resume -> done: {took:.1f}s "
        "(incl. >= 3 s before the requeue hold is released)"
    )


@slow
def test_a_hangs_culprit_node_is_left_out_through_submitit_too(tmp_path, partition, login_shell, monkeypatch):
    """tests/slurm/test_bad_nodes.py's hang, submitted through submitit: rank 1 (of 2, on node1) stops at step 4,
    rank 0's collective times out (43). submitit's python runs job.sbatch's bad-node policy (exported by
    submitit_setup.sh): node1 named from the flight-recorder dumps, the job requeued with ExcNodeList=node1, and
    the run resumes from its step-3 checkpoint on node2 and finishes. node2 is held by another job until node1
    is excluded, so that the first allocation is node1."""
    blocker = sh(
        "sbatch", "--parsable", "-p", partition, "-w", "node2", "-o", "/dev/null", "--wrap", "sleep 300"
    ).stdout.strip()
    monkeypatch.setenv("DTLAUNCH_FAULT", "hang:rank=1:step=4:node=node1")  # the job inherits it (--export=ALL)
    sets = cluster_overrides(
        partition,
        tmp_path,
        "resources.nodes=1",
        "resources.accelerator=cpu:2",
        "training.steps=6",
        "checkpoint.every=3",
        "training.timeout_seconds=10",
        "targets.slurm.max_restarts=0",
    )
    try:
        job = launcher.submit(TINY, target_dir=tmp_path / "out", overrides=sets)
        r = Run(job, tmp_path / "out")
        wait_for(lambda: r.ledger("excluded"), 180, "node1's exclusion", explain=r.state)
        requeued_at = time.time()
    finally:
        sh("scancel", blocker, check=False)
    assert r.ledger("excluded")[0].split()[2:] == ["node1", "hang"] and r.ledger("exit_codes") == ["0 43 none"]
    wait_for(
        lambda: "ExcNodeList=node1" in sh("scontrol", "show", "job", "-o", r.id, check=False).stdout,
        30,
        "ExcNodeList=node1",
        explain=r.state,
    )
    release_after_requeue(r.id, requeued_at)
    summary = result(job)
    assert summary["step"] == 6 and [a.split()[2] for a in r.ledger("attempts")] == ["node1", "node2"], summary
    assert [e["step"] for e in r.events("resume")] == [3]
    assert r.ledger("failures") == []  # left out, not counted as a failure (as job.sbatch)
    assert "dtlaunch: the hang's likely culprit ran on node1" in r.log()


@slow
def test_cancel_of_a_running_job_ends_it_for_good(tmp_path, partition, login_shell):
    t0 = time.time()
    job = launcher.submit(
        TINY, target_dir=tmp_path / "out", overrides=cluster_overrides(partition, tmp_path, "training.steps=2000")
    )
    r = Run(job, tmp_path / "out")
    wait_for(lambda: r.max_step() >= 3, 180, "step 3", explain=r.state)
    t_cancel = time.time()
    job.cancel()
    with pytest.raises(submitit.core.utils.UncompletedJobError):
        result(job)
    took = time.time() - t_cancel
    assert r.sacct()[0][1].startswith("CANCELLED"), r.sacct()
    time.sleep(3)  # a requeued job would be back in squeue by now (held, PENDING)
    assert squeue_state(r.id) == "" and not job.paths.result_pickle.exists()
    assert r.ledger("requeues") == r.ledger("continuations") == r.ledger("failures") == []
    assert len(r.ledger("attempts")) == 1
    # SIGTERM from SLURM: the workers checkpoint and nothing requeues. The local cluster's KillWait is 5 s,
    # so on a loaded machine the batch step can be killed before it writes its last ledger line.
    assert r.ledger("exit_codes") in ([], ["0 42 TERM"]), r.log()
    for pre in r.events("preempt"):
        assert pre["signal"] == "SIGTERM" and pre["step"] in complete_steps(shared_dir(tmp_path) / "ckpt" / r.id)
    print(f"\njob.cancel() -> result() raised UncompletedJobError after {took:.1f}s (job ran {t_cancel - t0:.1f}s)")


@slow
def test_a_failure_raises_from_result_with_the_ranks_codes(tmp_path, partition, login_shell, run_cli, monkeypatch):
    """Through `dtlaunch up`: rank 1 exits 43 at step 3 (no torchrun restarts, no retries). Its peer then
    fails to communicate (exit 1), which the contract reports as the job's code; rank 1's 43 is named."""
    monkeypatch.setenv("DTLAUNCH_FAULT", "exit:rank=1:step=3:code=43")  # the job inherits it (--export=ALL)
    sets = cluster_overrides(
        partition, tmp_path, SUBMITIT, "targets.slurm.max_restarts=0", "targets.slurm.max_failures=0"
    )
    t0 = time.time()
    code, out, err = run_cli(
        "up", TINY, "-t", "slurm", "-o", tmp_path / "out", *[a for s in sets for a in ("--set", s)]
    )
    assert code == 0, err
    rec = Registry().find("tiny")
    assert rec.handle.submit == "submitit" and rec.handle.submitit_folder == str(tmp_path / "out" / "submitit")
    job = submitit_job.job(rec.handle.submitit_folder, rec.job_id)
    with pytest.raises(submitit.core.utils.FailedJobError) as e:
        result(job)
    took = time.time() - t0
    r = Run(job, tmp_path / "out")
    msg = str(e.value)
    assert "TrainingFailed: exit 1 (FAILED): training failed with exit code 1" in msg, msg
    assert "rank 1: exit 43 (HANG)" in msg and "rank 0: exit 1 (FAILED) at step 3" in msg, msg
    assert [row[1:] for row in r.sacct() if row[0] == f"{r.id}.batch"] == [["FAILED", "1:0"]]
    assert r.ledger("state") == ["FAILED"] and len(r.ledger("failures")) == 1 and r.ledger("requeues") == []
    code, out, _ = run_cli("status", "tiny")
    assert code == 0 and "FAILED exit=1" in out, out
    print(f"\nrank 1 exits 43 at step 3 -> job.result() raised after {took:.1f}s")


@slow
def test_preempted_without_requeues_left_exits_42(tmp_path, partition, login_shell, monkeypatch):
    """The workers stop on a signal of their own (no USR2 reached the batch process), max_requeues=0: the
    job fails with the contract's 42, in job.result() and as the batch step's exit code in sacct."""
    monkeypatch.setenv("DTLAUNCH_FAULT", "signal:rank=0:step=3:sig=USR2")
    t0 = time.time()
    job = launcher.submit(
        TINY,
        target_dir=tmp_path / "out",
        overrides=cluster_overrides(
            partition, tmp_path, "targets.slurm.max_requeues=0", "targets.slurm.max_restarts=0"
        ),
    )  # no torchrun restart
    with pytest.raises(
        submitit.core.utils.FailedJobError,
        match=r"exit 42 \(PREEMPTED\): preempted, but "
        r"max_requeues=0 is used up",
    ):
        result(job)
    took = time.time() - t0
    r = Run(job, tmp_path / "out")
    rows = {row[0]: row[1:] for row in r.sacct()}
    assert rows[f"{r.id}.batch"] == ["FAILED", "42:0"] and rows[r.id] == ["FAILED", "42:0"], rows
    assert r.ledger("exit_codes") == ["0 42 none"] and r.ledger("state") == ["PREEMPTED"]
    (pre,) = r.events("preempt")
    assert pre["step"] in complete_steps(shared_dir(tmp_path) / "ckpt" / r.id)
    print(f"\npreempted with max_requeues=0 -> exit 42 in sacct after {took:.1f}s")


@slow
def test_without_setup_the_job_fails_once_and_result_says_what_to_do(tmp_path, partition, login_shell):
    """No setup line: the batch step finds the system python, which cannot run the plan. The preamble ends
    the job with exit 2 before submitit starts (no retries), and job.result() shows the log's advice."""
    over = [o for o in cluster_overrides(partition, tmp_path) if not o.startswith("targets.slurm.setup")]
    job = launcher.submit(TINY, target_dir=tmp_path / "out", overrides=over)
    with pytest.raises(submitit.core.utils.UncompletedJobError, match="cannot run this plan") as e:
        result(job)
    assert "targets.slurm.setup" in str(e.value)
    r = Run(job, tmp_path / "out")
    assert [row[1:] for row in r.sacct() if row[0] == r.id] == [["FAILED", "2:0"]]
    assert r.ledger("state") == ["FAILED"] and len(r.ledger("attempts")) == 1
    assert r.ledger("failures") == [] and r.ledger("requeues") == []  # not a failure to retry


@slow
def test_sbatch_reads_submitits_quoting_as_data(tmp_path, partition, login_shell):
    """A hostile value reaches SLURM intact through submitit's #SBATCH lines (the job is held, never run)."""
    marker = Path(f"/tmp/pwned-submitit-{uuid.uuid4().hex[:8]}")
    comment = f"a b \"c\" #d $(touch {marker}) 'e'"
    job = launcher.submit(
        TINY,
        target_dir=tmp_path / "out",
        overrides=cluster_overrides(
            partition, tmp_path, f"targets.slurm.extra_sbatch={json.dumps(['--comment=' + comment, '--hold'])}"
        ),
    )
    try:
        info = sh("scontrol", "show", "job", str(job.job_id)).stdout
        assert f"Comment={comment}" in info, info
    finally:
        job.cancel(check=False)
    assert not marker.exists()


@pytest.fixture(autouse=True)
def _no_leftover_jobs(request):
    """A failed cluster test must not leave a job holding the two nodes for the next one."""
    yield
    if "slurm" in request.fixturenames:
        for jid in sh("squeue", "-h", "-o", "%i", check=False).stdout.split():
            sh("scancel", jid, check=False)
