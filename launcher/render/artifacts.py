"""What `render` produces: files a user can run by hand, and a typed request saying how they are submitted.

Like TorchX's dry-run request (`submit_dryrun` -> `schedule(dryrun_info)`): rendering never submits, and a
target's backend submits exactly the request it is handed, without re-reading the files it describes.

The records are msgspec structs rather than dataclasses: `validate` imports this module, and five dataclasses
cost it ~2 ms of start-up (each one compiles its methods), structs next to nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from ..errors import DtlaunchError

if TYPE_CHECKING:
    from ..recipe import SlurmTarget


class LocalRequest(msgspec.Struct, frozen=True):
    script: str  # run with bash in the run directory
    secrets: tuple[str, ...] = ()

    @property
    def argv(self) -> tuple[str, ...]:
        return ("bash", self.script)


class SubmititSpec(msgspec.Struct, frozen=True):
    """Everything `targets.slurm.submit: submitit` hands to submitit, decided at render time (plain data, so
    rendering never imports submitit, and `up` submits exactly what `render` wrote to submitit.json).

    Paths are relative to the rendered directory; the submitting side makes them absolute, because submitit
    runs sbatch from the caller's working directory, not from the rendered one.
    """

    folder: str  # submitit's own directory: pickles, the generated batch script, the job's log
    setup_script: str  # the batch preamble; submitit's `setup` sources it before `exec python`
    python: str  # the batch script's command for submitit's interpreter (a shell word list, not a path)
    max_num_timeout: int  # submitit's cap on requeues after a signal it counts as a time-out
    parameters: Mapping[str, Any]  # SlurmExecutor.update_parameters(**parameters), besides `setup`
    step: Mapping[str, Any]  # the job-side callable's settings (launcher.targets.submitit_job.StepJob)

    def to_json(self) -> str:
        return (
            json.dumps(
                {
                    "folder": self.folder,
                    "setup_script": self.setup_script,
                    "python": self.python,
                    "max_num_timeout": self.max_num_timeout,
                    "parameters": dict(self.parameters),
                    "step": dict(self.step),
                },
                indent=2,
            )
            + "\n"
        )

    @classmethod
    def from_json(cls, text: str) -> SubmititSpec:
        d = json.loads(text)
        return cls(d["folder"], d["setup_script"], d["python"], int(d["max_num_timeout"]), d["parameters"], d["step"])


class SlurmRequest(msgspec.Struct, frozen=True):
    job_script: str  # sbatch: the job script; submitit: its request file (submitit.json)
    settings: SlurmTarget  # how to reach the cluster (ssh), how to submit (sbatch or submitit)
    array: bool = False
    secrets: tuple[str, ...] = ()
    submit: Literal["sbatch", "submitit"] = "sbatch"
    submitit: SubmititSpec | None = None  # set iff submit == "submitit"

    @property
    def argv(self) -> tuple[str, ...]:
        if self.submit == "submitit":  # the same submission `up` makes, from the rendered directory
            return ("python3", "-m", "launcher.targets.submitit_job", ".")
        return ("sbatch", "--parsable", self.job_script)


class SkyRequest(msgspec.Struct, frozen=True):
    task_file: str
    cluster: str  # the cluster name (sky launch) or the managed job's name
    managed: bool
    secrets: tuple[str, ...] = ()

    @property
    def argv(self) -> tuple[str, ...]:
        secrets = tuple(a for name in self.secrets for a in ("--secret", name))
        if self.managed:
            return ("sky", "jobs", "launch", "-n", self.cluster, *secrets, self.task_file)
        return ("sky", "launch", "-c", self.cluster, *secrets, self.task_file)


Request = LocalRequest | SlurmRequest | SkyRequest


class Artifacts(msgspec.Struct):
    target: str
    job_name: str
    files: dict[str, str | bytes]  # relative path -> content
    request: Request
    executable: set[str] = msgspec.field(default_factory=set)
    notes: list[str] = msgspec.field(default_factory=list)

    @property
    def entrypoint(self) -> str:
        r = self.request
        return r.script if isinstance(r, LocalRequest) else r.job_script if isinstance(r, SlurmRequest) else r.task_file

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
