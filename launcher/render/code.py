"""The user's code (entrypoint.workdir), copied into the rendered directory as `code/`.

A cluster node has none of the submitting machine's files, so the job carries a snapshot of the workdir the
same way on every target: the SkyPilot workdir (the rendered directory) uploads it, SLURM reads it from the
submit directory, an SSH submission uploads it with the rest. A snapshot also means a requeued or recovered
attempt runs the code that was submitted, not whatever the directory holds by then.

Only code belongs here: version-control data, caches, virtual environments and dtlaunch's own outputs are
left out, `entrypoint.exclude` leaves out more, and a workdir that is still too large is refused with its
largest files named (data and weights belong on shared storage, read by path).
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path, PurePosixPath

from ..errors import DtlaunchError
from ..recipe import Recipe

CODE_DIR = "code"
MAX_FILES = 5000
MAX_BYTES = 64 << 20
# Never shipped: version control, caches, environments, editor litter, and what dtlaunch itself writes
# (rendered jobs, local runs, checkpoints) in case the workdir is the directory it runs in.
ALWAYS_EXCLUDED_DIRS = {
    ".git",
    ".hg",
    ".svn",
    "__pycache__",
    ".venv",
    "venv",
    ".tox",
    ".nox",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".ipynb_checkpoints",
    "node_modules",
    "rendered",
    "runs",
    "checkpoints",
    "wandb",
}
ALWAYS_EXCLUDED_FILES = ("*.pyc", "*.pyo", ".DS_Store", "*.swp", ".dtlaunch-rendered")


def workdir(recipe: Recipe) -> Path | None:
    """The directory to ship, or None when the recipe has no entrypoint."""
    ep = recipe.entrypoint
    if ep is None:
        return None
    base = recipe.base_dir()
    if ep.workdir is None and base is None:
        raise DtlaunchError(
            "entrypoint: the recipe was not read from a file, so there is no directory to ship",
            fix="set entrypoint.workdir to the directory that holds the training code",
        )
    wd = Path(os.path.expanduser(ep.workdir or "."))
    if not wd.is_absolute():
        wd = Path(base or ".") / wd
    return wd.resolve()


def _excluded(rel: PurePosixPath, patterns: list[str]) -> bool:
    s = str(rel)
    return any(
        fnmatch.fnmatch(s, p) or fnmatch.fnmatch(rel.name, p) or s.startswith(p.rstrip("/") + "/") for p in patterns
    )


def collect(recipe: Recipe) -> dict[str, bytes]:
    """{"code/REL": bytes} for the workdir, or {} without an entrypoint. DtlaunchError names the field."""
    wd = workdir(recipe)
    if wd is None:
        return {}
    ep = recipe.entrypoint
    if not wd.is_dir():
        raise DtlaunchError(
            f"entrypoint.workdir: {wd} is not a directory",
            fix="point it at the directory that holds the training code (relative to the recipe file)",
        )
    patterns = list(ep.exclude) + list(ALWAYS_EXCLUDED_FILES)
    files: dict[str, bytes] = {}
    sizes: list[tuple[int, str]] = []
    total = 0
    for root, dirs, names in os.walk(wd, followlinks=False):
        here = PurePosixPath(Path(root).relative_to(wd).as_posix())
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in ALWAYS_EXCLUDED_DIRS
            and not d.endswith(".egg-info")
            and not _excluded(here / d, ep.exclude)
            and not (Path(root) / d).is_symlink()
        )
        for name in sorted(names):
            rel = here / name if str(here) != "." else PurePosixPath(name)
            path = Path(root) / name
            if _excluded(rel, patterns) or not path.is_file():  # sockets, fifos, dangling links
                continue
            size = path.stat().st_size
            total += size
            sizes.append((size, str(rel)))
            if len(sizes) > MAX_FILES:
                raise DtlaunchError(
                    f"entrypoint.workdir: {wd} holds more than {MAX_FILES:,} files",
                    fix="ship only the code: point workdir at the code's directory or add "
                    "entrypoint.exclude patterns (data and weights are read by path)",
                )
            if total > MAX_BYTES:
                largest = ", ".join(f"{r} ({s / 2**20:.1f} MiB)" for s, r in sorted(sizes, reverse=True)[:3])
                raise DtlaunchError(
                    f"entrypoint.workdir: {wd} holds more than {MAX_BYTES >> 20} MiB (largest: {largest})",
                    fix="leave data, weights and outputs out with entrypoint.exclude (the job reads "
                    "them by path from shared storage)",
                )
            try:
                files[f"{CODE_DIR}/{rel}"] = path.read_bytes()
            except OSError as e:
                raise DtlaunchError(
                    f"entrypoint.workdir: cannot read {path}: {e.strerror}",
                    fix="make it readable or add it to entrypoint.exclude",
                ) from None
    if ep.script is not None and f"{CODE_DIR}/{ep.script}" not in files:
        raise DtlaunchError(
            f"entrypoint.script: {ep.script} is not in {wd}"
            + (" (it is excluded)" if (wd / ep.script).is_file() else ""),
            fix="the script path is relative to entrypoint.workdir (default: the recipe's directory)",
        )
    return files
