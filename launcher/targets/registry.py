"""A small SQLite registry of submitted jobs, so `status/logs/down NAME` work after `up` returns.

It fails safe: a registry that cannot be written is found before anything is submitted; a damaged database
or a bad row gives a clear error (or is skipped with a note) instead of breaking every command.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BackendError, DtlaunchError
from .table import TARGETS


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
    handle: Any  # the target's handle: a dataclass in its request.py (named by its row in TARGETS)
    created: float = field(default_factory=time.time)


def _decode(target: str, handle_json: str) -> Any:
    cls = TARGETS[target].load("handle")  # KeyError for a target this dtlaunch does not know
    return cls(**json.loads(handle_json))


class Registry:
    def __init__(self, path: Path | None = None):
        self.path = path or state_dir() / "registry.db"

    def _fail(self, what: str, err: BaseException) -> DtlaunchError:
        return BackendError(
            f"the job registry {self.path} {what}: {err}",
            fix=f"move it aside (mv {self.path} {self.path}.broken) and run again; "
            "or set DTLAUNCH_HOME to another directory",
        )

    def _db(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=30)
            db.execute(
                "CREATE TABLE IF NOT EXISTS jobs (name TEXT, target TEXT, job_id TEXT, run_dir TEXT,"
                " handle TEXT, created REAL)"
            )
            return db
        except (sqlite3.Error, OSError) as e:
            raise self._fail("cannot be opened", e) from None

    def check_writable(self) -> None:
        """Before a submit: the registry must be able to record the job, or `status`/`down` could never reach it."""
        d = self.path.parent
        try:
            d.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=d, prefix=".write-check-"):
                pass
            with self._db() as db:
                db.execute("BEGIN IMMEDIATE")  # takes the write lock: fails on a read-only or damaged file
                db.execute("SELECT count(*) FROM jobs").fetchone()
        except (sqlite3.Error, OSError) as e:
            raise self._fail("cannot be written, so the job could not be followed after submitting", e) from None

    def add(self, rec: JobRecord) -> None:
        try:
            with self._db() as db:
                db.execute(
                    "INSERT INTO jobs VALUES (?,?,?,?,?,?)",
                    (rec.name, rec.target, rec.job_id, rec.run_dir, json.dumps(asdict(rec.handle)), rec.created),
                )
        except sqlite3.Error as e:
            raise self._fail("could not record the job", e) from None

    def all(self) -> list[JobRecord]:
        try:
            with self._db() as db:
                rows = db.execute(
                    "SELECT name, target, job_id, run_dir, handle, created FROM jobs ORDER BY created"
                ).fetchall()
        except sqlite3.Error as e:
            raise self._fail("is damaged", e) from None
        out = []
        for n, t, j, r, h, c in rows:
            try:
                out.append(JobRecord(str(n), str(t), str(j), str(r), _decode(t, h), float(c)))
            except (KeyError, TypeError, ValueError) as e:  # one bad row must not break every command
                print(
                    f"dtlaunch: note: skipping a damaged registry row for job {n!r} ({type(e).__name__}: {e})",
                    file=sys.stderr,
                )
        return out

    def matching(self, key: str) -> list[JobRecord]:
        """Every job whose name or job id is `key`, oldest first; at least one."""
        recs = self.all()
        path = os.path.realpath(key)
        hits = [r for r in recs if key in (r.name, r.job_id, f"{r.target}:{r.job_id}") or r.run_dir == path]
        if not hits:
            known = ", ".join(sorted({r.name for r in recs})) or "none yet"
            raise DtlaunchError(
                f"no job named {key!r} in {self.path} (known: {known})", fix="`dtlaunch status` lists the recorded jobs"
            )
        return hits

    def remove(self, recs: list[JobRecord]) -> int:
        """Forget these jobs (nothing on disk is touched); returns how many rows went."""
        try:
            with self._db() as db:
                return sum(
                    db.execute(
                        "DELETE FROM jobs WHERE target=? AND job_id=? AND run_dir=? AND created=?",
                        (r.target, r.job_id, r.run_dir, r.created),
                    ).rowcount
                    for r in recs
                )
        except sqlite3.Error as e:
            raise self._fail("could not forget the jobs", e) from None

    def find(self, key: str) -> JobRecord:
        """The newest job whose name or job id is `key`."""
        return self.matching(key)[-1]

    @contextmanager
    def claim(self, run_dir: str) -> Iterator[None]:
        """An exclusive lock on `run_dir`, held by one `up` from its busy check until its job is recorded, so
        that two `up` at once cannot both find the directory free. It lives beside the registry (the busy check's
        source), so a refused `up` leaves nothing in the run directory."""
        import fcntl
        import hashlib

        path = self.path.parent / "locks" / (hashlib.sha256(run_dir.encode()).hexdigest()[:32] + ".lock")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "a")  # closed below, which releases the lock
        except OSError as e:
            raise self._fail("cannot hold the run directory's lock", e) from None
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BackendError(
                    f"another `dtlaunch up` is starting a job in {run_dir} right now",
                    fix="wait for it (`dtlaunch status`), or use -o for another run directory",
                ) from None
            except OSError as e:
                raise self._fail("cannot lock the run directory's lock file", e) from None
            yield

    def of_run_dir(self, run_dir: str) -> list[JobRecord]:
        return [r for r in self.all() if r.run_dir == run_dir]
