"""One writer per checkpoint directory: two jobs that resume, train and prune the same checkpoints destroy
each other's work (the second one's prune deletes what the first just committed).

Rank 0 of a run holds a POSIX lock (fcntl, which network filesystems support across nodes) on
`<checkpoint root>/.lock` for as long as it lives; the kernel releases it when the process ends, however it
ends. A second writer is refused with the holder's identity. Where the filesystem cannot lock (some object
store mounts), the run goes on with a warning: validate and `up` already refuse a second job on one run.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ..failures import ConfigError

LOCK = ".lock"


class RunLock:
    def __init__(self, root: Path):
        self.path = Path(root) / LOCK
        self._fd: int | None = None

    def acquire(self, run_id: str | None) -> str | None:
        """Take the lock or raise ConfigError naming the holder; returns a warning if locking is unsupported."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = self._holder(fd)
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise ConfigError(
                    f"another job is writing to {self.path.parent}: {holder}",
                    fix="wait for it or stop it; two jobs on one checkpoint directory would overwrite "
                    "and prune each other's checkpoints (use another checkpoint.dir or run id)",
                ) from None
            return f"cannot lock {self.path} on this filesystem ({e.strerror}): a second job here would not be refused"
        me = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id, "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        return None

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
            return f"pid {info.get('pid')} on {info.get('host')} (run {info.get('run_id')}, since {since})"
        except (OSError, ValueError):
            return "an unknown process"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the POSIX lock
            self._fd = None
