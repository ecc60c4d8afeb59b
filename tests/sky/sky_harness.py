"""Plays SkyPilot's part on this machine, so a rendered task.yaml's `setup` and `run` really execute.

Only the cloud is mocked: there are no VMs, no rsync and no ssh. Each "node" is a bash process on this
machine, started in the task's workdir with the environment SkyPilot gives a node: the task's `envs`,
SKYPILOT_NODE_RANK (0 = head), SKYPILOT_NODE_IPS (newline-separated, head first), SKYPILOT_NUM_NODES,
SKYPILOT_NUM_GPUS_PER_NODE (0 on CPU instances) and SKYPILOT_TASK_ID (stable across managed-job
recoveries). As on SkyPilot, `setup` runs on every node before `run`. Both nodes share this machine's
disk, which stands in for a shared checkpoint directory.

`pip` and `sudo` are replaced by stubs on PATH that record their arguments: installing from PyPI or
apt is the one part of `setup` that needs the network and a VM of its own (the real dtlaunch is already
installed in this venv); every other line of `setup` runs for real.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

VENV_BIN = str(Path(sys.executable).parent)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid`, from /proc (children first found, then theirs)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def load_task(task_dir: Path) -> dict:
    return yaml.safe_load((Path(task_dir) / "task.yaml").read_text())


def gpus_per_node(task: dict) -> int:
    acc = (task.get("resources") or {}).get("accelerators")
    return int(str(acc).split(":")[1]) if acc and ":" in str(acc) else 0


def stub_bin(root: Path, names=("pip", "sudo")) -> Path:
    """Executables that append their argv (one line) to root/<name>.log and succeed."""
    b = root / "stub-bin"
    b.mkdir(parents=True, exist_ok=True)
    for n in names:
        p = b / n
        p.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> {str(root / (n + ".log"))!r}\n')
        p.chmod(0o755)
    return b


@dataclass
class Cluster:
    """A cluster of `nodes` processes on this machine sharing one workdir and one fake $HOME."""

    task_dir: Path
    nodes: int = 2
    ips: tuple = ("127.0.0.1", "127.0.0.1")
    task_id: str = "sky-2026-11-21-00-00-00-000000_tiny_1"
    stubs: tuple = ("pip", "sudo")

    def __post_init__(self):
        self.task_dir = Path(self.task_dir)
        self.task = load_task(self.task_dir)
        self.root = self.task_dir.parent / (self.task_dir.name + "-harness")
        self.home = self.root / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.bin = stub_bin(self.root, self.stubs)
        for dst, src in (self.task.get("file_mounts") or {}).items():  # SkyPilot copies these; we link them
            target = self.home / dst[2:] if dst.startswith("~/") else Path(dst)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to((self.task_dir / src).resolve())
        wd = self.task.get("workdir", ".")
        self.workdir = (self.task_dir / wd).resolve()

    def env(self, rank: int, extra: dict | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SKYPILOT_", "DTLAUNCH_"))}
        env.update({k: str(v) for k, v in (self.task.get("envs") or {}).items()})
        env.update({
            "HOME": str(self.home),
            "PATH": f"{self.bin}:{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
            "SKYPILOT_NODE_RANK": str(rank),
            "SKYPILOT_NODE_IPS": "\n".join(self.ips[: self.nodes]),
            "SKYPILOT_NUM_NODES": str(self.nodes),
            "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus_per_node(self.task)),
            "SKYPILOT_TASK_ID": self.task_id,
        })
        env.update(extra or {})
        return env

    def _script(self, stage: str) -> Path:
        p = self.root / f"{stage}.sh"
        p.write_text(self.task[stage])
        return p

    def setup(self, extra: dict | None = None, timeout: float = 60) -> list[subprocess.CompletedProcess]:
        script = self._script("setup")
        return [subprocess.run(["bash", str(script)], cwd=self.workdir, env=self.env(r, extra), capture_output=True,
                               text=True, timeout=timeout) for r in range(self.nodes)]

    def start(self, extra: dict | None = None, per_node: dict | None = None) -> list[subprocess.Popen]:
        """Start `run` on every node, each in its own process group (so one node can be killed alone)."""
        script = self._script("run")
        self.launches = getattr(self, "launches", 0) + 1  # a relaunch (recovery) gets fresh logs
        procs = []
        for r in range(self.nodes):
            env = self.env(r, {**(extra or {}), **((per_node or {}).get(r, {}))})
            log = open(self.root / f"node{r}.{self.launches}.log", "ab")
            procs.append(subprocess.Popen(["bash", str(script)], cwd=self.workdir, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
            log.close()
        return procs

    def wait(self, procs: list[subprocess.Popen], timeout: float) -> list[int]:
        deadline = time.time() + timeout
        try:
            return [p.wait(timeout=max(1.0, deadline - time.time())) for p in procs]
        finally:
            self.kill(procs)

    @staticmethod
    def kill(procs: list[subprocess.Popen], sig=signal.SIGKILL) -> None:
        """Kill each node's whole process tree, like a lost VM. Its process group is not enough:
        torchrun starts each worker in a session of its own, and killing the agent alone left an
        orphaned worker that kept training."""
        for p in procs:
            for pid in [p.pid, *descendants(p.pid)]:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            p.wait()

    def log(self, rank: int, launch: int | None = None) -> str:
        """Output of node `rank` in launch number `launch` (default: the latest)."""
        p = self.root / f"node{rank}.{launch or getattr(self, 'launches', 1)}.log"
        return p.read_text(errors="replace") if p.exists() else ""
