"""The on-disk protocol of checkpoints: write, commit, verify, select, prune. No torch here.

A checkpoint is `step-XXXXXXXX/`. Every rank writes its own files straight into it (creating the directory
itself: nodes may not share one view of storage) and then a manifest of what it wrote, `manifest-rank-N.json`
(each file's size and CRC-32). When every rank is done, rank 0 writes `meta.json` and, last, the `COMPLETE`
marker. Nothing is ever renamed: on the object-store mounts clouds use for checkpoints a rename is a copy,
and another node's files may not be visible yet from rank 0's node, so a rename-based commit could move
half a checkpoint. Readers only consider directories with the marker, and only trust one whose manifests
account for every file with the right size and checksum; one that fails gets a `CORRUPT` note with the
reason and is never chosen (nor deleted) again.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Iterable
from pathlib import Path

MARKER = "COMPLETE"
CORRUPT = "CORRUPT"
META = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_LEGACY_TMP = re.compile(r"^step-(\d{8,})\.tmp$")  # the rename-based protocol of dtlaunch <= 0.1 (always garbage now)
_MANIFEST = re.compile(r"^manifest-rank-(\d{5})\.json$")
_CHUNK = 8 << 20


STEP_PREFIX = "step-"  # the job scripts find committed checkpoints by it, MARKER and CORRUPT (no Python there)


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def newest_step(root: Path) -> int:
    """The newest committed, uncorrupted checkpoint's step, 0 without one."""
    steps = complete_steps(Path(root))
    return steps[-1] if steps else 0


def step_path(root: Path, step: int) -> Path:
    return root / step_name(step)


def manifest_name(rank: int) -> str:
    return f"manifest-rank-{rank:05d}.json"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def is_corrupt(path: Path) -> bool:
    return (path / CORRUPT).is_file()


def _steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def complete_steps(root: Path) -> list[int]:
    """Committed checkpoints that have not been found corrupt, oldest first."""
    return [s for s, p in _steps(root) if is_complete(p) and not is_corrupt(p)]


def corrupt_steps(root: Path) -> list[int]:
    return [s for s, p in _steps(root) if is_corrupt(p)]


def latest_complete(root: Path) -> int | None:
    steps = complete_steps(root)
    return steps[-1] if steps else None


# ----------------------------------------------------------------------------- durable writes


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    """Write `path` via a temporary sibling and a rename, fsyncing both: never a torn file.
    (A single small file's rename is fine everywhere; it is whole directories that must not be renamed.)"""
    tmp = path.with_name(path.name + f".{os.getpid()}.partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


# ----------------------------------------------------------------------------- what each rank wrote


_DCP_DATA = re.compile(r"^__(\d+)_\d+\.distcp$")  # torch.distributed.checkpoint: one file per rank (and thread)
_RNG = re.compile(r"^rng-(\d{5})\.pt$")
_DS_RANK = re.compile(r"zero_pp_rank_(\d+)_")  # DeepSpeed: per data-parallel rank
_RANK0 = {".metadata", "trainer.pt"}  # DCP's index, our scheduler/scaler state
_DS_RANK0 = re.compile(r"^mp_rank_\d+_model_states\.pt$")  # DeepSpeed ZeRO-1/2: weights, written by rank 0


def owner(name: str) -> int | None:
    """The rank that writes a checkpoint file, by the names torch DCP, DeepSpeed and dtlaunch give them."""
    for pattern in (_DCP_DATA, _RNG, _DS_RANK):
        m = pattern.search(name) if pattern is _DS_RANK else pattern.match(name)
        if m:
            return int(m.group(1))
    if name in _RANK0 or _DS_RANK0.match(name):
        return 0
    return None


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(path: Path, rank: int, written: dict[str, tuple[int, int]] | None = None) -> dict:
    """Record the size and CRC-32 of every file `rank` wrote into checkpoint `path` (durably, last).

    `written` maps a file's name to the (size, CRC-32) of the bytes the writer handed it, computed as they
    were written; a file it does not cover, or whose size on disk differs, is read back instead."""
    written = written or {}
    files = {}
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path).as_posix()
        if f.is_file() and owner(f.name) == rank and not rel.endswith(".partial"):
            size = f.stat().st_size
            known = written.get(rel)
            files[rel] = {"size": size, "crc32": known[1] if known and known[0] == size else crc32_of(f)}
    manifest = {"rank": rank, "files": files, "time": time.time()}
    write_file_durably(path / manifest_name(rank), json.dumps(manifest, sort_keys=True).encode())
    return manifest


def commit(root: Path, step: int, meta: dict) -> Path:
    """Mark `step-N/` complete: meta.json (with the world size whose manifests a reader expects), marker last."""
    path = step_path(root, step)
    write_file_durably(path / META, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
    write_file_durably(path / MARKER, json.dumps({"step": step, "time": time.time()}).encode())
    return path


def read_meta(path: Path) -> dict:
    return json.loads((path / META).read_text())


# ----------------------------------------------------------------------------- verification


def expected_files(path: Path) -> tuple[dict[str, dict], list[str]]:
    """(every file the manifests list, problems): a manifest missing or unreadable is a problem."""
    problems = []
    try:
        world = int(read_meta(path)["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {}, [f"{META} is unreadable ({type(e).__name__}: {e})"]
    files: dict[str, dict] = {}
    for rank in range(world):
        try:
            m = json.loads((path / manifest_name(rank)).read_text())
            files.update(m["files"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"rank {rank}'s manifest is missing or unreadable ({type(e).__name__})")
    return files, problems


def size_problems(path: Path) -> list[str]:
    """What a stat can tell: every listed file exists with the size it was written with."""
    files, problems = expected_files(path)
    for rel, info in sorted(files.items()):
        f = path / rel
        try:
            size = f.stat().st_size
        except OSError:
            problems.append(f"{rel} is missing")
            continue
        if size != info["size"]:
            problems.append(f"{rel} is {size:,} bytes, written as {info['size']:,}")
    return problems


def crc_problems(path: Path, names: Iterable[str]) -> list[str]:
    """What the checksums tell, for the files `names` (each rank checks a share of them at resume)."""
    files, _ = expected_files(path)
    out = []
    for rel in names:
        info = files.get(rel)
        if info is None:
            continue
        try:
            crc = crc32_of(path / rel)
        except OSError as e:
            out.append(f"{rel} cannot be read ({e.strerror})")
            continue
        if crc != info["crc32"]:
            out.append(f"{rel} has changed since it was written (CRC-32 {crc:08x}, written as {info['crc32']:08x})")
    return out


def mark_corrupt(path: Path, reason: str) -> None:
    """Never chosen again, never deleted by dtlaunch: a person may want to look at it."""
    write_file_durably(path / CORRUPT, (json.dumps({"reason": reason, "time": time.time()}) + "\n").encode())


def set_aside(path: Path) -> Path:
    """Move a corrupt checkpoint out of the way of a new save of the same step, never deleting it."""
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    os.rename(path, aside)
    return aside


# ----------------------------------------------------------------------------- cleaning


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints; never the newest one whose files all check out
    by size (an unverifiable newer one does not count), never a corrupt one. Also delete uncommitted
    directories older than the newest committed one (dead attempts)."""
    removed = []
    steps = complete_steps(root)
    doomed = steps[:-keep] if keep > 0 else steps
    for s in reversed(steps):
        if not size_problems(step_path(root, s)):
            if s in doomed:
                doomed.remove(s)  # the newest verified checkpoint always stays
            break
    for s in doomed:
        p = step_path(root, s)
        (p / MARKER).unlink(missing_ok=True)  # unmark first: a crash mid-delete leaves garbage, not a false "complete"
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    newest = steps[-1] if steps else None
    for s, p in _steps(root):
        if not is_complete(p) and newest is not None and s < newest:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def clean_partials(root: Path) -> list[Path]:
    """At start-up no save can be in flight: every uncommitted directory is garbage."""
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if (_LEGACY_TMP.match(p.name) or (m and not is_complete(p))) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def expand_dir(template: str | None, run_dir: Path, run_id: str | None) -> Path:
    """recipe.checkpoint.dir with `{run_id}` filled in; RUN_DIR/checkpoints when unset."""
    if not template:
        return run_dir / "checkpoints"
    if "{run_id}" in template:
        if not run_id:
            from .failures import ConfigError

            raise ConfigError(f"checkpoint.dir {template!r} uses {{run_id}} but DTLAUNCH_RUN_ID is not set",
                              fix="launch through dtlaunch (it sets DTLAUNCH_RUN_ID), or export it")
        template = template.replace("{run_id}", run_id)
    return Path(os.path.expanduser(template))
