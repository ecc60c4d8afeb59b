"""The on-disk protocol that makes checkpoints atomic: write, commit, select, prune. No torch here.

A checkpoint is written into `step-XXXXXXXX.tmp/`; rank 0 then fsyncs it, renames it to
`step-XXXXXXXX/`, and writes the `COMPLETE` marker last. Readers only ever choose directories that
hold the marker, so a job killed at any moment leaves at worst an ignored partial directory.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Optional

MARKER = "COMPLETE"
META = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_DIR = re.compile(r"^step-(\d{8,})\.tmp$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_path(root: Path, step: int) -> Path:
    return root / (step_name(step) + ".tmp")


def final_path(root: Path, step: int) -> Path:
    return root / step_name(step)


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def complete_steps(root: Path) -> list[int]:
    """Steps of the committed checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and is_complete(p):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_complete(root: Path) -> Optional[int]:
    steps = complete_steps(root)
    return steps[-1] if steps else None


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries - renames - durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            fsync_path(Path(dirpath) / f)
        fsync_path(Path(dirpath))


def write_file_durably(path: Path, data: bytes) -> None:
    """Write `path` via a temporary sibling and a rename, fsyncing both: never a torn file."""
    tmp = path.with_name(path.name + f".{os.getpid()}.partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def commit(root: Path, step: int, meta: dict) -> Path:
    """Turn `step-N.tmp/` into a committed `step-N/`: meta, fsync, rename, marker last."""
    tmp, final = tmp_path(root, step), final_path(root, step)
    write_file_durably(tmp / META, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
    fsync_tree(tmp)
    if final.exists():  # a previous attempt renamed but died before the marker: it was never valid
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)
    write_file_durably(final / MARKER, json.dumps({"step": step, "time": time.time()}).encode())
    return final


def prune(root: Path, keep: int, in_flight: Optional[int] = None) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints, and partial leftovers older than the
    newest committed one (never the save in flight)."""
    removed = []
    steps = complete_steps(root)
    for s in steps[:-keep] if keep > 0 else steps:
        p = final_path(root, s)
        # Unmark first: a crash mid-delete must not leave a 'complete' checkpoint with files missing.
        (p / MARKER).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    newest = steps[-1] if steps else None
    if root.is_dir():
        for p in root.iterdir():
            m = _TMP_DIR.match(p.name) or _STEP_DIR.match(p.name)
            if not m or not p.is_dir() or is_complete(p):
                continue
            s = int(m.group(1))
            if s == in_flight:
                continue
            if newest is not None and s <= newest:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def clean_partials(root: Path) -> list[Path]:
    """At start-up no save can be in flight: every uncommitted directory is garbage."""
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if (_TMP_DIR.match(p.name) or _STEP_DIR.match(p.name)) and p.is_dir() and not is_complete(p):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def read_meta(path: Path) -> dict:
    return json.loads((path / META).read_text())


def expand_dir(template: Optional[str], run_dir: Path, run_id: Optional[str]) -> Path:
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
