"""Backends: each takes rendered artifacts and submits them, then follows the job.

One small module per target implementing `Backend`; heavy libraries are imported inside their methods.
"""
from __future__ import annotations

from typing import Iterator, Protocol

from ..errors import DtlaunchError
from ..render.artifacts import Artifacts
from .registry import JobRecord


class Backend(Protocol):
    name: str

    def submit(self, artifacts: Artifacts, out_dir: str, *, wait: bool) -> JobRecord: ...

    def status(self, job: JobRecord) -> dict: ...

    def logs(self, job: JobRecord, *, follow: bool) -> Iterator[str]: ...

    def cancel(self, job: JobRecord) -> None: ...


def backend(name: str, **options) -> Backend:
    if name == "local":
        from .local import LocalBackend

        return LocalBackend(**options)
    if name == "slurm":
        from .slurm import SlurmBackend

        return SlurmBackend(**options)
    if name == "sky":
        from .sky import SkyBackend

        return SkyBackend(**options)
    raise DtlaunchError(f"unknown target {name!r}; use local, slurm or sky")
