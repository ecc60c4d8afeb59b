"""DCP's filesystem writer, with each file's size and CRC-32 taken from the bytes as they are written.

The manifest of a checkpoint records every file's CRC-32 (disk.write_manifest). Reading each file back
after DCP wrote it cost a second pass over the whole shard (~0.15 s per 350 MB rank on the benchmark
machine, a fifth of the save). The bytes are in hand while they are written, so the checksum is folded in
there: `zlib.crc32` releases the GIL, so it runs in DCP's writer threads beside the other threads' disk
writes. A file whose bytes were not written strictly in order (a seek), or whose size on disk differs from
what went through the stream, gets no recorded checksum and is read back as before. The guarantee is the
same: the manifest describes the bytes handed to the file, and a resume reads the files from storage and
compares.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from . import disk

try:
    # DCP reports every rank's failure in one CheckpointException, a BaseException (`except Exception` misses it).
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # pragma: no cover - torch without distributed

    class CheckpointException(BaseException):  # type: ignore[no-redef]
        pass


def read_failed(exc: BaseException) -> bool:
    """An OSError anywhere in the failure: the storage failed (EIO, ESTALE, ENOENT), not the bytes."""
    return any(isinstance(e, OSError) for e in disk.exception_chain(exc))


def first_line(exc: BaseException) -> str:
    """The innermost OSError's message if there is one (what went wrong), else the error's first line."""
    inner = next((e for e in disk.exception_chain(exc) if isinstance(e, OSError)), exc)
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0][:300] if text else ''}"


_LAST_WRITE = [0.0]  # monotonic time of this process's latest checkpoint write: the save watchdog's progress


def last_write() -> float:
    return _LAST_WRITE[0]


class _ChecksumStream:
    """A binary file opened for writing that keeps the running size and CRC-32 of what went through it."""

    def __init__(self, f):
        self._f = f
        self.size = 0
        self.crc = 0
        self.in_order = True  # False once anything moved the position other than a write

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())
        n = self._f.write(mv)
        _LAST_WRITE[0] = time.monotonic()
        if n != mv.nbytes:  # a short write (only raw streams do that): the running checksum is void
            self.in_order = False
            return n
        self.crc = zlib.crc32(mv, self.crc)
        self.size += n
        return n

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, *args) -> int:
        self.in_order = False
        return self._f.seek(*args)

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._f.seekable()

    def readable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self._f.closed

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _checksumming_fs():
    from torch.distributed.checkpoint.filesystem import FileSystem

    class ChecksummingFileSystem(FileSystem):
        """DCP's local FileSystem, remembering (size, CRC-32) of every file it wrote completely."""

        def __init__(self) -> None:
            super().__init__()
            self.sums: dict[str, tuple[int, int]] = {}
            self._lock = threading.Lock()

        @contextmanager
        def create_stream(self, path, mode: str):
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            p = Path(path)
            with p.open(mode) as f:
                s = _ChecksumStream(f)
                try:
                    yield s
                except BaseException:
                    s.in_order = False
                    raise
                finally:
                    if not f.closed:
                        f.close()
                    if s.in_order:
                        with self._lock:
                            self.sums[str(p)] = (s.size, s.crc)

        def rename(self, path, new_path) -> None:
            super().rename(path, new_path)
            with self._lock:
                rec = self.sums.pop(str(Path(path)), None)
                if rec is not None:
                    self.sums[str(Path(new_path))] = rec

    return ChecksummingFileSystem()


# DCP writer threads per rank, at most: each writes its own file of the rank's shard (fsync'd), so the
# serialisation of one tensor overlaps the disk writes of others. Only where the rank has the cores for them
# (`dcp_write_threads`): a save is CPU-bound (copies into the page cache, the CRC-32 of every byte), and threads
# beyond a rank's share of the cores only contend for them and for the GIL (bench/checkpoint_stall.py measures it).
DCP_WRITE_THREADS = 4


def dcp_write_threads(cpus: int | None = None, local_ranks: int | None = None) -> int:
    """Writer threads for this rank: its share of the node's cores (those this process may run on), between
    1 and DCP_WRITE_THREADS."""
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
    if local_ranks is None:
        try:
            local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            local_ranks = 1
    return max(1, min(DCP_WRITE_THREADS, cpus // local_ranks))


def writer(path: Path, thread_count: int | None = None):
    """A FileSystemWriter for `path` (one file per rank and thread, fsync'd before the save returns:
    sync_files) that records each file's CRC-32 as it is written; `dcp_write_threads()` threads by default."""
    from torch.distributed.checkpoint import FileSystemWriter

    threads = dcp_write_threads() if thread_count is None else thread_count
    w = FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=threads)
    if hasattr(w, "fs"):  # where DCP keeps its filesystem; without it, the manifest reads the files back
        w.fs = _checksumming_fs()
    return w


def written_sums(w, path: Path) -> dict[str, tuple[int, int]]:
    """{name relative to `path`: (size, crc32)} of the files `w` wrote there, for disk.write_manifest."""
    sums: dict | None = getattr(getattr(w, "fs", None), "sums", None)
    if not sums:
        return {}
    out = {}
    root = Path(path)
    for name, rec in list(sums.items()):
        p = Path(name)
        try:
            out[p.relative_to(root).as_posix()] = rec
        except ValueError:
            continue
    return out


_ZIP_CRC_LOCK = threading.Lock()


@contextmanager
def _without_zip_crc():
    """torch.save without the CRC-32 of each zip record, for the duration of a synchronous save.

    DCP writes every tensor as a torch.save archive, and torch.save checksums each record as it writes it;
    torch.load never checks those checksums (a flipped byte in a record loads silently), so they protect
    nothing here, while the manifest's CRC-32 of every whole file is checked on resume. Computing both cost a
    second pass over the data (~0.04 s of CPU per 240 MB here). The switch is process-wide, so it is only
    thrown while this process's own training is stopped for a synchronous save."""
    import torch.serialization as ts

    with _ZIP_CRC_LOCK:
        before = ts.get_crc32_options()
        ts.set_crc32_options(False)
        try:
            yield
        finally:
            ts.set_crc32_options(before)


def save_context(synchronous: bool):
    """What surrounds a DCP save: no redundant zip checksums while a synchronous save blocks training."""
    return _without_zip_crc() if synchronous else nullcontext()


def planner():
    """DCP's default planner with its save plans cached: a checkpoint of the same state (every interval
    save of a run) sends no plan to the coordinator and reuses the global plan and metadata, the cost
    PyTorch's cached-plan work removed from DCP saves. A changed plan is compared and planned afresh."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    return DefaultSavePlanner(enable_plan_caching=True)
