"""Backends: each takes rendered artifacts and submits exactly their request, then follows the job.

One small module per target implementing `Backend`; heavy libraries are imported inside their methods.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..errors import BackendError, DtlaunchError
from ..strategies import TARGET_NAMES, TARGETS, TargetName, load_attr

if TYPE_CHECKING:
    from ..render.artifacts import Artifacts
    from .registry import JobRecord


# How a SLURM job gets its secrets' values, whichever way it is submitted (sbatch, or submitit's sbatch).
SLURM_SECRETS = "sbatch passes the submitting shell's environment to the job (--export=ALL)"


def require_secrets(names: Iterable[str], how: str) -> dict[str, str]:
    """The values of the recipe's secrets in this environment. A recipe names its secrets and never holds
    them; each target carries the values from where it submits (`how` says how, for the fix line), so a
    missing one is named here, before anything is submitted."""
    names = list(names)
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise BackendError(f"secret(s) {', '.join(missing)} not set in this shell", fix=f"export them first: {how}")
    return {n: os.environ[n] for n in names}


@dataclass
class JobStatus:
    state: str
    exit_code: int | None = None
    detail: str | None = None
    extra: dict = field(default_factory=dict)  # what a target knows beyond the state (ledgers, source)

    def to_dict(self) -> dict:
        return {"state": self.state, "exit_code": self.exit_code, "detail": self.detail, **self.extra}


class Backend(Protocol):
    name: str

    def submit(self, artifacts: Artifacts, out_dir: str) -> JobRecord: ...

    def wait(self, job: JobRecord) -> int: ...

    def status(self, job: JobRecord) -> JobStatus: ...

    def logs(self, job: JobRecord, *, follow: bool) -> Iterator[str]: ...

    def cancel(self, job: JobRecord) -> str: ...


def backend(name: str) -> Backend:
    if name not in TARGET_NAMES:
        raise DtlaunchError(f"unknown target {name!r}", fix=f"use one of {', '.join(TARGET_NAMES)}")
    return load_attr(TARGETS[TargetName(name)].backend)()
