"""What a SkyPilot submission passes on: the request render hands the backend, and the handle the registry keeps."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class SkyRequest(msgspec.Struct, frozen=True):
    task_file: str
    cluster: str  # the cluster name (sky launch) or the managed job's name
    managed: bool
    secrets: tuple[str, ...] = ()

    @property
    def entrypoint(self) -> str:
        return self.task_file

    @property
    def argv(self) -> tuple[str, ...]:
        secrets = tuple(a for name in self.secrets for a in ("--secret", name))
        if self.managed:
            return ("sky", "jobs", "launch", "-n", self.cluster, *secrets, self.task_file)
        return ("sky", "launch", "-c", self.cluster, *secrets, self.task_file)


@dataclass(frozen=True)
class SkyHandle:
    cluster: str
    managed: bool
    job_id: int
