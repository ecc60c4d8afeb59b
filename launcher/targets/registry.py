"""A small SQLite registry of submitted jobs, so `status/logs/down NAME` work after `up` returns."""
from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import DtlaunchError


def state_dir() -> Path:
    """$DTLAUNCH_HOME, else $XDG_STATE_HOME/dtlaunch, else ~/.local/state/dtlaunch."""
    if os.environ.get("DTLAUNCH_HOME"):
        return Path(os.environ["DTLAUNCH_HOME"])
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "dtlaunch"


@dataclass
class JobRecord:
    name: str
    target: str
    job_id: str
    run_dir: str
    handle: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)


class Registry:
    def __init__(self, path: Optional[Path] = None):
        self.path = path or state_dir() / "registry.db"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._db() as db:
            db.execute("CREATE TABLE IF NOT EXISTS jobs (name TEXT, target TEXT, job_id TEXT, run_dir TEXT,"
                       " handle TEXT, created REAL)")

    def _db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30)

    def add(self, rec: JobRecord) -> None:
        with self._db() as db:
            db.execute("INSERT INTO jobs VALUES (?,?,?,?,?,?)",
                       (rec.name, rec.target, rec.job_id, rec.run_dir, json.dumps(rec.handle), rec.created))

    def update(self, rec: JobRecord) -> None:
        with self._db() as db:
            db.execute("UPDATE jobs SET handle=? WHERE target=? AND job_id=? AND created=?",
                       (json.dumps(rec.handle), rec.target, rec.job_id, rec.created))

    def all(self) -> list[JobRecord]:
        with self._db() as db:
            rows = db.execute("SELECT name, target, job_id, run_dir, handle, created FROM jobs ORDER BY created").fetchall()
        return [JobRecord(n, t, j, r, json.loads(h), c) for n, t, j, r, h, c in rows]

    def find(self, key: str) -> JobRecord:
        """The newest job whose name or job id is `key`."""
        hits = [r for r in self.all() if key in (r.name, r.job_id, f"{r.target}:{r.job_id}")]
        if not hits:
            known = ", ".join(sorted({r.name for r in self.all()})) or "none yet"
            raise DtlaunchError(f"no job named {key!r} in {self.path} (known: {known})")
        return hits[-1]
