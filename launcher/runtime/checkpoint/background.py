"""What a Checkpointer runs beside training: the async save in flight, and pruning on its own thread."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import disk


@dataclass
class Pending:
    """An async save in flight (at most one): committed once every rank's manifest is visible."""

    step: int
    future: Future
    meta: dict
    t0: float
    writer: Any = None
    manifest: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    committed: bool = False
    stalled: float = 0.0  # how long save() held training: the previous save's wait, then the staging


class Pruner:
    """disk.prune on a background thread (rank 0); joined before the next commit and by wait()."""

    def __init__(self, root: Path, keep: int):
        self.root, self.keep = root, keep
        self.removed: list[Path] = []
        self.problems: list[str] = []  # what could not be removed, or was left alone (links)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="dtlaunch-prune", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.removed = disk.prune(self.root, self.keep, self.problems)
        except BaseException as e:  # reported by the joiner
            self.error = e
