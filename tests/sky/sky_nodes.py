"""Simulated SkyPilot cloud VMs on this machine, each given only what a real VM has.

Why: sky_harness.py runs a task's `setup` and `run` as plain processes that share this machine's disk,
$HOME, root user and the test venv (where dtlaunch is already installed, and `pip` is a stub). Defects
that only a real cluster shows cannot appear there: a setup that installs dtlaunch from PyPI (where it is
not published), checkpoints on node-local disk that other nodes never see, a root-only path such as
/checkpoints, a head hostname that resolves to 127.0.1.1 instead of the node's IP.

SkyNodes gives each node (as root, with Linux namespaces; no Docker, no VM):
- its own root filesystem: /usr, /etc (a copy), the Python interpreter and a "deep-learning image" are
  read-only binds; / itself, /tmp, /home/sky and everything else it writes is node-local disk;
- its own mount, PID, IPC and UTS namespaces (hostname node0, node1, ...), so destroying a node kills every
  process it started and drops every mount it had; with netns=True also its own network namespace with
  an IP on a bridge and a cloud-like /etc/hosts (its own hostname -> 127.0.1.1);
- a non-root user (uid 4242, "sky") that runs the task, as SkyPilot's cloud user does;
- the image: a Python environment with torch and the test venv's other packages, never dtlaunch; and,
  as SkyPilot 0.14 creates on VMs, a writable ~/sky-user-env that sees the image's packages and is
  activated for `setup` and `run`, so `pip install ./dtlaunch-*.whl` works offline and nothing else does
  (no package index is reachable: pip is configured with no-index);
- SkyPilot's staging: the workdir copied to ~/sky_workdir, file_mounts copied (local sources, COPY-mode
  buckets) or bind-mounted (MOUNT / MOUNT_CACHED buckets: a host directory shared by all nodes and by
  later node sets), and the task scripts wrapped and run the way SkyPilot runs them (`bash -i` on a
  script that sources ~/.bashrc, activates the user env, cd's to ~/sky_workdir and exports the envs).

Not simulated (details in SkyNodes' docstring): sudo, GPUs, bucket consistency delays, `volumes:`, ssh
between nodes.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import fnmatch
import itertools
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

UID = GID = 4242  # any non-root id: what matters is that the task cannot write where a cloud user cannot
USER = "sky"
HOME = "/home/sky"
IMAGE_AT = "/opt/dlimage"  # where the deep-learning image's Python environment lives inside a node
USER_ENV = f"{HOME}/sky-user-env"  # SkyPilot 0.14's per-user venv on VMs (SKY_USER_ENV_PATH)
WORKDIR = f"{HOME}/sky_workdir"  # SkyPilot's SKY_REMOTE_WORKDIR
WRAPPED = f"{HOME}/.sky/file_mounts"  # where SkyPilot syncs a file_mount whose destination needs sudo
SUBNET = "10.78"  # netns mode: node r of bridge slot k is 10.78.k.(11 + r)
LOCK = Path("/run/lock/dtlaunch-skynodes.lock")
# JIT-built torch extensions (DeepSpeed's ops: 30-100 s to build) kept across sessions: a deep-learning
# image ships them prebuilt. Valid only for the same paths and versions, hence one directory per key.
WARM_CACHE = Path("/var/cache/dtlaunch-skynodes/torch_extensions")
# A login shell's PATH on the image: its Python environment first, as deep-learning images set it.
BASE_PATH = f"{IMAGE_AT}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# PID 1 of a node: reaps what the task leaves behind, like a VM's init, and says when the mounts are done.
REAPER = (
    "import os, time\nos.write(1, b'ready\\n')\nos.close(1)\nwhile True:\n"
    "    try:\n        os.wait()\n    except ChildProcessError:\n        time.sleep(1)\n"
)
DEFAULT_TASK_ID = "sky-2026-01-01-00-00-00-000000_skynodes_1"  # SkyPilot's format: sky-<timestamp>_<cluster>_<job>
CANCELLED = 137  # SkyPilot's code for a node whose run it killed because another node failed
BUCKET_URL = re.compile(r"^(s3|gs|r2|cos|oci|azure|https)://([^/]+)(/.*)?$")
# Paths a node gets from the image (binds): a file_mount cannot land there.
IMAGE_PATHS = ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc", "/dev", "/proc", "/sys", IMAGE_AT)
# Merged /usr (Debian 12, Ubuntu): these are symlinks into /usr; on an older layout, directories to bind.
TOP_DIRS = ("bin", "lib", "lib64", "sbin")


# ---------------------------------------------------------------- the VM image (once per session)


@dataclass(frozen=True)
class Image:
    """Host-side pieces of the "VM image", built once and shared read-only by every node."""

    root: Path  # session directory holding everything below
    env: Path  # venv bound at IMAGE_AT: its site-packages is a symlink farm into `packages`
    packages: Path  # the test venv's site-packages, bound at IMAGE_AT/pkgs
    hidden: tuple[str, ...]  # entries of `packages` that are dtlaunch's (masked inside every node)
    prefix: Path  # the base interpreter's installation, bound at the same path
    pyver: str  # "python3.11"
    etc: Path  # private copy of /etc with the node user added
    torch_extensions: Path  # writable cache shared by nodes that ask for it (prebuilt DeepSpeed ops)
    extensions_key: str  # what the cached builds depend on: interpreter, torch and deepspeed versions

    @property
    def empty_dir(self) -> Path:
        return self.root / "empty"

    @property
    def empty_file(self) -> Path:
        return self.root / "empty-file"


def build_image(root: Path, venv: Path | None = None) -> Image:
    """The image from `venv` (default: the one running the tests) minus everything of dtlaunch."""
    root = Path(root)
    venv = Path(venv or sys.prefix)
    packages = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    pyver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    prefix = Path(sys.base_prefix).resolve()
    hidden = tuple(sorted(_dtlaunch_entries(packages)))
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    (root / "empty").mkdir(exist_ok=True)
    (root / "empty-file").touch()
    img = Image(
        root,
        root / "dlimage",
        packages,
        hidden,
        prefix,
        pyver,
        root / "etc",
        root / "torch_extensions",
        _extensions_key(packages, pyver),
    )
    _write_venv(img.env, prefix, pyver)
    (img.env / "pkgs").mkdir()
    _link_farm(img.env / "lib" / pyver / "site-packages", packages, hidden)
    _image_scripts(venv / "bin", img.env / "bin", hidden_scripts=_dtlaunch_scripts(packages))
    _image_etc(img.etc)
    _seed_torch_extensions(img)
    return img


def _extensions_key(packages: Path, pyver: str) -> str:
    dists = sorted(
        d.name.removesuffix(".dist-info")
        for d in packages.glob("*.dist-info")
        if d.name.lower().startswith(("torch-", "deepspeed-"))
    )
    return "_".join([pyver, *dists]).replace("+", "-")


def _seed_torch_extensions(img: Image) -> None:
    """The session's writable copy of the warm cache. A `lock` file is torch's build lock: one left by a
    build that was killed would make every later load wait forever."""
    seed = WARM_CACHE / img.extensions_key
    if seed.is_dir():
        shutil.copytree(seed, img.torch_extensions, symlinks=True, ignore=shutil.ignore_patterns("lock"))
    img.torch_extensions.mkdir(exist_ok=True)
    chown_tree(img.torch_extensions)


def save_torch_extensions(img: Image) -> None:
    """Keep what this session's nodes built for the next session (a rename, so never half a cache).
    Best effort: a cache that cannot be saved only costs the next session one build."""
    built = sorted(str(p.relative_to(img.torch_extensions)) for p in img.torch_extensions.rglob("*.so"))
    seed = WARM_CACHE / img.extensions_key
    if not built or (seed.is_dir() and built == sorted(str(p.relative_to(seed)) for p in seed.rglob("*.so"))):
        return
    tmp, old = (WARM_CACHE / f".{img.extensions_key}.{tag}.{os.getpid()}" for tag in ("new", "old"))
    try:
        WARM_CACHE.mkdir(parents=True, exist_ok=True)
        shutil.copytree(img.torch_extensions, tmp, symlinks=True, ignore=shutil.ignore_patterns("lock"))
        if seed.exists():
            seed.rename(old)
        tmp.rename(seed)
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _dtlaunch_entries(packages: Path) -> set[str]:
    """Top-level names in site-packages that belong to dtlaunch (editable or regular install)."""
    out = {
        n
        for n in os.listdir(packages)
        if n == "launcher" or n.startswith("dtlaunch-") or (n.startswith("__editable__") and "dtlaunch" in n)
    }
    for rec in packages.glob("dtlaunch-*.dist-info/RECORD"):
        out |= {line.split("/")[0] for line in rec.read_text().splitlines() if line and not line.startswith("..")}
    return {n for n in out if (packages / n).exists()}


def _dtlaunch_scripts(packages: Path) -> set[str]:
    names = {"dtlaunch"}
    for ep in packages.glob("dtlaunch-*.dist-info/entry_points.txt"):
        names |= {line.split("=")[0].strip() for line in ep.read_text().splitlines() if "=" in line}
    return names


def _write_venv(path: Path, prefix: Path, pyver: str) -> None:
    """A venv by hand (what `python -m venv --without-pip` writes), relocatable to wherever it is bound."""
    (path / "bin").mkdir(parents=True)
    (path / "lib" / pyver / "site-packages").mkdir(parents=True)
    (path / "lib64").symlink_to("lib")
    version = ".".join(map(str, sys.version_info[:3]))
    (path / "pyvenv.cfg").write_text(
        f"home = {prefix}/bin\ninclude-system-site-packages = false\nversion = {version}\n"
    )
    (path / "bin" / "python").symlink_to(prefix / "bin" / pyver)
    for alias in ("python3", pyver):
        (path / "bin" / alias).symlink_to("python")


def _link_farm(site: Path, packages: Path, hidden: tuple[str, ...]) -> None:
    """One relative symlink per package into IMAGE_AT/pkgs: the image's packages without dtlaunch's.
    The root __pycache__ is left out: it holds the bytecode of dtlaunch's editable finder."""
    for name in sorted(os.listdir(packages)):
        if name not in hidden and name != "__pycache__":
            (site / name).symlink_to(Path("../../../pkgs") / name)


def _image_scripts(src: Path, dst: Path, hidden_scripts: set[str]) -> None:
    """The venv's console scripts (torchrun, deepspeed, ninja, ...) on the image's PATH, their shebang
    pointing at the image's python, as an image's system scripts point at its system python."""
    shebang = re.compile(rb"^#!" + re.escape(str(src).encode()) + rb"/python[0-9.]*")
    for f in sorted(src.iterdir()):
        venv_own = f.name.startswith(("python", "activate", "Activate"))
        if f.is_symlink() or not f.is_file() or venv_own or f.name in hidden_scripts:
            continue
        data = shebang.sub(f"#!{IMAGE_AT}/bin/python".encode(), f.read_bytes(), count=1)
        (dst / f.name).write_bytes(data)
        (dst / f.name).chmod(0o755)


def _image_etc(etc: Path) -> None:
    """A copy of this machine's /etc with the cloud user added, and pip told that no index exists
    (a config file rather than only PIP_NO_INDEX, so a task cannot unset it by accident)."""
    shutil.copytree("/etc", etc, symlinks=True)
    with open(etc / "passwd", "a") as f:
        f.write(f"{USER}:x:{UID}:{GID}:SkyPilot cloud user:{HOME}:/bin/bash\n")
    with open(etc / "group", "a") as f:
        f.write(f"{USER}:x:{GID}:\n")
    (etc / "pip.conf").write_text("[global]\nno-index = true\ndisable-pip-version-check = true\n")


_DEFAULT_IMAGE: Image | None = None


def _retire_image(img: Image) -> None:
    destroy_all()  # no node may still use the image
    save_torch_extensions(img)
    shutil.rmtree(img.root, ignore_errors=True)


def default_image() -> Image:
    """The image for this process, built on first use (pytest code should use the sky_image fixture)."""
    global _DEFAULT_IMAGE
    if _DEFAULT_IMAGE is None:
        _DEFAULT_IMAGE = build_image(Path(tempfile.mkdtemp(prefix="skynodes-image-")))
        atexit.register(_retire_image, _DEFAULT_IMAGE)
    return _DEFAULT_IMAGE


# ---------------------------------------------------------------- reading the task


def load_task(task_dir: Path) -> dict:
    return yaml.safe_load((Path(task_dir) / "task.yaml").read_text()) or {}


def gpus_per_node(task: dict) -> int:
    """SKYPILOT_NUM_GPUS_PER_NODE: the count of `resources.accelerators` (first choice), 0 without one."""
    acc = (task.get("resources") or {}).get("accelerators")
    if isinstance(acc, (list, tuple)):
        acc = acc[0] if acc else None
    if isinstance(acc, dict):
        return int(next(iter(acc.values()), 0) or 0) if acc else 0
    if not acc:
        return 0
    return int(float(str(acc).split(":")[1])) if ":" in str(acc) else 1


@dataclass(frozen=True)
class Mount:
    """One file_mounts entry. kind: 'local' (copied), 'copy' (bucket copied) or 'bucket' (shared bind)."""

    dst: str
    kind: str
    source: str  # local path (absolute) or bucket key "s3/name/path"


def parse_file_mounts(task: dict, task_dir: Path) -> list[Mount]:
    out = []
    for dst, src in (task.get("file_mounts") or {}).items():
        dst = str(dst)
        if not dst.startswith(("/", "~")):  # SkyPilot: a relative destination is inside the workdir
            dst = f"{WORKDIR}/{dst}"
        out.append(_parse_mount(dst.replace("~", HOME, 1) if dst.startswith("~") else dst, src, task_dir))
    return out


def _parse_mount(dst: str, src, task_dir: Path) -> Mount:
    if isinstance(src, str):
        if BUCKET_URL.match(src):  # a plain bucket URL is downloaded once, not mounted (SkyPilot's COPY)
            return Mount(dst, "copy", bucket_key(src))
        return Mount(dst, "local", str((Path(task_dir) / os.path.expanduser(src)).resolve()))
    mode = str(src.get("mode") or "MOUNT").upper()
    if src.get("source") and BUCKET_URL.match(str(src["source"])):
        key = bucket_key(str(src["source"]))
    elif src.get("name"):
        key = f"{src.get('store') or 's3'}/{src['name']}"
    else:
        raise ValueError(f"file_mounts {dst}: a storage entry needs a bucket `source` or a `name`: {src}")
    if mode not in ("MOUNT", "MOUNT_CACHED", "COPY"):
        raise ValueError(f"file_mounts {dst}: unknown mode {mode}")
    return Mount(dst, "copy" if mode == "COPY" else "bucket", key)


def bucket_key(url: str) -> str:
    m = BUCKET_URL.match(url)
    if not m:
        raise ValueError(f"not a bucket URL: {url}")
    scheme, name, path = m.groups()
    return "/".join(p for p in (scheme, name, (path or "").strip("/")) if p)


# ---------------------------------------------------------------- copying like rsync with SkyPilot's filters


def copy_tree(src: Path, dst: Path) -> None:
    """Copy `src` (a file, or a directory's contents) to `dst` as SkyPilot's rsync does: symlinks kept,
    and the patterns of .skyignore (or else .gitignore and .git/info/exclude) files honoured, each file's
    in its directory and below (rsync's dir-merge). Negated patterns ("!keep") are not supported."""
    src = Path(src)
    if src.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        return
    name = ".skyignore" if (src / ".skyignore").exists() else ".gitignore"
    extra = _patterns(src / ".git" / "info" / "exclude") if name == ".gitignore" else []

    def ignore(d: str, names: list[str]) -> set[str]:
        here = Path(d)
        rules = [
            (anc, p)
            for anc in [here, *here.parents]
            if anc == src or src in anc.parents
            for p in _patterns(anc / name) + (extra if anc == src else [])
        ]
        return {n for n in names if any(_match(p, here / n, anc) for anc, p in rules)}

    shutil.copytree(src, dst, symlinks=True, ignore=ignore, dirs_exist_ok=True)


def _patterns(f: Path) -> list[str]:
    if not f.is_file():
        return []
    return [
        ln.strip() for ln in f.read_text(errors="replace").splitlines() if ln.strip() and not ln.startswith(("#", "!"))
    ]


def _match(pattern: str, path: Path, base: Path) -> bool:
    """gitignore's rules in short: a trailing / matches directories only; a pattern with a / elsewhere is
    relative to its file's directory, one without matches the name at any depth below it."""
    if pattern.endswith("/") and not path.is_dir():
        return False
    pattern = pattern.rstrip("/")
    if "/" in pattern:
        return fnmatch.fnmatch(str(path.relative_to(base)), pattern.lstrip("/"))
    return fnmatch.fnmatch(path.name, pattern)


def chown_tree(path: Path) -> None:
    for d, dirs, files in os.walk(path):
        for n in [d, *(os.path.join(d, x) for x in dirs + files)]:
            os.lchown(n, UID, GID)


# ---------------------------------------------------------------- processes and namespaces

_LIBC = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """Runs in the child before exec: if the test process dies, so does this child (and, through
    unshare --kill-child, the whole node), so even a killed pytest leaves no node behind."""
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.setsid()


def _parents() -> dict[int, list[int]]:
    """ppid -> pids, from /proc (every thread's children, unlike /proc/PID/task/PID/children)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def children(pid: int) -> list[int]:
    return _parents().get(pid, [])


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid`, parents before their children."""
    kids, out, todo = _parents(), [], [pid]
    while todo:
        found = kids.get(todo.pop(0), [])
        out += found
        todo += found
    return out


def pids_in_namespaces(kind: str, ids: set[str]) -> list[int]:
    """Live (non-zombie) processes whose namespace of `kind` ("pid", "mnt", "net") is one of `ids`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{d}/ns/{kind}") in ids and _state(int(d)) != "Z":
                out.append(int(d))
        except OSError:
            continue
    return out


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _sh(*cmd: str, input: str | None = None) -> None:
    r = subprocess.run(cmd, input=input, capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")


# ---------------------------------------------------------------- network (netns mode)


@contextlib.contextmanager
def _host_lock():
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _our_bridges() -> dict[str, str]:
    """Bridges made by SkyNodes on this host (name -> alias naming the owning process)."""
    out = {}
    for d in Path("/sys/class/net").iterdir():
        if d.name.startswith("skyn") and (d / "bridge").is_dir():
            out[d.name] = (d / "ifalias").read_text().strip() if (d / "ifalias").exists() else ""
    return out


def _sweep_stale_bridges() -> None:
    """A bridge whose owner process is gone was left by a killed session: its veths died with their
    namespaces, only the bridge remains."""
    for name, alias in _our_bridges().items():
        m = re.search(r"pid=(\d+)", alias)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _unplug_all(int(name[len("skyn") :]))


def _new_bridge() -> int:
    """Claim the first free slot k: bridge skyn<k> with 10.78.k.1/24. Creating the link is the claim."""
    with _host_lock():
        _sweep_stale_bridges()
        for k in range(64):
            r = subprocess.run(["ip", "link", "add", f"skyn{k}", "type", "bridge"], capture_output=True, check=False)
            if r.returncode == 0:
                for old in Path("/sys/class/net").glob(f"skyn{k}v*"):  # a veth of a dead set, still going away
                    subprocess.run(["ip", "link", "del", old.name], capture_output=True, check=False)
                _sh("ip", "link", "set", f"skyn{k}", "alias", f"dtlaunch-skynodes pid={os.getpid()}")
                _sh("ip", "addr", "add", f"{SUBNET}.{k}.1/24", "dev", f"skyn{k}")
                _sh("ip", "link", "set", f"skyn{k}", "up")
                return k
    raise RuntimeError("no free skyn<k> bridge slot (64 in use)")


def _plug(slot: int, rank: int, init_pid: int, ip: str) -> None:
    """A veth from the bridge into the node's network namespace, as the node's eth0. It disappears with
    the namespace, so destroying the node needs no network cleanup besides the bridge."""
    host_end = f"skyn{slot}v{rank}"
    _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", str(init_pid))
    _sh("ip", "link", "set", host_end, "master", f"skyn{slot}", "up")
    _sh(
        "nsenter",
        f"--target={init_pid}",
        "--net",
        "ip",
        "-batch",
        "-",
        input=f"link set lo up\naddr add {ip}/24 dev eth0\nlink set eth0 up\n",
    )


def _unplug_all(slot: int, timeout: float = 10) -> None:
    """Delete slot's veths and bridge. The kernel frees a dead namespace's veths asynchronously, so
    they are deleted here rather than waited for; one end deleted takes the other with it."""
    deadline = time.time() + timeout
    while True:
        links = [d.name for d in Path("/sys/class/net").iterdir() if re.fullmatch(rf"skyn{slot}(v\d+)?", d.name)]
        if not links:
            return
        for name in sorted(links, reverse=True):  # veths (skyn0v1) before their bridge (skyn0)
            subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
        if time.time() > deadline:
            raise RuntimeError(f"network links survived destroy(): {links}")
        time.sleep(0.05)


# ---------------------------------------------------------------- one node


@dataclass
class Node:
    rank: int
    ip: str
    dir: Path  # host directory holding everything node-local

    unshare: subprocess.Popen | None = None
    init_pid: int = 0
    namespaces: dict = field(default_factory=dict)  # kind -> "pid:[4026...]"
    alive: bool = False

    @property
    def hostname(self) -> str:
        return f"node{self.rank}"

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs"

    def path(self, inside: str) -> Path:
        """Host path of `inside` (an absolute path in the node) on the node's own disk."""
        return self.rootfs / inside.lstrip("/")


# ---------------------------------------------------------------- the node set

_LIVE: set = set()
_SETS = itertools.count()


class SkyNodes:
    """A set of simulated SkyPilot VMs running one task.yaml (see the module docstring).

    Simulated faithfully: private rootfs, /tmp, $HOME and /dev/shm per node; non-root cloud user; the
    image's packages visible to a writable ~/sky-user-env; pip offline; workdir and local file_mounts
    copied per node (relative/absolute destinations as SkyPilot resolves them, root-owned parents, the
    ~/.sky/file_mounts + symlink trick for destinations outside $HOME and /tmp); buckets as host
    directories shared by every node and every later node set (MOUNT and MOUNT_CACHED: bind mounts;
    COPY and plain bucket URLs: a per-node copy taken at provision); SkyPilot's script wrapper and its
    per-stage variables (`setup` gets SKYPILOT_SETUP_NODE_RANK/_IPS, not SKYPILOT_NODE_RANK); PID 1
    per node so a lost node takes all its processes with it.

    Not simulated: sudo (absent; on a VM it works), GPUs, ssh between nodes, bucket semantics beyond a
    shared directory (no eventual consistency, no MOUNT write restrictions), `volumes:` (refused),
    the SkyPilot runtime itself (ray, skylet, `sky logs`).

    Use (in tests, through the `sky_nodes` fixture, which destroys every set it made):
        nodes = sky_nodes(task_dir)                  # or netns=True, nodes=N, task_id=..., secrets=...
        nodes.provision()
        assert all(r.returncode == 0 for r in nodes.setup())
        assert nodes.wait(nodes.start(env={"DTLAUNCH_PORT": "29511"}), timeout=120) == [0] * nodes.nodes
        nodes.log(0); nodes.bucket("s3://b/ckpt"); nodes.kill_node(1); nodes.destroy(); nodes.provision()
    """

    def __init__(
        self,
        task_dir: Path,
        *,
        nodes: int | None = None,
        task_id: str = DEFAULT_TASK_ID,
        root: Path | None = None,
        netns: bool = False,
        image: Image | None = None,
        secrets: dict | None = None,
        torch_extensions: bool = False,
        cluster: str = "skynodes",
    ):
        self.task_dir = Path(task_dir).resolve()
        self.task = load_task(self.task_dir)
        if self.task.get("volumes"):
            raise NotImplementedError(
                "SkyNodes does not simulate `volumes:` (their sharing depends on the "
                "volume type); use a bucket file_mount"
            )
        self.nodes = int(nodes or self.task.get("num_nodes") or 1)
        self.task_id = task_id
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="skynodes-"))
        self.netns = netns
        self.image = image or default_image()
        self.secrets = dict(secrets or {})
        self.torch_extensions = torch_extensions
        self.cluster = cluster
        self.mounts = parse_file_mounts(self.task, self.task_dir)
        self._check_mount_destinations()
        # launch numbers go on across node sets sharing `root`: a recovery's logs follow the lost launch's
        self.launches = max(
            (
                int(m.group(1))
                for f in (self.root / "logs").glob("node0.*.log")
                if (m := re.fullmatch(r"node0\.(\d+)\.log", f.name))
            ),
            default=0,
        )
        self._nodes: list[Node] = []
        self._procs: list[subprocess.Popen] = []
        self._slot: int | None = None
        self.nodes_dir = self.root / "nodes" / f"{os.getpid()}-{next(_SETS)}"  # two sets may share a root

    # -------------------------------------------------- public API

    @property
    def ips(self) -> list[str]:
        return [self._ip(r) for r in range(self.nodes)]

    def bucket(self, source: str) -> Path:
        """The host directory standing in for a bucket URL (s3://name/path), shared by all node sets."""
        d = self.root / "buckets" / bucket_key(source)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def provision(self) -> None:
        """Fresh VMs: private rootfs and home per node, workdir synced, file_mounts applied, PID 1 up."""
        if self._nodes:
            raise RuntimeError("already provisioned: destroy() first")
        _LIVE.add(self)
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        try:
            if self.netns:
                self._slot = _new_bridge()
            self._nodes = [Node(r, self._ip(r), self.nodes_dir / f"node{r}") for r in range(self.nodes)]
            for n in self._nodes:
                self._stage(n)
            for n in self._nodes:
                self._boot(n)
            for n in self._nodes:
                self._await_boot(n)
        except BaseException:
            self.destroy()
            raise

    def setup(self, env: dict | None = None, timeout: float = 120) -> list[subprocess.CompletedProcess]:
        """Run the task's `setup` on every node at once, as SkyPilot does (a node that fails cancels the
        others: 137); each result's stdout holds that node's stdout and stderr."""
        if not self.task.get("setup"):
            return []
        logs = [self.root / "logs" / f"node{n.rank}.{self.launches + 1}.setup.log" for n in self._nodes]
        procs = []
        for n, path in zip(self._nodes, logs, strict=True):
            with open(path, "wb") as log:
                procs.append(self._spawn(n, "setup", self._script(n, "setup", env), log))
        codes = self.wait(procs, timeout)
        return [
            subprocess.CompletedProcess(p.args, c, path.read_text(errors="replace"), "")
            for p, c, path in zip(procs, codes, logs, strict=True)
        ]

    def start(self, env: dict | None = None, per_node: dict[int, dict] | None = None) -> list[subprocess.Popen]:
        """Start the task's `run` on every node, detached; output goes to log(rank)."""
        self.launches += 1
        procs = []
        for n in self._nodes:
            extra = {**(env or {}), **(per_node or {}).get(n.rank, {})}
            with open(self._log_path(n.rank, self.launches), "ab") as log:
                procs.append(self._spawn(n, "run", self._script(n, "run", extra), log))
        return procs

    def wait(self, procs: list[subprocess.Popen], timeout: float, gang: bool = True) -> list[int]:
        """Exit codes of `procs`. As SkyPilot's job driver does, the first node to fail gets the others
        killed, their code then being 137 (gang=False: let them run to their own end, to see what the job
        itself does about a lost peer). Whatever still runs at the deadline is killed, TimeoutExpired raised."""
        deadline = time.time() + timeout
        codes: dict[int, int] = {}
        try:
            while len(codes) < len(procs):
                codes |= {i: p.returncode for i, p in enumerate(procs) if i not in codes and p.poll() is not None}
                if gang and any(codes.values()):
                    return [codes.get(i, CANCELLED) for i in range(len(procs))]
                if time.time() > deadline:
                    raise subprocess.TimeoutExpired([p.args for p in procs], timeout)
                time.sleep(0.05)
            return [codes[i] for i in range(len(procs))]
        finally:
            self.kill(procs)

    def ssh(self, rank: int, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """What `ssh node<rank> COMMAND` would run: a plain bash as the cloud user, in $HOME, with the
        login environment only (no SkyPilot variables, no user env)."""
        n = self._nodes[rank]
        p = self._spawn(n, None, command, subprocess.PIPE)
        try:
            text, _ = p.communicate(timeout=timeout)
        finally:
            self.kill([p])
        return subprocess.CompletedProcess(p.args, p.returncode, text, "")

    def kill_node(self, rank: int) -> None:
        """One VM lost: every process on it dies at once (its PID 1 is killed)."""
        self._halt(self._nodes[rank])

    def destroy(self) -> None:
        """The node set is gone: every process killed, node-local disk deleted; buckets and logs survive."""
        for n in self._nodes:
            self._halt(n)
        self.kill(self._procs)  # nothing left to kill: each nsenter exits as its child died with the node
        self._procs = []
        self._assert_gone()
        self._delete_node_dirs()
        if self._slot is not None:
            _unplug_all(self._slot)
            self._slot = None
        self._nodes = []
        _LIVE.discard(self)

    def log(self, rank: int, launch: int | None = None) -> str:
        """Output of `run` on node `rank` in launch number `launch` (default: the latest)."""
        p = self._log_path(rank, launch or self.launches or 1)
        return p.read_text(errors="replace") if p.exists() else ""

    def node_path(self, rank: int, inside: str) -> Path:
        """Host path of a file on node `rank`'s own disk (for assertions; not under a bind mount)."""
        return self._nodes[rank].path(inside)

    def namespaces(self) -> dict[str, set[str]]:
        """Namespace ids of the live nodes, by kind, e.g. {"pid": {"pid:[4026532]"}, ...}."""
        out: dict[str, set[str]] = {}
        for n in self._nodes:
            for kind, ns in n.namespaces.items():
                out.setdefault(kind, set()).add(ns)
        return out

    @staticmethod
    def kill(procs: list[subprocess.Popen], sig=signal.SIGKILL) -> None:
        """Kill each started command's whole process tree (not the node: a daemon it detached survives,
        as it would on a VM when SkyPilot cancels a job). nsenter itself is left to exit once its child
        died: killed first, it would orphan that child's zombie to this host's PID 1."""
        for p in procs:
            for pid in reversed(descendants(p.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # -------------------------------------------------- provisioning

    def _ip(self, rank: int) -> str:
        if self.netns:
            return f"{SUBNET}.{self._slot if self._slot is not None else 0}.{11 + rank}"
        return f"127.0.0.{1 + rank}"  # distinct loopback addresses: one host network, several "hosts"

    def _check_mount_destinations(self) -> None:
        for m in self.mounts:
            if any(m.dst == p or m.dst.startswith(p + "/") for p in (*IMAGE_PATHS, str(self.image.prefix))):
                raise NotImplementedError(f"file_mounts destination {m.dst} is inside the simulated image")

    def _stage(self, n: Node) -> None:
        """Everything a node's disk holds before boot (the parts SkyPilot's provisioning writes)."""
        if n.dir.exists():
            raise RuntimeError(f"{n.dir} exists: a previous node set was not destroyed")
        self._make_rootfs(n)
        self._make_home(n)
        for m in self.mounts:
            self._apply_mount(n, m)

    def _make_rootfs(self, n: Node) -> None:
        r = n.rootfs
        for d in (
            "usr",
            "etc",
            "dev",
            "proc",
            "sys",
            "run",
            IMAGE_AT,
            "/home",
            "/var",
            "/root",
            str(self.image.prefix),
        ):
            (r / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for name in TOP_DIRS:
            if os.path.islink(f"/{name}"):
                (r / name).symlink_to(os.readlink(f"/{name}"))
            elif os.path.isdir(f"/{name}"):
                (r / name).mkdir()
        for d in ("tmp", "var/tmp"):
            (r / d).mkdir(parents=True, exist_ok=True)
            (r / d).chmod(0o1777)
        for d in (r, *(p for p in (r / str(self.image.prefix)[1:]).parents if r in p.parents)):
            d.chmod(0o755)  # /root is 0700 on the host; the interpreter below it must be reachable

    def _make_home(self, n: Node) -> None:
        home = n.path(HOME)
        home.mkdir(parents=True)
        for f in ("/etc/skel/.bashrc", "/etc/skel/.profile", "/etc/skel/.bash_logout"):
            if os.path.exists(f):
                shutil.copy(f, home)
        _write_user_env(n.path(USER_ENV), self.image)
        work = n.path(WORKDIR)
        wd = self.task.get("workdir")
        if isinstance(wd, dict):
            raise NotImplementedError("a git workdir is not simulated")
        if wd:
            copy_tree(self.task_dir / os.path.expanduser(str(wd)), work)
        work.mkdir(exist_ok=True)
        if self.torch_extensions:
            n.path(f"{HOME}/.cache/torch_extensions").mkdir(parents=True)
        chown_tree(home)

    def _apply_mount(self, n: Node, m: Mount) -> None:
        if m.kind == "bucket":
            self._bucket_mountpoint(n, m.dst)
            return
        src = Path(m.source) if m.kind == "local" else self.root / "buckets" / m.source
        if not src.exists():
            raise FileNotFoundError(f"file_mounts {m.dst}: source {m.source} does not exist")
        if m.dst.startswith((HOME + "/", "/tmp/")):
            copy_tree(src, n.path(m.dst))
            self._chown_new(n, m.dst)
            return
        # SkyPilot syncs to ~/.sky/file_mounts/<dst> and (with sudo) links <dst> to it, its parents owned
        # by the cloud user.
        wrapped = f"{WRAPPED}/{m.dst.lstrip('/')}"
        copy_tree(src, n.path(wrapped))
        self._chown_new(n, wrapped)
        link = n.path(m.dst)
        link.parent.mkdir(parents=True, exist_ok=True)
        for p in [link.parent, *link.parent.parents]:
            if p == n.rootfs or n.rootfs not in p.parents:
                break
            os.chown(p, UID, GID)
        link.symlink_to(wrapped)
        os.lchown(link, UID, GID)

    def _chown_new(self, n: Node, dst: str) -> None:
        """The cloud user's rsync created `dst` and its missing parents: they are the user's."""
        chown_tree(n.path(dst))
        for p in Path(dst).parents:
            if str(p) in (HOME, "/tmp", "/"):
                break
            os.chown(n.path(str(p)), UID, GID)

    def _bucket_mountpoint(self, n: Node, dst: str) -> None:
        """As SkyPilot's mount script: `sudo mkdir -p $MOUNT_PATH; sudo chmod 777 $MOUNT_PATH`."""
        mp = n.path(dst)
        mp.mkdir(parents=True, exist_ok=True)
        mp.chmod(0o777)

    def _binds(self, n: Node) -> list[tuple[str, str, bool]]:
        """(host source, path in node, read-only) in mount order."""
        img = self.image
        unmerged = [f"/{d}" for d in TOP_DIRS if os.path.isdir(f"/{d}") and not os.path.islink(f"/{d}")]
        binds = [
            ("/usr", "/usr", True),
            *((d, d, True) for d in unmerged),
            # this machine's own tools under /usr/local are not part of a VM image
            (str(img.empty_dir), "/usr/local", True),
            (str(img.etc), "/etc", True),
            (str(n.dir / "hosts"), "/etc/hosts", True),
            (str(n.dir / "hostname"), "/etc/hostname", True),
            ("/dev", "/dev", False),
            ("/sys", "/sys", True),
            (str(img.prefix), str(img.prefix), True),
            (str(img.env), IMAGE_AT, True),
            (str(img.packages), f"{IMAGE_AT}/pkgs", True),
        ]
        for name in img.hidden:  # dtlaunch stays invisible even where the image's packages really live
            empty = img.empty_dir if (img.packages / name).is_dir() else img.empty_file
            binds.append((str(empty), f"{IMAGE_AT}/pkgs/{name}", True))
        for m in self.mounts:
            if m.kind == "bucket":
                src = self.root / "buckets" / m.source
                src.mkdir(parents=True, exist_ok=True)
                os.chown(src, UID, GID)  # a FUSE bucket mount shows its files as the mounting user's
                binds.append((str(src), m.dst, False))
        if self.torch_extensions:
            binds.append((str(img.torch_extensions), f"{HOME}/.cache/torch_extensions", False))
        return binds

    def _init_script(self, n: Node) -> str:
        """Runs as root in the node's fresh namespaces: hostname, mounts, then PID 1 in the chroot."""
        r = n.rootfs
        lines = ["set -eu", f"hostname {n.hostname}"]
        for src, dst, ro in self._binds(n):
            opt = " -o ro" if ro else ""
            lines.append(f"mount --bind{opt} {shlex.quote(src)} {shlex.quote(str(r) + dst)}")
        # a node's /dev/shm is its own (DeepSpeed's shm allreduce and torch share memory through it)
        lines.append(f"mount -t tmpfs -o mode=1777,nosuid,nodev shm {shlex.quote(str(r / 'dev/shm'))}")
        lines.append(f"mount -t proc -o nosuid,nodev,noexec proc {shlex.quote(str(r / 'proc'))}")
        py = f"{self.image.prefix}/bin/{self.image.pyver}"
        lines.append(f"exec chroot {shlex.quote(str(r))} {py} -I -S -c {shlex.quote(REAPER)}")
        return "\n".join(lines) + "\n"

    def _hosts(self, n: Node) -> str:
        if self.netns:  # Ubuntu cloud images (cloud-init's hosts template): the hostname is 127.0.1.1
            own = f"127.0.1.1 {n.hostname}\n127.0.0.1 localhost\n"
        else:  # own line first: node0 shares 127.0.0.1 with localhost, and should be called node0
            own = f"{n.ip} {n.hostname}\n127.0.0.1 localhost\n"
        return own + (
            "\n# The following lines are desirable for IPv6 capable hosts\n"
            "::1 localhost ip6-localhost ip6-loopback\nff02::1 ip6-allnodes\nff02::2 ip6-allrouters\n"
        )

    def _boot(self, n: Node) -> None:
        (n.dir / "hosts").write_text(self._hosts(n))
        (n.dir / "hostname").write_text(n.hostname + "\n")
        (n.dir / "init.sh").write_text(self._init_script(n))
        spaces = ["--mount", "--uts", "--ipc", "--pid", *(["--net"] if self.netns else [])]
        cmd = ["unshare", *spaces, "--fork", "--kill-child", "--propagation", "private", "bash", str(n.dir / "init.sh")]
        with open(n.dir / "init.log", "wb") as log:
            n.unshare = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                preexec_fn=_die_with_parent,
            )  # noqa: PLW1509 - prctl works only in the child
        n.alive = True

    def _await_boot(self, n: Node, timeout: float = 20) -> None:
        ready, _, _ = select.select([n.unshare.stdout], [], [], timeout)
        line = n.unshare.stdout.readline() if ready else b""
        n.unshare.stdout.close()
        if line.strip() != b"ready":
            raise RuntimeError(f"node{n.rank} did not boot: {(n.dir / 'init.log').read_text(errors='replace')[-2000:]}")
        kids = children(n.unshare.pid)
        if len(kids) != 1:
            raise RuntimeError(f"node{n.rank}: expected one PID 1 under unshare, found {kids}")
        n.init_pid = kids[0]
        n.namespaces = {k: os.readlink(f"/proc/{n.init_pid}/ns/{k}") for k in ("pid", "mnt", "net", "uts", "ipc")}
        if not self.netns:
            del n.namespaces["net"]  # the host's: never ours to wait for
        if self.netns:
            _plug(self._slot, n.rank, n.init_pid, n.ip)

    # -------------------------------------------------- running commands

    def _env(self, n: Node, stage: str, extra: dict | None) -> dict[str, str]:
        """What SkyPilot exports for `stage`: the task's envs and secrets, then its own variables.
        setup: SKYPILOT_SETUP_NODE_RANK/_IPS/_NUM_GPUS_PER_NODE; run: SKYPILOT_NODE_RANK/_IPS/...;
        both: SKYPILOT_TASK_ID, SKYPILOT_NUM_NODES, SKYPILOT_CLUSTER_INFO, SKYPILOT_USER."""
        envs = {**(self.task.get("envs") or {}), **(extra or {})}
        secrets = {**(self.task.get("secrets") or {}), **self.secrets}
        missing = [k for k, v in {**envs, **secrets}.items() if v is None]
        if missing:
            raise ValueError(f"no value for {missing}: SkyPilot refuses a task whose envs/secrets are unset")
        out = {k: str(v) for k, v in {**envs, **secrets}.items()}
        ips, gpus = "\n".join(self.ips), str(gpus_per_node(self.task))
        out |= {
            "SKYPILOT_TASK_ID": self.task_id,
            "SKYPILOT_NUM_NODES": str(self.nodes),
            "SKYPILOT_USER": "tester",
            "SKYPILOT_CLUSTER_INFO": json.dumps(
                {"cluster_name": self.cluster, "cloud": "SkyNodes", "region": "local", "zone": None}
            ),
        }
        if stage == "setup":
            out |= {
                "SKYPILOT_SETUP_NODE_IPS": ips,
                "SKYPILOT_SETUP_NODE_RANK": str(n.rank),
                "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": gpus,
            }
        else:
            out |= {
                "SKYPILOT_NODE_IPS": ips,
                "SKYPILOT_NODE_RANK": str(n.rank),
                "SKYPILOT_NUM_GPUS_PER_NODE": gpus,
                "SKYPILOT_INTERNAL_JOB_ID": str(self.launches or 1),
            }
        return out

    def _script(self, n: Node, stage: str, extra: dict | None) -> str:
        """SkyPilot's task script wrapper (make_task_bash_script): ~/.bashrc, the user env, the workdir,
        the exports, then the task's own commands."""
        exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in self._env(n, stage, extra).items())
        return "\n".join(
            [
                "#!/bin/bash",
                "[ -f ~/.bashrc ] && source ~/.bashrc",
                "set -a",
                ". $(conda info --base 2> /dev/null)/etc/profile.d/conda.sh > /dev/null 2>&1 || true",
                "set +a",
                (
                    'export PATH=$(echo $PATH | sed "s|$(echo ~/skypilot-runtime)/bin:||") && unset VIRTUAL_ENV'
                    " && unset VIRTUAL_ENV_PROMPT"
                ),
                f'if [ -z "${{CONDA_PREFIX:-}}" ] && [ -f {USER_ENV}/bin/activate ]; then source {USER_ENV}/bin/activate; fi',
                "export PYTHONUNBUFFERED=1",
                f"cd {WORKDIR}",
                exports,
                self.task[stage],
                "",
            ]
        )

    def _login_env(self) -> dict[str, str]:
        return {
            "HOME": HOME,
            "USER": USER,
            "LOGNAME": USER,
            "SHELL": "/bin/bash",
            "LANG": "C.UTF-8",
            "PATH": BASE_PATH,
            "PIP_NO_INDEX": "1",
        }

    def _spawn(self, n: Node, stage: str | None, text: str, stdout) -> subprocess.Popen:
        """Run a script (stage: SkyPilot's `bash -i` on a file in the node's /tmp) or a command (stage None)
        as the cloud user inside node `n`."""
        if not n.alive:
            raise RuntimeError(f"node{n.rank} is not running")
        if stage is None:
            argv = ["/bin/bash", "-c", text]
        else:
            inside = f"/tmp/sky_{'setup' if stage == 'setup' else 'app'}_{os.urandom(4).hex()}"
            host = n.path(inside)
            host.write_text(text)
            os.chown(host, UID, GID)
            host.chmod(0o600)
            argv = ["/bin/bash", "-i", inside]
        spaces = ["--mount", "--uts", "--ipc", "--pid", *(["--net"] if self.netns else [])]
        # --root enters the node's chroot; --wdns (util-linux >= 2.38, Debian 12) is a path inside it
        cmd = [
            "nsenter",
            f"--target={n.init_pid}",
            *spaces,
            "--root",
            f"--wdns={HOME}",
            "--",
            "setpriv",
            f"--reuid={UID}",
            f"--regid={GID}",
            "--clear-groups",
            "--no-new-privs",
            "--",
            *argv,
        ]
        p = subprocess.Popen(
            cmd,
            env=self._login_env(),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            text=stdout is subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )  # noqa: PLW1509 - prctl works only in the child
        self._procs.append(p)
        return p

    # -------------------------------------------------- teardown

    def _halt(self, n: Node) -> None:
        """SIGKILL the node's PID 1: the kernel then kills every process in its PID namespace."""
        if n.init_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(n.init_pid, signal.SIGKILL)
        if n.unshare:
            # unshare reaps its PID 1 and exits; killing it first would leave that PID 1 a zombie under
            # this host's PID 1, which may never reap it. Killing unshare also kills PID 1 (--kill-child).
            try:
                n.unshare.wait(timeout=10)
            except subprocess.TimeoutExpired:
                n.unshare.kill()
                n.unshare.wait(timeout=10)
        n.alive = False

    def _assert_gone(self, timeout: float = 10) -> None:
        ns = self.namespaces()
        deadline = time.time() + timeout
        while True:
            left = {k: pids_in_namespaces(k, ids) for k, ids in ns.items()}
            left = {k: v for k, v in left.items() if v}
            if not left:
                return
            if time.time() > deadline:
                raise RuntimeError(f"processes survived destroy(): {left}")
            time.sleep(0.05)

    def _delete_node_dirs(self) -> None:
        """rm -rf of the nodes' disks, from this (the host's) mount namespace, where none of the nodes'
        bind mounts exist: a mount under it here would mean deleting the host's own files, so refuse."""
        nodes = self.nodes_dir
        if not nodes.exists():
            return
        prefix = str(nodes.resolve()) + "/"
        mounted = [
            ln.split()[4]
            for ln in Path("/proc/self/mountinfo").read_text().splitlines()
            if ln.split()[4].startswith(prefix)
        ]
        if mounted:
            raise RuntimeError(f"refusing to delete {nodes}: mounts below it: {mounted}")
        shutil.rmtree(nodes)
        with contextlib.suppress(OSError):
            nodes.parent.rmdir()  # the last set on this root leaves no nodes/ behind

    def _log_path(self, rank: int, launch: int) -> Path:
        return self.root / "logs" / f"node{rank}.{launch}.log"


def _write_user_env(path: Path, img: Image) -> None:
    """~/sky-user-env as SkyPilot 0.14 creates it on a VM (`uv venv --seed --system-site-packages` from the
    image's python3): writable, with the image's packages visible after its own. The image's site-packages
    is added with site.addsitedir so that its .pth files run, as a system site directory's would."""
    _write_venv(path, img.prefix, img.pyver)
    site = path / "lib" / img.pyver / "site-packages"
    (site / "_sky_system_site_packages.pth").write_text(
        f"import site; site.addsitedir('{IMAGE_AT}/lib/{img.pyver}/site-packages')\n"
    )
    for name in ("pip", "pip3"):  # pip itself comes from the image, as --seed would have put it here
        (path / "bin" / name).write_text(
            f"#!{USER_ENV}/bin/python\nimport sys\nfrom pip._internal.cli.main import main\nsys.exit(main())\n"
        )
        (path / "bin" / name).chmod(0o755)
    (path / "bin" / "activate").write_text(
        f"# the parts of venv's activate that a task script relies on\nVIRTUAL_ENV={USER_ENV}\nexport VIRTUAL_ENV\n"
        'PATH="$VIRTUAL_ENV/bin:$PATH"\nexport PATH\nunset PYTHONHOME\nhash -r 2>/dev/null\n'
    )


def destroy_all() -> None:
    """Destroy every node set still alive in this process (session end, atexit)."""
    for s in list(_LIVE):
        with contextlib.suppress(Exception):
            s.destroy()


atexit.register(destroy_all)


# ---------------------------------------------------------------- pytest fixtures (import them into a test module)

try:
    import pytest
except ImportError:  # usable without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="session")
    def sky_image(tmp_path_factory):
        """The VM image, built once per session (~0.2 s); every node set still alive at the end is destroyed."""
        with _host_lock():
            _sweep_stale_bridges()  # left by a session that was killed
        img = build_image(tmp_path_factory.mktemp("sky-image"))
        yield img
        destroy_all()
        save_torch_extensions(img)

    @pytest.fixture
    def sky_nodes(sky_image, tmp_path):
        """Factory: sky_nodes(task_dir, **kw) -> SkyNodes sharing this test's bucket root; all destroyed
        when the test ends, pass or fail."""
        made: list[SkyNodes] = []

        def make(task_dir, **kw) -> SkyNodes:
            kw.setdefault("root", tmp_path / "skynodes")
            kw.setdefault("image", sky_image)
            s = SkyNodes(task_dir, **kw)
            made.append(s)
            return s

        yield make
        errors = []
        for s in made:
            try:
                s.destroy()
            except Exception as e:  # noqa: BLE001 - destroy every set before reporting
                errors.append(e)
        if errors:
            raise errors[0]
