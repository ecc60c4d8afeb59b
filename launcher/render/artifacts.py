"""What `render` produces: files a user can run by hand, and a typed request saying how they are submitted.

Like TorchX's dry-run request (`submit_dryrun` -> `schedule(dryrun_info)`): rendering never submits, and a
target's backend submits exactly the request it is handed, without re-reading the files it describes.

The records (this one and each target's request, in launcher/targets/NAME/request.py) are msgspec structs
rather than dataclasses: `validate` imports this module, and a dataclass costs start-up (each one compiles its
methods), a struct next to nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import msgspec

from ..errors import DtlaunchError


class Request(Protocol):
    """How a rendered job is submitted: each target's request.py has its own (a frozen msgspec struct), which its
    backend submits as it is."""

    @property
    def entrypoint(self) -> str: ...  # the file the submission starts from (the script, job script or task)

    @property
    def argv(self) -> tuple[str, ...]: ...  # the same submission by hand, from the rendered directory


class Artifacts(msgspec.Struct):
    target: str
    job_name: str
    files: dict[str, str | bytes]  # relative path -> content
    request: Request
    executable: set[str] = msgspec.field(default_factory=set)
    notes: list[str] = msgspec.field(default_factory=list)

    @property
    def entrypoint(self) -> str:
        return self.request.entrypoint

    @property
    def submit_command(self) -> list[str]:
        return list(self.request.argv)

    def text(self, rel: str) -> str | None:
        content = self.files.get(rel)
        return content if isinstance(content, str) else None

    def write(self, out_dir: str | Path, origin: str = "render") -> Path:
        """Write all files into out_dir atomically per file: a reader sees the old set or the new one, never half.

        Files of an earlier render that this one does not produce (a sweep's task-N directories, a wheel of
        another version) are removed, so the directory holds exactly what `submit_command` will use.
        """
        out = Path(out_dir)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            if out.exists() and not out.is_dir():
                raise DtlaunchError(f"{out} exists and is not a directory", fix="pick another -o/--out directory")
            tmp = _scratch_dir(out)
        except OSError as e:
            raise DtlaunchError(
                f"cannot write into {out}: {e.strerror}", fix="pick a directory you can write to with -o/--out"
            ) from None
        try:
            for rel, content in self.files.items():
                p = tmp / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(content, bytes):
                    p.write_bytes(content)
                else:
                    p.write_text(content)
                if rel in self.executable:
                    p.chmod(0o755)
            out.mkdir(parents=True, exist_ok=True)
            previous, _ = read_manifest(out)
            for rel in self.files:
                dst = out / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp / rel, dst)
            for rel in sorted(previous - set(self.files), reverse=True):
                stale = out / rel
                if stale.is_file():
                    stale.unlink()
                    _prune_empty_dirs(stale.parent, out)
            _write_manifest(out, set(self.files), origin)
        except OSError as e:
            raise DtlaunchError(
                f"cannot write into {out}: {e.strerror}", fix="pick a directory you can write to with -o/--out"
            ) from None
        finally:
            _remove_scratch(tmp)
        return out


MANIFEST = ".dtlaunch-rendered"  # the files the last render wrote here (so the next one can remove stale ones)


def read_manifest(out: Path) -> tuple[set[str], str | None]:
    """(files, origin) of the last write into `out`: origin is "render" or "up", None if never written."""
    try:
        lines = (out / MANIFEST).read_text().splitlines()
    except OSError:
        return set(), None
    origin = (
        lines[0][len("# written by dtlaunch ") :].strip() if lines and lines[0].startswith("# written by") else None
    )
    files = {
        ln for ln in lines if ln and not ln.startswith("#") and ".." not in ln.split("/") and not ln.startswith("/")
    }
    return files, origin


def _write_manifest(out: Path, files: set[str], origin: str) -> None:
    (out / MANIFEST).write_text(f"# written by dtlaunch {origin}\n" + "".join(f"{rel}\n" for rel in sorted(files)))


def _scratch_dir(out: Path) -> Path:
    """A new private directory beside `out`, on its filesystem, so each file's os.replace into `out` is atomic."""
    import tempfile

    return Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))


def _remove_scratch(tmp: Path) -> None:
    """After a write, every file has moved out and only empty directories are left: rmdir them. Anything else
    (a write that failed half way) goes with shutil.rmtree, which never follows a link out of it."""
    try:
        for d, _, _ in os.walk(tmp, topdown=False):
            os.rmdir(d)
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _prune_empty_dirs(d: Path, stop: Path) -> None:
    while d != stop and d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent
