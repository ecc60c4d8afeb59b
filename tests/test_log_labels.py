"""Every line of a job's ranks carries its node and rank, on every target: the launch script exports torchrun's line-prefix
template (rendered from jobenv.log_line_prefix), torchrun fills in each rank, and `dtlaunch logs --node/--rank`
reads it back with jobenv.LOG_LINE. The rendered export is run by bash and the result handed to torch's own
substitution, so the three are tested against each other."""

from __future__ import annotations

import re
import subprocess
from string import Template

import pytest
import yaml

from launcher.cli.jobs import of_ranks
from launcher.jobenv import LOG_LINE, log_line_prefix
from testpaths import RECIPES


@pytest.mark.parametrize("target, script", [("slurm", "step.sh"), ("local", "launch.sh"), ("sky", "task.yaml")])
def test_what_torchrun_writes_from_the_rendered_export_is_what_logs_reads(tmp_path, run_cli, target, script):
    code, out, err = run_cli("render", RECIPES / "tiny.yaml", "-t", target, "-o", tmp_path / "r")
    assert code == 0, out + err
    step = (tmp_path / "r" / script).read_text()
    if target == "sky":  # the task's run: section
        step = yaml.safe_load(step)["run"]
    (export,) = re.findall(r"^export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=.*$", step, re.M)
    template = subprocess.run(
        ["bash", "-c", f'NODE_NAME=gpu-a07; {export}; printf %s "$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # torch.distributed.elastic's LocalElasticAgent substitutes the template this way for each worker
    line = Template(template).safe_substitute(role_name="default", rank=13, local_rank=5) + "step 3/10 | loss 2.1"
    assert line.startswith(log_line_prefix("gpu-a07", 13))
    m = LOG_LINE.match(line)
    assert m and (m["node"], int(m["rank"])) == ("gpu-a07", 13)


def test_logs_keeps_the_lines_of_one_node_or_one_rank():
    lines = [
        "dtlaunch: training exited with 0\n",
        log_line_prefix("node1", 0) + "step 1\n",
        log_line_prefix("node1", 1) + "warning\n",
        log_line_prefix("node2", 2) + "step 1\n",
        log_line_prefix("node10", 3) + "step 1\n",
    ]
    assert list(of_ranks(lines, "node1", None)) == lines[1:3]
    assert list(of_ranks(lines, None, 2)) == [lines[3]]
    assert list(of_ranks(lines, "node1", 2)) == []
    assert list(of_ranks(lines, "node10", None)) == [lines[4]]


def test_logs_node_and_rank_through_the_cli(run_cli, tmp_path):
    import time

    from launcher.targets.local.request import LocalHandle
    from launcher.targets.registry import JobRecord, Registry

    d = tmp_path / "runs" / "x"
    d.mkdir(parents=True)
    log = d / "up.log"
    log.write_text(
        "dtlaunch: starting\n"
        + log_line_prefix("node1", 0)
        + "step 1\n"
        + log_line_prefix("node2", 1)
        + "WARNING: slow\n"
        + log_line_prefix("node2", 1)
        + "step 1\n"
    )
    (d / "exit").write_text("0")
    Registry().add(JobRecord("x", "local", "9", str(d), LocalHandle(1, time.time(), "x", str(log), str(d / "exit"))))
    code, out, err = run_cli("logs", "x", "--node", "node2", "--tail", "1")
    assert code == 0 and out == log_line_prefix("node2", 1) + "step 1\n", out + err
    code, out, err = run_cli("logs", "x", "--rank", "0")
    assert code == 0 and out == log_line_prefix("node1", 0) + "step 1\n", out + err
    code, out, err = run_cli("logs", "x", "--node", "node3")
    assert code == 0 and out == "" and "no line of node node3 in the job's log" in err, out + err


def test_a_slurm_jobs_log_read_in_one_piece_is_tailed_and_filtered_by_line(run_cli, tmp_path):
    """The SLURM backend reads its job's log as what was written since the last read, many lines in one piece:
    --tail and --node count and pick lines all the same (they printed the whole piece)."""
    from launcher.targets.registry import JobRecord, Registry
    from launcher.targets.slurm.request import SlurmHandle

    lines = ["dtlaunch: job 7 on node[1-2]\n"] + [
        log_line_prefix(f"node{1 + r}", r) + f"step {s}\n" for s in range(1, 4) for r in range(2)
    ]
    (tmp_path / "x-7.out").write_text("".join(lines) + "dtlaunch: COMPLETED")  # the last line not yet ended
    Registry().add(JobRecord("x", "slurm", "7", str(tmp_path), SlurmHandle(str(tmp_path), "x")))
    code, out, err = run_cli("logs", "x", "--tail", "2")
    assert code == 0 and out == lines[-1] + "dtlaunch: COMPLETED", out + err
    code, out, err = run_cli("logs", "x", "--node", "node2", "--tail", "2")
    assert code == 0 and out == "".join(lines[-3::2]), out + err
