"""The on-disk protocol of checkpoints: write, commit, verify, select, prune. No torch here.

A checkpoint is `step-XXXXXXXX/`. Every rank writes its own files straight into it (creating the directory
itself: nodes may not share one view of storage) and then a manifest of what it wrote, `manifest-rank-N.json`
(each file's size and CRC-32). When every rank is done, rank 0 writes `meta.json` and, last, the `COMPLETE`
marker. Nothing is ever renamed: on the object-store mounts clouds use for checkpoints a rename is a copy,
and another node's files may not be visible yet from rank 0's node, so a rename-based commit could move
half a checkpoint. Readers only consider directories with the marker, and only trust one whose manifests
account for every file with the right size and checksum; one that fails gets a `CORRUPT` note with the
reason and is never chosen (nor deleted) again. Only a proven difference (a size, a checksum, a step that
disagrees with the directory's name) is damage: a read that fails (EIO, ESTALE, ENOENT on a lagging network
mount) is retried, then ends the attempt with StorageError, marking nothing.

Nothing here follows a symbolic link inside the checkpoint root: a linked step directory may be another
run's checkpoint, and pruning through it once destroyed that run's newest one.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import shutil
import sys
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

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
    """The step directories of `root`, oldest first; linked ones are not ours and not listed (linked_steps)."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and not p.is_symlink() and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def linked_steps(root: Path) -> list[Path]:
    """Step directories that are symbolic links: never read, written or deleted through."""
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.iterdir() if (_STEP_DIR.match(p.name) or _LEGACY_TMP.match(p.name)) and p.is_symlink()
    )


def complete_steps(root: Path) -> list[int]:
    """Committed checkpoints that have not been found corrupt, oldest first."""
    return [s for s, p in _steps(root) if is_complete(p) and not is_corrupt(p)]


def corrupt_steps(root: Path) -> list[int]:
    return [s for s, p in _steps(root) if is_corrupt(p)]


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
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep the half-written copy (its space, its name)
        raise
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
    """Mark `step-N/` complete: meta.json (with the world size whose manifests a reader expects), marker last.
    The marker records its step and meta.json's size and CRC-32: meta.json holds the step and data position a
    resume trusts, so it is checked like every other file (meta_problems)."""
    path = step_path(root, step)
    data = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
    write_file_durably(path / META, data)
    marker = {"step": step, "time": time.time(), "meta_size": len(data), "meta_crc32": zlib.crc32(data)}
    write_file_durably(path / MARKER, json.dumps(marker).encode())
    return path


def read_meta(path: Path) -> dict:
    return json.loads((path / META).read_text())


# ----------------------------------------------------------------------------- reads that may fail

# A read of storage that fails is retried this many times, this many seconds apart (a network mount that lags
# behind another node's write, or a transient EIO), before the attempt ends with StorageError.
READ_TRIES = 4
READ_RETRY_S = 2.0
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT}


def storage_error(message: str, fix: str):
    from ..failures import StorageError

    return StorageError(message, fix=fix)


def reading(what: str, path: Path, read: Callable[[], T], *, tries: int | None = None) -> T:
    """`read()`, retried on OSError; still failing: StorageError naming the file (nothing is marked)."""
    tries = READ_TRIES if tries is None else tries
    for i in range(tries):
        try:
            return read()
        except OSError as e:
            if i == tries - 1:
                raise storage_error(
                    f"cannot read {what} {path} ({e.strerror or e}), {tries} tries "
                    f"{READ_RETRY_S:g}s apart; the checkpoint was not marked or changed",
                    "check the storage (a network mount that lags, a failing disk), then run "
                    "again: the same checkpoint is tried first",
                ) from None
            time.sleep(READ_RETRY_S)
    raise AssertionError("unreachable")


def exception_chain(exc: BaseException | None):
    """`exc`, its causes and contexts, and (for torch's CheckpointException, which gathers every rank's
    failure) each rank's own exception."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # rank -> the exception, or (exception, traceback)
        if isinstance(failures, dict):
            for f in failures.values():
                todo += [x for x in (f if isinstance(f, tuple) else (f,)) if isinstance(x, BaseException)]


def storage_full(exc: BaseException | None) -> OSError | None:
    """The ENOSPC/EROFS/EDQUOT OSError in `exc`'s chain, if any: full and read-only storage say so instead of
    hiding behind the writer's own error."""
    return next((e for e in exception_chain(exc) if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS), None)


def tree_bytes(path: Path) -> int:
    """Bytes in the files under `path` (links not followed)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


# ----------------------------------------------------------------------------- verification


def meta_problems(path: Path) -> list[str]:
    """meta.json and the marker agree with the directory's name, and meta.json is as committed (its size and
    CRC-32 in the marker; markers of older versions do not record them, and their step is still compared)."""
    name = _STEP_DIR.match(path.name)
    assert name is not None, f"{path} is not a step directory"
    step = int(name.group(1))
    marker_bytes = reading("the commit marker", path / MARKER, (path / MARKER).read_bytes)
    data = reading("the metadata", path / META, (path / META).read_bytes)
    problems = []
    try:
        marker = json.loads(marker_bytes)
        if int(marker["step"]) != step:
            problems.append(f"{MARKER} names step {marker['step']}, not {step}")
        if "meta_crc32" in marker and (len(data), zlib.crc32(data)) != (marker["meta_size"], marker["meta_crc32"]):
            problems.append(
                f"{META} has changed since it was committed ({len(data):,} bytes, CRC-32 "
                f"{zlib.crc32(data):08x}; committed as {marker['meta_size']:,} bytes, "
                f"{marker['meta_crc32']:08x})"
            )
    except (ValueError, KeyError, TypeError) as e:
        problems.append(f"{MARKER} is unreadable ({type(e).__name__}: {e})")
    try:
        meta_step = int(json.loads(data)["step"])
    except (ValueError, KeyError, TypeError) as e:
        return problems + [f"{META} is unreadable ({type(e).__name__}: {e})"]
    if meta_step != step:
        problems.append(f"{META} says step {meta_step}, but the directory is step {step}")
    return problems


def expected_files(path: Path) -> tuple[dict[str, dict], list[str]]:
    """(every file the manifests list, problems): a manifest that is missing (after retries) or does not parse
    is a problem; a read that keeps failing is StorageError (see `reading`)."""
    problems = []
    try:
        world = int(json.loads(reading("the metadata", path / META, (path / META).read_bytes))["world_size"])
    except (ValueError, KeyError, TypeError) as e:
        return {}, [f"{META} is unreadable ({type(e).__name__}: {e})"]
    files: dict[str, dict] = {}
    for rank in range(world):
        f = path / manifest_name(rank)
        try:
            m = json.loads(reading(f"rank {rank}'s manifest", f, f.read_bytes))
            files.update(m["files"])
        except (ValueError, KeyError, TypeError) as e:
            problems.append(f"rank {rank}'s manifest is unreadable ({type(e).__name__})")
    return files, problems


def size_problems(path: Path) -> list[str]:
    """What a stat can tell: every listed file exists with the size it was written with."""
    files, problems = expected_files(path)
    for rel, info in sorted(files.items()):
        f = path / rel
        size = reading("the checkpoint file", f, f.stat).st_size
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
        crc = reading("the checkpoint file", path / rel, functools.partial(crc32_of, path / rel))
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


def _remove(p: Path, problems: list[str]) -> bool:
    """Delete the real directory `p` (rmtree refuses a link and follows none inside); True if it is gone,
    else why not goes to `problems`."""
    errors: list[str] = []

    def note(_fn, path, err):
        e = err[1] if isinstance(err, tuple) else err  # onerror passes exc_info, onexc the exception
        errors.append(f"{path}: {getattr(e, 'strerror', None) or e}")

    if sys.version_info >= (3, 12):
        shutil.rmtree(p, onexc=note)
    else:
        shutil.rmtree(p, onerror=note)
    if p.exists() or p.is_symlink():
        problems.append(f"could not remove {p.name}: {'; '.join(errors[:3]) or 'still there'}")
        return False
    return True


def prune(root: Path, keep: int, problems: list[str] | None = None) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints; never the newest one whose files all check out
    by size (an unverifiable newer one does not count), never a corrupt one, never a linked one. Also delete
    uncommitted directories older than the newest committed one (dead attempts). Returns what was removed;
    what could not be is added to `problems`."""
    problems = [] if problems is None else problems
    removed: list[Path] = []
    steps = complete_steps(root)
    doomed = steps[:-keep] if keep > 0 else steps
    for s in reversed(steps):
        try:
            bad = size_problems(step_path(root, s))
        except Exception as e:  # noqa: BLE001 - unreadable now: keep it, and everything older than it stays too
            problems.append(f"not pruning: {e}")
            return removed
        if not bad:
            if s in doomed:
                doomed.remove(s)  # the newest verified checkpoint always stays
            break
    for s in doomed:
        p = step_path(root, s)
        (p / MARKER).unlink(missing_ok=True)  # unmark first: a crash mid-delete leaves garbage, not a false "complete"
        if _remove(p, problems):
            removed.append(p)
    newest = steps[-1] if steps else None
    for s, p in _steps(root):
        if not is_complete(p) and newest is not None and s < newest and _remove(p, problems):
            removed.append(p)
    for p in linked_steps(root):
        problems.append(f"left {p.name} alone: it is a symbolic link (to {os.readlink(p)}), never followed")
    return removed


def partial_dirs(root: Path) -> list[Path]:
    """Uncommitted step directories (and the old protocol's step-N.tmp), links excluded."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if not p.is_symlink()
        and p.is_dir()
        and (_LEGACY_TMP.match(p.name) or (_STEP_DIR.match(p.name) and not is_complete(p)))
    )


def clean_partials(root: Path, problems: list[str] | None = None) -> list[Path]:
    """At start-up no save can be in flight: every uncommitted directory is garbage."""
    problems = [] if problems is None else problems
    return [p for p in partial_dirs(root) if _remove(p, problems)]


def expand_dir(template: str | None, run_dir: Path, run_id: str | None) -> Path:
    """recipe.checkpoint.dir with `{run_id}` filled in; RUN_DIR/checkpoints when unset."""
    if not template:
        return run_dir / "checkpoints"
    if "{run_id}" in template:
        if not run_id:
            from ..failures import ConfigError

            raise ConfigError(
                f"checkpoint.dir {template!r} uses {{run_id}} but DTLAUNCH_RUN_ID is not set",
                fix="launch through dtlaunch (it sets DTLAUNCH_RUN_ID), or export it",
            )
        template = template.replace("{run_id}", run_id)
    return Path(os.path.expanduser(template))
