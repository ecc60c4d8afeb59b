"""What a local submission passes on: the request render hands the backend, and the handle the registry keeps."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class LocalRequest(msgspec.Struct, frozen=True):
    script: str  # run with bash in the run directory
    secrets: tuple[str, ...] = ()

    @property
    def entrypoint(self) -> str:
        return self.script

    @property
    def argv(self) -> tuple[str, ...]:
        return ("bash", self.script)


@dataclass(frozen=True)
class LocalHandle:
    pid: int  # launch.sh
    create_time: float  # its start time (wall clock): identifies it where start_id is None (old rows, not Linux)
    attempt: str  # DTLAUNCH_ATTEMPT: marks every process of the job in its environment
    log: str
    exit_file: str
    # "<boot id>:<start in clock ticks>" from /proc: a wall-clock step moves create_time, never this; and a reused
    # pid never matches it. Rows written before it existed decode with None.
    start_id: str | None = None
