"""The targets: one package each (launcher/targets/NAME/), registered in one table, `TARGETS` (table.py).

A target's package holds everything about it, laid out the same way in every package:

    spec.py     its section of the recipe (`targets.NAME`), named in recipe/schema.py's TargetsSpec
    render.py   the renderer (`Renderer`): plan -> Artifacts, text only
    request.py  the request the renderer hands the backend, and the handle the job registry keeps
    backend.py  the backend (`Backend`): submits exactly the request, then follows the job
    rules.py    validate's rules for this target (`@rule(..., targets=("NAME",))`), loaded by launcher.validate
    templates/  its Jinja templates (launcher/render/templates holds the shared ones; the names are unique)

Its row names the renderer, the backend and the handle ("module:attribute" inside the package, imported
only when used, so the CLI reads this table without loading any target); heavy libraries are imported
inside the methods that need them. What targets share (the torchrun line, shell quoting, the job's
environment, the wheel, the Artifacts record) stays in launcher/render; the job registry is registry.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..errors import BackendError
from .table import TARGET_NAMES, TARGETS, TargetSpec, target

__all__ = [
    "TARGETS",
    "TARGET_NAMES",
    "TargetSpec",
    "target",
    "backend",
    "Renderer",
    "Backend",
    "JobStatus",
    "LIVE",
    "require_secrets",
]

if TYPE_CHECKING:
    from ..plan import Plan
    from ..plan.choices import Choices
    from ..recipe import Recipe
    from ..render.artifacts import Artifacts
    from .registry import JobRecord


# ----------------------------------------------------------------------------- what each target implements


class Renderer(Protocol):
    """Plan -> Artifacts for one target. Pure: returns text; writing and submitting happen elsewhere. `files` is
    what every target ships (render.common_files); `choices` the SkyPilot accelerator fallbacks (None elsewhere),
    with `plan` their shipped plan."""

    def __call__(
        self, recipe: Recipe, plan: Plan, files: dict[str, str | bytes], *, choices: Choices | None = None
    ) -> Artifacts: ...


# States in which a job still runs (or waits to), on any target: `down NAME` acts on such a job.
LIVE = frozenset(
    {
        "RUNNING",
        "STOPPING",
        "PENDING",
        "CONFIGURING",
        "COMPLETING",
        "REQUEUED",
        "RESIZING",
        "SUSPENDED",
        "INIT",
        "STARTING",
        "SETTING_UP",
        "RECOVERING",
        "CANCELLING",
        "SUBMITTED",
    }
)


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

    # The log as it is read: pieces of any size, not lines (the CLI makes lines where it counts them, as_lines).
    def logs(self, job: JobRecord, *, follow: bool) -> Iterator[str]: ...

    def cancel(self, job: JobRecord) -> str: ...

    # Where the job's training records are (metrics.jsonl, status/): the run directory, or the run inside it that
    # this job trains (a SLURM job's runs/RUN_ID/), so that jobs sharing a directory each read their own; None
    # while that is not known yet (the job has not started).
    def records_dir(self, job: JobRecord) -> str | None: ...


def backend(name: str) -> Backend:
    return target(name).load("backend")()


def require_secrets(names: Iterable[str], how: str) -> dict[str, str]:
    """The values of the recipe's secrets in this environment. A recipe names its secrets and never holds
    them; each target carries the values from where it submits (`how` says how, for the fix line), so a
    missing one is named here, before anything is submitted."""
    names = list(names)
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise BackendError(f"secret(s) {', '.join(missing)} not set in this shell", fix=f"export them first: {how}")
    return {n: os.environ[n] for n in names}
