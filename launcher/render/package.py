"""dtlaunch as a wheel, built from the installation that renders a job, so the job can install it offline.

A cloud node must run the same dtlaunch that planned its job (the plan format and the job scripts are
that version's), and dtlaunch is not on any package index: `pip install dtlaunch` there would fail, or
worse, install someone else's package of that name. So `render` packs the installed package into a
standard wheel next to the job's files. The wheel is repacked from the installed files and metadata (a
regular or an editable install), needs no build tools, and is byte-for-byte reproducible for the same
code (fixed timestamps, sorted entries).
"""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

from ..errors import DtlaunchError
from ..version import __version__

DIST = "dtlaunch"
PACKAGE = "launcher"
_EPOCH = (1980, 1, 1, 0, 0, 0)
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = {".pyc", ".pyo"}


def wheel_name() -> str:
    return f"{DIST}-{__version__}-py3-none-any.whl"


def image_requirements(extra: str = "train", provided: tuple[str, ...] = ("torch",)) -> list[str]:
    """What a job whose image brings torch installs beside the wheel (`pip install --no-deps`): dtlaunch's own
    dependencies and those of `extra`, as this installation's metadata states them (pyproject.toml is their one
    home), without what the image provides. Installing the wheel with its dependencies would let pip replace
    the image's torch with the package index's build (gigabytes per node and per recovery, and the extensions
    built against the image's torch would break); the runtime's check names the torch it needs instead."""
    from importlib import metadata

    out = []
    for req in metadata.requires(DIST) or []:
        spec, _, marker = req.partition(";")
        name = re.split(r"[<>=!~\[( ]", spec.strip(), maxsplit=1)[0].lower()
        marker = marker.replace("'", '"').replace(" ", "")
        if name in provided or (marker and marker != f'extra=="{extra}"'):
            continue
        out.append(spec.strip())
    return out


def _package_files() -> list[tuple[str, bytes]]:
    root = Path(__file__).resolve().parent.parent  # the launcher package
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_dir() or _SKIP_DIRS & set(rel.parts) or p.suffix in _SKIP_SUFFIXES:
            continue
        out.append((f"{PACKAGE}/{rel.as_posix()}", p.read_bytes()))
    return out


def _dist_info() -> list[tuple[str, bytes]]:
    from importlib import metadata  # only `render` and `up` build a wheel, not `validate`

    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        raise DtlaunchError(
            "dtlaunch is not installed as a package, so its wheel cannot be built for the job",
            fix="install it (pip install -e . in the source tree, or pip install dtlaunch)",
        ) from None
    meta = dist.read_text("METADATA") or dist.read_text("PKG-INFO")  # an egg-info (source tree) has PKG-INFO
    if not meta:
        raise DtlaunchError("the installed dtlaunch has no METADATA", fix="reinstall dtlaunch")
    info = f"{DIST}-{__version__}.dist-info"
    files = [
        (f"{info}/METADATA", meta.encode()),
        (
            f"{info}/WHEEL",
            b"Wheel-Version: 1.0\nGenerator: dtlaunch render\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        ),
    ]
    entry_points = dist.read_text("entry_points.txt")
    if entry_points:
        files.append((f"{info}/entry_points.txt", entry_points.encode()))
    return files


def build_wheel() -> bytes:
    """The wheel's bytes (PEP 427: the files, the .dist-info, and a RECORD of their sha256 digests)."""
    import hashlib  # with zipfile: only a render that ships a wheel builds one
    import zipfile

    entries = _package_files() + _dist_info()
    record_path = f"{DIST}-{__version__}.dist-info/RECORD"
    lines = []
    for path, data in entries:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{path},sha256={digest},{len(data)}")
    lines.append(f"{record_path},,")
    entries.append((record_path, ("\n".join(lines) + "\n").encode()))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path, data in entries:
            zi = zipfile.ZipInfo(path, date_time=_EPOCH)
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = 0o644 << 16
            zf.writestr(zi, data)
    return buf.getvalue()


def installed_version(dist: str) -> str | None:
    """The version of a distribution installed here, without importing it (DeepSpeed takes seconds to import)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
