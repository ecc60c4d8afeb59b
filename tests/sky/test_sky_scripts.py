"""The rendered SkyPilot `run` script, executed with bash and the variables SkyPilot sets, against a recording
interpreter: what each node would start, and that recipe strings stay data. (Real training on simulated VMs
is in test_sky_train.py; here the interpreter is a stub that records its arguments, so these are fast.)

The head-only DeepSpeed launch is checked with DeepSpeed's own runner code (PDSHRunner, the code that
turns .deepspeed_env into the pdsh command line and the remote shell): secret values never reach it, and
recipe values reach the remote shell only as the data they are.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sky_helpers import RECIPES, render_to

TINY = next(p for p in RECIPES if p.name == "tiny.yaml")
TASK_ID = "sky-2026-11-21-10-00-00-123456_tiny_7"
BUCKET = "targets.sky.checkpoint_storage={bucket: 's3://b/ckpt'}"


def recording_python(tmp_path: Path) -> Path:
    """An interpreter stand-in: the checks (`--check`, `--check-environment`) pass, a launch records its argv
    (one call per line) and exits 0; `-c` and the head-only DeepSpeed launch's value check (launcher.pdsh) run
    for real."""
    stub = tmp_path / "py"
    stub.write_text(f"""#!/bin/sh
if [ "$1" = -c ] || [ "$2" = launcher.pdsh ]; then exec {sys.executable} "$@"; fi
case " $* " in *" --check "*|*" --check-environment "*) exit 0 ;; esac
printf '%s\\0' "$@" >> {tmp_path}/argv.$SKYPILOT_NODE_RANK
echo >> {tmp_path}/argv.$SKYPILOT_NODE_RANK
""")
    stub.chmod(0o755)
    return stub


def run_nodes(tmp_path: Path, out: Path, nodes: int, ips=("10.0.0.5", "10.0.0.6"), extra=None) -> list[int]:
    task = yaml.safe_load((out / "task.yaml").read_text())
    py = recording_python(tmp_path)
    rcs = []
    for rank in range(nodes):
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(tmp_path / f"home{rank}"),
            "DTLAUNCH_PYTHON": str(py),
            **{k: str(v) for k, v in task["envs"].items()},
            "SKYPILOT_NODE_RANK": str(rank),
            "SKYPILOT_NODE_IPS": "\n".join(ips[:nodes]),
            "SKYPILOT_NUM_NODES": str(nodes),
            "SKYPILOT_NUM_GPUS_PER_NODE": "0",
            "SKYPILOT_TASK_ID": TASK_ID,
            **(extra or {}),
        }
        (tmp_path / f"home{rank}").mkdir(exist_ok=True)
        rcs.append(
            subprocess.run(
                ["bash", "-c", task["run"]], cwd=out, env=env, capture_output=True, text=True, timeout=60
            ).returncode
        )
    return rcs


def calls(tmp_path: Path, rank: int) -> list[list[str]]:
    p = tmp_path / f"argv.{rank}"
    return [c.split("\0") for c in p.read_text().split("\0\n") if c] if p.exists() else []


def test_each_node_starts_torchrun_against_the_head(tmp_path):
    _, _, out = render_to(tmp_path, TINY, ["resources.nodes=2", "targets.sky.max_restarts=5", BUCKET])
    assert run_nodes(tmp_path, out, 2) == [0, 0]
    for rank in (0, 1):
        (argv,) = calls(tmp_path, rank)
        assert argv[:2] == ["-m", "launcher.runtime.elastic"]
        assert "--nnodes=2" in argv and "--nproc-per-node=2" in argv  # cpu:2 -> the plan's count, not SkyPilot's 0
        assert "--rdzv-endpoint=10.0.0.5:29500" in argv and f"--rdzv-id={TASK_ID}" in argv
        # The head hosts the rendezvous store whatever its hostname resolves to (torch guesses by hostname).
        assert f"--rdzv-conf=join_timeout=120,is_host={1 if rank == 0 else 0}" in argv
        assert "--max-restarts=5" in argv and "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2" in argv
        assert argv[argv.index("--plan") + 1] == str(out / "plan.json")
        assert argv[argv.index("--run-dir") + 1] == str(out / "runs" / TASK_ID)
        assert "--node-rank" not in argv


def test_missing_head_address_fails_fast(tmp_path):
    _, _, out = render_to(tmp_path, TINY)
    assert run_nodes(tmp_path, out, 1, ips=("",)) == [44]
    assert not calls(tmp_path, 0)


EVIL_NAME = "x; touch {m}"
EVIL_ENV = "$(touch {m})`touch {m}`"


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_shell_metacharacters_in_recipe_values_are_never_executed(tmp_path, launcher):
    marker = tmp_path / "pwned"
    text = TINY.read_text().replace("name: tiny", f"name: {EVIL_NAME.format(m=marker)!r}")
    text += f"env:\n  EVIL: {EVIL_ENV.format(m=marker)!r}\n"
    ov = ["resources.nodes=2", BUCKET] + (
        ["parallelism.strategy=zero2", "parallelism.launcher=deepspeed"] if launcher == "deepspeed" else []
    )
    _, art, out = render_to(tmp_path, None, ov, text=text)
    assert run_nodes(tmp_path, out, 2, ips=("127.0.0.1", "127.0.0.2")) == [0, 0]
    assert not marker.exists(), "a recipe value was executed by the shell"
    assert not set(art.job_name) & set(" ;$()`/"), art.job_name
    if launcher == "deepspeed":  # every node launches its own workers (no ssh): node_rank 0 and 1
        ranks = [next(a for a in calls(tmp_path, r)[0] if a.startswith("--node_rank")) for r in (0, 1)]
        assert ranks == ["--node_rank=0", "--node_rank=1"]
        for r in (0, 1):
            (argv,) = calls(tmp_path, r)
            assert argv[:3] == ["-m", "deepspeed.launcher.runner", "--no_ssh"]
            assert argv[argv.index("--module") + 1] == "launcher.runtime.train" and "--no_local_rank" in argv


def _pdsh_command(out: Path, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """What DeepSpeed 0.19's PDSHRunner does with the rendered files: its own code, run here."""
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import parse_args

    env_lines = (out / ".deepspeed_env").read_text().splitlines()
    args = parse_args(
        [
            "--hostfile",
            str(tmp_path / "hf"),
            "--module",
            "launcher.runtime.train",
            "--no_local_rank",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            "29500",
            "x",
        ]
    )
    runner = PDSHRunner(args, world_info_base64="e30=")
    for line in env_lines:  # runner.py: key, val = var.split('=', maxsplit=1); runner.add_export(key, val)
        key, val = line.split("=", 1)
        runner.add_export(key.strip(), val.strip())
    (tmp_path / "hf").write_text("127.0.0.1 slots=1\n")
    cmd, _kill, env = runner.get_cmd(dict(os.environ), {"127.0.0.1": [0]})
    return cmd, env


def test_head_only_deepspeed_launch_never_leaks_or_runs_recipe_values(tmp_path, monkeypatch):
    """Recipe env values reach the remote shell as data (validate refuses the characters DeepSpeed would run),
    and secret values never reach .deepspeed_env, pdsh's command line or the log."""
    marker = tmp_path / "pwned"
    monkeypatch.setenv("MY_SECRET", "SECRET_VALUE_123")
    ov = [
        "resources.nodes=2",
        BUCKET,
        "parallelism.strategy=zero2",
        "parallelism.launcher=deepspeed",
        "targets.sky.deepspeed_ssh=true",
        "env={PLAIN: 'a b c', TOKENIZERS_PARALLELISM: 'false'}",
    ]
    rec, art, out = render_to(tmp_path, TINY, ov)
    assert run_nodes(tmp_path, out, 2, ips=("127.0.0.1", "127.0.0.2")) == [0, 0]
    assert calls(tmp_path, 0) and not calls(tmp_path, 1)  # the head starts node 1's workers over ssh
    (head,) = calls(tmp_path, 0)
    assert "--no_ssh" not in head and "--log_level=warning" in head
    cmd, _ = _pdsh_command(out, tmp_path)
    remote = " ".join(cmd)  # pdsh runs this on every worker through a shell
    exports = next(c for c in cmd if c.startswith("export "))
    # The remote shell reads every exported value back exactly as the recipe gave it, and runs nothing.
    got = subprocess.run(
        ["bash", "-c", exports + 'printf "%s|%s" "$PLAIN" "$DTLAUNCH_RUN_ID"'], capture_output=True, text=True
    )
    assert got.stdout == f"a b c|{TASK_ID}" and not marker.exists()
    for f in out.rglob("*"):
        if f.is_file():
            assert b"SECRET_VALUE_123" not in f.read_bytes()
    assert "SECRET_VALUE_123" not in remote

    # What the head-only path would have to refuse, validate refuses before anything is rendered.
    from launcher.plan import make_plan
    from launcher.recipe import load
    from launcher.validate import validate

    for extra, rule in (
        (["env={EVIL: '$(touch /tmp/x)'}"], "deepspeed-ssh-env"),
        (["secrets=[MY_SECRET]"], "deepspeed-ssh-secrets"),
    ):
        r = load(TINY, ov + extra)
        assert rule in {f.rule for f in validate(r, make_plan(r), "sky") if f.severity == "error"}, rule
    assert shlex.split(" ".join(head))  # the recorded launch is plain words


@pytest.mark.parametrize(
    "ips,launch_rc,want", [(("10.0.0.5",), 42, 42), (("",), 0, 44)], ids=["preempted", "fail-before-launch"]
)
def test_the_run_inside_skypilots_wrapper_waits_for_the_upload_and_keeps_its_code(tmp_path, ips, launch_rc, want):
    """SkyPilot runs `run` as a script of its own making: sky.backends.task_codegen's build_task_bash_script
    appends, after it, the wait until rclone has uploaded everything written to MOUNT_CACHED storage (the
    checkpoints), then exits with the run's code. The rendered run, wrapped by that very function, with an
    rclone log that reports the cache uploaded and a `findmnt` that shows an rclone mount (the bucket): the wait
    runs, after a preemption's checkpoint as after an early failure, and the run's code survives it. A
    top-level `exit` in the run skipped the wait, and a recovered job lost its last checkpoint."""
    from sky.backends.task_codegen import TaskCodeGen

    _, _, out = render_to(tmp_path, TINY, [BUCKET])
    task = yaml.safe_load((out / "task.yaml").read_text())
    script = TaskCodeGen.build_task_bash_script(task["run"])
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in (
        ("findmnt", "echo '/ckpt b: fuse.rclone rw'"),
        ("sleep", "exit 0"),
        (
            "py",
            f'if [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
            f'case " $* " in *" --check "*|*" --check-environment "*) exit 0 ;; esac\nexit {launch_rc}',
        ),
    ):
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    home = tmp_path / "home"
    (home / ".sky" / "rclone_log").mkdir(parents=True)
    (home / ".sky" / "rclone_log" / "ckpt.log").write_text(
        "2026/11/25 10:00:00 INFO  : vfs cache: cleaned: objects 3 (was 3) in use 0, to upload 0, uploading 0\n"
    )
    env = {
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "HOME": str(home),
        "DTLAUNCH_PYTHON": str(stubs / "py"),
        **{k: str(v) for k, v in task["envs"].items()},
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NODE_IPS": "\n".join(ips),
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NUM_GPUS_PER_NODE": "0",
        "SKYPILOT_TASK_ID": TASK_ID,
    }
    p = subprocess.run(["bash", "-c", script], cwd=out, env=env, capture_output=True, text=True, timeout=60)
    assert "skypilot: cached mount upload complete" in p.stdout, p.stdout + p.stderr
    assert p.returncode == want, p.stdout + p.stderr
