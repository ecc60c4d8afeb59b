"""Self-tests of the SkyNodes harness (sky_nodes.py): each property a real SkyPilot VM has, shown with a
tiny hand-written task.yaml run on real simulated nodes (namespaces, chroot, a non-root user).

They do not use dtlaunch's renderer: the harness must be trustworthy on its own before it judges
rendered tasks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sky_nodes import SkyNodes, build_image, copy_tree, gpus_per_node, parse_file_mounts, save_torch_extensions

ROOT = Path(__file__).resolve().parents[2]
# Prints, as one JSON line, what a node tells about itself (no torch import: it costs ~1.5 s per node).
PROBE = (
    'python -c \'import getpass, json, os, socket; print("PROBE=" + json.dumps({"uid": os.getuid(), '
    '"user": getpass.getuser(), "cwd": os.getcwd(), "host": socket.gethostname(), "env": dict(os.environ)}))\''
)


def write_task(d: Path, task: str, files: dict[str, str] | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "task.yaml").write_text(textwrap.dedent(task))
    for name, text in (files or {}).items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    return d


def probe(output: str) -> dict:
    return json.loads(next(line for line in output.splitlines() if line.startswith("PROBE="))[len("PROBE=") :])


def ok(results) -> None:
    assert all(r.returncode == 0 for r in results), "\n".join(r.stdout[-2000:] for r in results)


def run(nodes: SkyNodes, timeout: float = 60, **kw) -> list[str]:
    """Start `run` on every node, expect success everywhere, return each node's output."""
    rcs = nodes.wait(nodes.start(**kw), timeout=timeout)
    logs = [nodes.log(r) for r in range(nodes.nodes)]
    assert rcs == [0] * nodes.nodes, "\n".join(log[-2000:] for log in logs)
    return logs


@pytest.fixture(scope="session")
def dtlaunch_wheel(tmp_path_factory) -> Path:
    """dtlaunch's wheel, built offline from a copy of the sources (a build in place would leave build/
    and *.egg-info in the work tree)."""
    src, out = tmp_path_factory.mktemp("wheel-src"), tmp_path_factory.mktemp("wheels")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    shutil.copytree(ROOT / "launcher", src / "launcher", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(src),
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
        env=env,
    )
    return next(out.glob("dtlaunch-*.whl"))


# ---------------------------------------------------------------- the node's user, environment and image


@pytest.mark.slow
def test_task_runs_as_non_root_user_with_only_skypilots_environment(tmp_path, sky_nodes, monkeypatch):
    for k, v in {
        "PYTHONPATH": str(ROOT),
        "DTLAUNCH_HOME": "/leak",
        "DTLAUNCH_PORT": "1",
        "SKYPILOT_NODE_RANK": "9",
    }.items():
        monkeypatch.setenv(k, v)  # none of the host's variables may reach a node
    task = write_task(
        tmp_path / "job",
        f"""
        num_nodes: 2
        workdir: .
        envs: {{MY_ENV: from-task}}
        secrets: {{MY_TOKEN: null}}
        setup: |
          {PROBE}
        run: |
          {PROBE}
        """,
    )
    nodes = sky_nodes(task, task_id="sky-managed-2026-01-01_job_7-0", secrets={"MY_TOKEN": "s3cr3t"})
    nodes.provision()
    setups = [probe(r.stdout) for r in nodes.setup()]
    runs = [probe(out) for out in run(nodes)]
    for rank, (s, r) in enumerate(zip(setups, runs, strict=True)):
        for p in (s, r):
            assert (p["uid"], p["user"], p["env"]["HOME"]) == (4242, "sky", "/home/sky")
            assert p["cwd"] == "/home/sky/sky_workdir" and p["host"] == f"node{rank}"
            assert p["env"]["MY_ENV"] == "from-task" and p["env"]["MY_TOKEN"] == "s3cr3t"
            assert p["env"]["SKYPILOT_TASK_ID"] == "sky-managed-2026-01-01_job_7-0"
            assert p["env"]["SKYPILOT_NUM_NODES"] == "2"
            assert not [k for k in p["env"] if k.startswith(("DTLAUNCH_", "PYTHON")) and k != "PYTHONUNBUFFERED"]
            assert "/root" not in p["env"]["PATH"] and "/work" not in p["env"]["PATH"]
            assert p["env"]["PATH"].startswith("/home/sky/sky-user-env/bin:")  # SkyPilot activates the user env
        # SkyPilot names setup's variables differently: a setup that reads SKYPILOT_NODE_RANK gets nothing.
        assert s["env"]["SKYPILOT_SETUP_NODE_RANK"] == str(rank) and "SKYPILOT_NODE_RANK" not in s["env"]
        assert r["env"]["SKYPILOT_NODE_RANK"] == str(rank) and "SKYPILOT_SETUP_NODE_RANK" not in r["env"]
        assert r["env"]["SKYPILOT_NODE_IPS"] == "127.0.0.1\n127.0.0.2"
        assert r["env"]["SKYPILOT_NUM_GPUS_PER_NODE"] == "0"


@pytest.mark.slow
def test_image_has_torch_not_dtlaunch_and_pip_installs_the_wheel_offline(tmp_path, sky_nodes, dtlaunch_wheel):
    task = write_task(
        tmp_path / "job",
        f"""
        file_mounts:
          ~/wheels: {dtlaunch_wheel.parent}
        setup: |
          python -c 'import torch; print("torch", torch.__version__)'
          python -c 'import launcher' || echo "NO-LAUNCHER"
          pip install dtlaunch || echo "NOT-ON-PYPI"
          pip install --no-index ~/wheels/{dtlaunch_wheel.name}[train]
        run: |
          python -c 'import launcher; print("LAUNCHER-AT", launcher.__file__)'
          dtlaunch --help > /dev/null && echo "CLI-OK"
        """,
    )
    nodes = sky_nodes(task)
    nodes.provision()
    [setup] = nodes.setup()
    ok([setup])
    assert "torch 2." in setup.stdout and "NO-LAUNCHER" in setup.stdout and "NOT-ON-PYPI" in setup.stdout
    # every dependency of dtlaunch[train] was already in the image: nothing but dtlaunch got installed
    assert "Successfully installed dtlaunch-0.1.0\n" in setup.stdout
    assert "Requirement already satisfied: torch" in setup.stdout
    [out] = run(nodes)
    assert "LAUNCHER-AT /home/sky/sky-user-env/lib/" in out and "CLI-OK" in out
    nodes.destroy()  # a fresh VM: what pip installed went with the old one's disk
    nodes.provision()
    assert "NO-LAUNCHER" in nodes.ssh(0, "~/sky-user-env/bin/python -c 'import launcher' || echo NO-LAUNCHER").stdout


@pytest.mark.slow
def test_node_sees_neither_the_repository_nor_host_tools(tmp_path, sky_nodes):
    task = write_task(
        tmp_path / "job",
        """
        run: |
          for p in /work /root/.pyenv/shims /usr/local/bin/issues /opt/dlimage/pkgs/launcher; do
            [ -e "$p" ] && echo "VISIBLE $p"
          done
          ls -A /opt/dlimage/pkgs/dtlaunch-*.dist-info | grep . && echo "VISIBLE dist-info"
          python -c 'import importlib.metadata as m; print("DIST", m.version("dtlaunch"))' 2>/dev/null
          echo done
        """,
    )
    nodes = sky_nodes(task)
    nodes.provision()
    [out] = run(nodes)
    assert "VISIBLE" not in out and "DIST" not in out and "done" in out


# ---------------------------------------------------------------- disks: node-local, buckets, root-only paths


@pytest.mark.slow
def test_node_local_files_are_invisible_to_other_nodes(tmp_path, sky_nodes):
    task = write_task(
        tmp_path / "job",
        """
        num_nodes: 2
        workdir: .
        setup: |
          if [ "$SKYPILOT_SETUP_NODE_RANK" = 0 ]; then
            for f in ~/sky_workdir/ckpt ~/ckpt /tmp/ckpt /dev/shm/ckpt; do echo step5 > $f; done
          fi
        run: |
          for f in ~/sky_workdir/ckpt ~/ckpt /tmp/ckpt /dev/shm/ckpt; do
            [ -e $f ] && echo "HAS $f" || echo "MISSING $f"
          done
        """,
    )
    nodes = sky_nodes(task)
    nodes.provision()
    ok(nodes.setup())
    head, worker = run(nodes)
    for f in ("~/sky_workdir/ckpt", "~/ckpt", "/tmp/ckpt", "/dev/shm/ckpt"):
        f = f.replace("~", "/home/sky")
        assert f"HAS {f}" in head and f"MISSING {f}" in worker
    assert not (task / "ckpt").exists()  # the workdir is a copy: nothing comes back to the launching machine
    assert nodes.node_path(0, "/tmp/ckpt").exists() and not nodes.node_path(1, "/tmp/ckpt").exists()


@pytest.mark.slow
def test_bucket_mount_is_shared_and_survives_destroy(tmp_path, sky_nodes):
    task = write_task(
        tmp_path / "job",
        """
        num_nodes: 2
        file_mounts:
          /checkpoints:
            source: s3://ckpt-bucket/run1
            mode: MOUNT_CACHED
          ~/logs:
            source: gs://log-bucket
            mode: MOUNT
        setup: |
          echo "from $SKYPILOT_SETUP_NODE_RANK" > /checkpoints/node-$SKYPILOT_SETUP_NODE_RANK
          echo "log" > ~/logs/setup-$SKYPILOT_SETUP_NODE_RANK
        run: |
          echo "SEES $(cd /checkpoints && ls | tr '\\n' ' ')"
        """,
    )
    first = sky_nodes(task)
    first.provision()
    ok(first.setup())
    assert all("SEES node-0 node-1 " in out for out in run(first))  # every node sees every node's file
    bucket = first.bucket("s3://ckpt-bucket/run1")
    assert sorted(os.listdir(bucket)) == ["node-0", "node-1"] and (bucket / "node-1").stat().st_uid == 4242
    assert sorted(os.listdir(first.bucket("gs://log-bucket"))) == ["setup-0", "setup-1"]
    first.destroy()
    assert not first.nodes_dir.exists() and (bucket / "node-0").read_text() == "from 0\n"

    second = sky_nodes(task, nodes=1)  # a recovery: new VMs, same bucket
    second.provision()
    assert "SEES node-0 node-1 " in run(second)[0]


@pytest.mark.slow
def test_two_node_sets_at_once_share_buckets_not_disks(tmp_path, sky_nodes):
    task = write_task(
        tmp_path / "job",
        """
        file_mounts:
          /ckpt: {source: s3://shared, mode: MOUNT}
        run: |
          mktemp /ckpt/$(hostname)-XXXXXX  # not $$: each node set has its own PID namespace, same PIDs
        """,
    )
    a, b = sky_nodes(task), sky_nodes(task)
    a.provision()
    b.provision()
    run(a), run(b)
    assert len(os.listdir(a.bucket("s3://shared"))) == 2  # both sets wrote into the one bucket
    assert a.nodes_dir != b.nodes_dir and a.namespaces()["mnt"].isdisjoint(b.namespaces()["mnt"])


@pytest.mark.slow
def test_root_only_paths_fail_but_file_mounts_there_work(tmp_path, sky_nodes):
    task = write_task(
        tmp_path / "job",
        """
        file_mounts:
          /checkpoints: ./seed
          /data/ds.txt: ./ds.txt
          /mnt/bucket: {source: s3://scratch, mode: MOUNT}
          /snapshot: s3://dataset
        run: |
          mkdir /ckpt 2>&1 | grep -q 'Permission denied' && echo "MKDIR-DENIED"
          touch /opt/x 2>&1 | grep -q 'Permission denied' && echo "OPT-DENIED"
          cat /checkpoints/seed.txt && touch /checkpoints/step-1 && echo "CKPT-WRITABLE"
          cat /data/ds.txt
          touch /mnt/bucket/from-node && echo "BUCKET-WRITABLE"
          cat /snapshot/part-0 && touch /snapshot/local-only && echo "SNAPSHOT-WRITABLE"
        """,
        files={"seed/seed.txt": "SEED\n", "ds.txt": "DATASET\n"},
    )
    nodes = sky_nodes(task)
    (nodes.bucket("s3://dataset") / "part-0").write_text("PART0\n")
    nodes.provision()
    [out] = run(nodes)
    for word in (
        "MKDIR-DENIED",
        "OPT-DENIED",
        "SEED",
        "CKPT-WRITABLE",
        "DATASET",
        "BUCKET-WRITABLE",
        "PART0",
        "SNAPSHOT-WRITABLE",
    ):
        assert word in out, out
    assert (nodes.bucket("s3://scratch") / "from-node").exists()
    # a plain bucket URL is copied onto the node (SkyPilot's COPY), never written back
    assert sorted(os.listdir(nodes.bucket("s3://dataset"))) == ["part-0"]
    # SkyPilot's layout for a destination outside $HOME: a user-owned symlink into ~/.sky/file_mounts
    assert os.readlink(nodes.node_path(0, "/checkpoints")) == "/home/sky/.sky/file_mounts/checkpoints"


@pytest.mark.slow
def test_torch_extensions_built_once_serve_later_nodes_and_sessions(tmp_path, sky_nodes, monkeypatch):
    """The plumbing behind prebuilt DeepSpeed ops (a real build takes 30-100 s): what one node set builds
    into ~/.cache/torch_extensions, later sets see, and the next session starts with."""
    monkeypatch.setattr("sky_nodes.WARM_CACHE", tmp_path / "warm")
    image = build_image(tmp_path / "image")  # private: the session's would be saved for real
    task = write_task(
        tmp_path / "job",
        """
        run: |
          D=~/.cache/torch_extensions/py311_cpu/fake_op
          if [ -e $D/fake_op.so ]; then echo "PREBUILT"; else mkdir -p $D && echo built > $D/fake_op.so; fi
        """,
    )
    first = sky_nodes(task, image=image, torch_extensions=True)
    first.provision()
    assert "PREBUILT" not in run(first)[0]
    first.destroy()
    later = sky_nodes(task, image=image, torch_extensions=True)
    later.provision()
    assert "PREBUILT" in run(later)[0]
    save_torch_extensions(image)
    next_session = build_image(tmp_path / "image2")
    assert (next_session.torch_extensions / "py311_cpu/fake_op/fake_op.so").stat().st_uid == 4242


# ---------------------------------------------------------------- lifecycle: destroy, lost node


def _sleepers_everywhere(tmp_path, sky_nodes) -> tuple[SkyNodes, list]:
    task = write_task(
        tmp_path / "job",
        """
        num_nodes: 2
        run: |
          sleep 1001 &
          setsid sleep 1002 &
          nohup sleep 1003 > /dev/null 2>&1 &
          echo started
          exec sleep 1004
        """,
    )
    nodes = sky_nodes(task)
    nodes.provision()
    procs = nodes.start()
    deadline = time.time() + 20
    while len(_sleepers()) < 8 and time.time() < deadline:
        time.sleep(0.05)
    assert len(_sleepers()) == 8, nodes.log(0) + nodes.log(1)
    return nodes, procs


def _sleepers() -> list[int]:
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{d}/cmdline").read_bytes().startswith(b"sleep\x00100"):
                out.append(int(d))
        except OSError:
            pass
    return out


@pytest.mark.slow
def test_destroy_leaves_no_process_no_mount_and_no_node_disk(tmp_path, sky_nodes):
    nodes, procs = _sleepers_everywhere(tmp_path, sky_nodes)
    spaces = nodes.namespaces()
    nodes.destroy()
    assert _sleepers() == [] and all(p.poll() is not None for p in procs)
    for kind in ("pid", "mnt", "uts", "ipc"):  # a namespace with no process in it no longer exists
        for ns in spaces[kind]:
            assert not [
                d
                for d in filter(str.isdigit, os.listdir("/proc"))
                if os.path.exists(f"/proc/{d}/ns/{kind}") and _readlink(f"/proc/{d}/ns/{kind}") == ns
            ]
    assert str(nodes.root) not in Path("/proc/self/mountinfo").read_text()
    assert not nodes.nodes_dir.exists() and not (nodes.root / "nodes").exists()


def _readlink(p: str) -> str:
    try:
        return os.readlink(p)
    except OSError:
        return ""


@pytest.mark.slow
def test_kill_node_takes_down_that_vm_only(tmp_path, sky_nodes):
    nodes, procs = _sleepers_everywhere(tmp_path, sky_nodes)
    nodes.kill_node(1)
    assert procs[1].wait(timeout=10) != 0
    time.sleep(0.2)
    assert procs[0].poll() is None and len(_sleepers()) == 4  # node 0 keeps running, detached children too
    assert nodes.ssh(0, "echo alive").stdout.strip().endswith("alive")
    with pytest.raises(RuntimeError, match="not running"):
        nodes.ssh(1, "true")


@pytest.mark.slow
def test_a_failed_node_gets_the_others_cancelled_as_skypilot_does(tmp_path, sky_nodes):
    task = write_task(
        tmp_path / "job",
        """
        num_nodes: 2
        run: |
          [ "$SKYPILOT_NODE_RANK" = 1 ] && exit 3
          sleep 1000
        """,
    )
    nodes = sky_nodes(task)
    nodes.provision()
    assert nodes.wait(nodes.start(), timeout=30) == [137, 3]
    procs = nodes.start()  # gang=False: the survivor is left to its own end (here: the deadline)
    with pytest.raises(subprocess.TimeoutExpired):
        nodes.wait(procs, timeout=1.5, gang=False)
    assert procs[1].returncode == 3 and procs[0].returncode != 0  # killed at the deadline


# ---------------------------------------------------------------- network namespaces


@pytest.mark.slow
def test_netns_nodes_reach_each_other_by_ip_and_hostname_is_127_0_1_1(tmp_path, sky_nodes):
    task = write_task(
        tmp_path / "job",
        """
        num_nodes: 2
        run: |
          echo "HOSTNAME-I $(hostname -i)"
          HEAD=$(echo "$SKYPILOT_NODE_IPS" | head -n1)
          python - "$HEAD" <<'EOF'
          import socket, sys, time, os
          print("GETADDRINFO", socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)[0][4][0])
          if os.environ["SKYPILOT_NODE_RANK"] == "0":
              s = socket.create_server(("0.0.0.0", 29511))
              c, addr = s.accept()
              print("ACCEPTED", addr[0])
              c.sendall(b"pong")
          else:
              for _ in range(200):
                  try:
                      s = socket.create_connection((sys.argv[1], 29511), timeout=1)
                      break
                  except OSError:
                      time.sleep(0.05)
              print("GOT", s.recv(4).decode())
          EOF
        """,
    )
    nodes = sky_nodes(task, netns=True)
    nodes.provision()
    head_ip, worker_ip = nodes.ips
    assert head_ip.startswith("10.78.") and worker_ip.startswith("10.78.")
    bridge = f"skyn{nodes._slot}"
    head, worker = run(nodes)
    assert "HOSTNAME-I 127.0.1.1" in head and "GETADDRINFO 127.0.1.1" in worker
    assert f"ACCEPTED {worker_ip}" in head and "GOT pong" in worker
    nodes.destroy()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert bridge not in links  # the bridge is deleted; the veths went with the nodes' namespaces


# ---------------------------------------------------------------- reading the task (no processes)


def test_gpus_per_node_follows_resources_accelerators():
    assert gpus_per_node({}) == 0
    assert gpus_per_node({"resources": {"accelerators": "H100:8"}}) == 8
    assert gpus_per_node({"resources": {"accelerators": {"A100": 4}}}) == 4
    assert gpus_per_node({"resources": {"accelerators": ["L4:2", "A10G:1"]}}) == 2
    assert gpus_per_node({"resources": {"accelerators": "T4"}}) == 1


def test_file_mount_kinds_follow_skypilot(tmp_path):
    mounts = parse_file_mounts(
        {
            "file_mounts": {
                "~/job": ".",
                "rel": ".",
                "/a": "s3://b/p",
                "/c": {"source": "gs://g", "mode": "MOUNT_CACHED"},
                "/d": {"name": "fresh"},
                "/e": {"source": "s3://x", "mode": "COPY"},
            }
        },
        tmp_path,
    )
    got = {m.dst: (m.kind, m.source) for m in mounts}
    assert got == {
        "/home/sky/job": ("local", str(tmp_path)),
        "/home/sky/sky_workdir/rel": ("local", str(tmp_path)),
        "/a": ("copy", "s3/b/p"),
        "/c": ("bucket", "gs/g"),
        "/d": ("bucket", "s3/fresh"),
        "/e": ("copy", "s3/x"),
    }


def test_volumes_are_refused_not_faked(tmp_path, sky_image):
    task = write_task(tmp_path / "job", "volumes: {/mnt/data: my-volume}\nrun: true\n")
    with pytest.raises(NotImplementedError, match="volumes"):
        SkyNodes(task, image=sky_image, root=tmp_path / "r")


def test_workdir_sync_honours_gitignore(tmp_path):
    src = tmp_path / "proj"
    for f in (
        "keep.py",
        ".venv/bin/python",
        "runs/x/ckpt",
        "pkg/mod.py",
        "pkg/cache.tmp",
        "pkg/__pycache__/m.pyc",
        "out/a",
        "pkg/out/b",
        "pkg/runs",
    ):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_text("x")
    (src / ".gitignore").write_text(".venv/\nruns/\n__pycache__/\n/out/\n")
    (src / "pkg" / ".gitignore").write_text("*.tmp\n")
    copy_tree(src, tmp_path / "copy")
    got = sorted(str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*") if p.is_file())
    # runs/ is a directory pattern (pkg/runs is a file), /out/ is anchored at the top (pkg/out stays)
    assert got == [".gitignore", "keep.py", "pkg/.gitignore", "pkg/mod.py", "pkg/out/b", "pkg/runs"]
