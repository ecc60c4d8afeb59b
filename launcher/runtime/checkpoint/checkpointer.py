"""The Checkpointer: torch state to and from the on-disk protocol (`disk`). Package overview in __init__."""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...version import __version__
from ..engines import DeepSpeedEngine, Engine
from ..failures import ConfigError, RuntimeFailure, StorageError
from . import dcpio, disk
from .background import Pending, Pruner
from .compat import check_compatible
from .lock import RunLock
from .state import rank_file, rng_state, save_torch, set_rng_state

if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import DefaultStager

FORMAT = 2  # 2: written in place with per-rank manifests (1: renamed from step-N.tmp, no checksums)


def staging_options(gpu: bool):
    """How an async save copies the state to the host. On a GPU: into pinned memory, without blocking, with one
    synchronize at the end (blocking copies waited for each tensor in turn). Staging stays synchronous: save()
    returns once the copy is taken, and the next optimizer step may then change the weights."""
    from torch.distributed.checkpoint.staging import StagingOptions

    return StagingOptions(
        use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=gpu
    )


class CheckpointInvalid(Exception):
    """A committed checkpoint whose files do not check out, or that cannot be loaded."""

    def __init__(self, step: int, problems: list[str]):
        self.step, self.problems = step, problems
        super().__init__("; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))


class Checkpointer:
    """Collective save/load of one run's checkpoints under `root`. Every rank calls every method except poll."""

    def __init__(
        self,
        root: Path,
        engine: Engine,
        *,
        rank: int,
        world_size: int,
        keep: int,
        async_save: bool,
        meta: dict,
        group=None,
        faults=None,
        log: Callable[[str], None] | None = None,
        event: Callable[..., None] | None = None,
        allow_changed_recipe: bool = False,
        run_id: str | None = None,
    ):
        self.root, self.engine = Path(root), engine
        self.rank, self.world_size, self.keep = rank, world_size, keep
        self.deepspeed = isinstance(engine, DeepSpeedEngine)
        self.async_save = async_save and not self.deepspeed  # DeepSpeed saves synchronously
        self.meta = meta  # static fields: recipe identity, layout, shape, versions
        self.group = group
        self.faults = faults
        self.log = log or (lambda s: None)
        self.event = event or (lambda *a, **k: None)
        self.allow_changed_recipe = allow_changed_recipe
        self.run_id = run_id
        self._pending: Pending | None = None
        # the step whose checkpoint this rank is writing or committing now (left set when that fails: the failure's
        # message says which save it was; a background save's is the one the next save or close waits for)
        self.writing: int | None = None
        self._pruner: Pruner | None = None  # rank 0: deleting old checkpoints in the background
        self._lock = RunLock(self.root)
        self.distributed = dist.is_available() and dist.is_initialized()
        # async saves: DCP's stager, kept so that its CPU copy is reused by every save
        self._stager: DefaultStager | None = None

    # ------------------------------------------------------------------ collectives on the checkpoint group

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def _broadcast(self, value: Any) -> Any:
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _gather(self, value: Any) -> list:
        if not self.distributed:
            return [value]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _agree(self, fn: Callable[[], Any]) -> Any:
        """Rank 0 runs `fn`; every rank returns its result or raises its RuntimeFailure (the same class and
        message everywhere), so a failure found by rank 0 ends every rank at once instead of leaving the others
        waiting in the next collective."""
        out: tuple = (None, None)
        if self.rank == 0:
            try:
                out = (fn(), None)
            except RuntimeFailure as e:
                out = (None, (type(e), e.message, e.fix))
        value, failure = self._broadcast(out)
        if failure is not None:
            cls, message, fix = failure
            raise cls(message, fix=fix)
        return value

    def _all_agree(self, value: Any, error: RuntimeFailure | None) -> list:
        """Gather `value` from every rank; if any rank had a RuntimeFailure, every rank raises the first one."""
        found = self._gather((value, None if error is None else (type(error), error.message, error.fix)))
        for _, failure in found:
            if failure is not None:
                cls, message, fix = failure
                raise cls(message, fix=fix)
        return [v for v, _ in found]

    def _model_optim_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.engine.model, self.engine.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def _trainer_state(self) -> dict:
        eng = self.engine
        out = {}
        if not self.deepspeed:
            out["scheduler"] = eng.scheduler.state_dict()
            scaler = getattr(eng, "scaler", None)
            if scaler is not None:
                out["scaler"] = scaler.state_dict()
        return out

    # ------------------------------------------------------------------ start-up

    def prepare(self) -> None:
        """At start-up: one writer per directory (rank 0 holds its lock), no partial leftovers, and no linked
        step directories (dtlaunch never reads, writes or deletes through a link: it may be another run's)."""
        self._agree(self._prepare_rank0)
        self._barrier()

    def _prepare_rank0(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        warning = self._lock.acquire(self.run_id)  # raises ConfigError naming the other writer
        if warning:
            self.log(f"WARNING: {warning}")
        links = disk.linked_steps(self.root)
        if links:
            raise ConfigError(
                f"{self.root} holds linked step directories, which dtlaunch never follows (pruning "
                "through one would delete another run's checkpoint): "
                + ", ".join(f"{p.name} -> {os.readlink(p)}" for p in links),
                fix="copy the checkpoint in instead (cp -r --dereference) or remove the link",
            )
        problems: list[str] = []
        for p in disk.clean_partials(self.root, problems):
            self.log(f"removed partial checkpoint {p.name} (never committed)")
        for msg in problems:
            self.log(f"WARNING: {msg}")
        for s in disk.corrupt_steps(self.root):
            self.log(f"note: checkpoint step {s} is marked CORRUPT (see its CORRUPT file) and is never used")

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        self._lock.release()

    def _async_stager(self):
        """One DefaultStager for the run: its CPU copy of the state is allocated by the first async save and
        refilled by the next ones. A fresh copy per save (DCP's default) paid for allocating and faulting in
        the whole state every time: 0.2-0.7 s of a 0.25-0.75 s stall on the benchmark's 350 MB per rank,
        against 0.05-0.13 s reused. The memory is the same as the default's while a save is in flight; it is
        kept between saves. Pinned when there is a GPU (faster copies from it). Safe to refill because at most
        one save is in flight: save() waits for the previous upload first."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager

            self._stager = DefaultStager(staging_options(torch.cuda.is_available()))
        return self._stager

    # ------------------------------------------------------------------ save

    def storage_failure(self, step: int, exc: BaseException | None) -> StorageError | None:
        """A StorageError saying so if checkpoint `step` failed because the storage is full or read-only (an
        ENOSPC/EROFS/EDQUOT in the failure, or too little room left on it: DCP's writer can hide the ENOSPC
        behind its own "unexpected pos"), else None."""
        full = disk.storage_full(exc)
        path = disk.step_path(self.root, step)
        try:
            free = disk.free_bytes(self.root)
            written = disk.tree_bytes(path)
            prev = disk.complete_steps(self.root)
            need = disk.tree_bytes(disk.step_path(self.root, prev[-1])) if prev else 0
        except OSError:
            return None
        if full is None and free >= (1 << 20) and free + written >= need:
            return None
        what = "the storage is read-only" if getattr(full, "errno", None) == errno.EROFS else "no space left"
        needs = (
            f"a checkpoint needs ~{need / 1e9:.3f} GB"
            if need
            else f"{written / 1e9:.3f} GB was written before it failed"
        )
        return StorageError(
            f"checkpoint step {step} could not be written to {path}: {what} ({free / 1e9:.3f} GB free; {needs})",
            fix=f"free space under {self.root} (or lower checkpoint.keep, or point checkpoint.dir "
            "at larger storage), then run again: it resumes from " + (f"step {prev[-1]}" if prev else "the start"),
        )

    def save(self, step: int, data_position: dict, *, blocking: bool = False, reason: str = "interval") -> None:
        """Write checkpoint `step`. Async (DCP) unless `blocking`; returns once the state is staged.
        StorageError when the storage is full or read-only."""
        entered = time.time()
        self.wait()  # at most one save in flight: commit the previous one first
        self.writing = step
        try:
            self._save(step, data_position, blocking=blocking, reason=reason)
            if self._pending is not None:  # an async save: training waited for the wait and the staging only
                self._pending.stalled = time.time() - entered
        except (Exception, dcpio.CheckpointException) as e:
            if isinstance(e, RuntimeFailure):
                raise
            failure = self.storage_failure(step, e)
            if failure is not None:
                raise failure from e
            raise
        self.writing = None

    def _save(self, step: int, data_position: dict, *, blocking: bool, reason: str) -> None:
        t0 = time.time()
        path = disk.step_path(self.root, step)
        done = disk.is_complete(path) and not disk.is_corrupt(path) if self.rank == 0 else None
        if self._broadcast(done):
            return  # this step is already committed (e.g. a preemption right after resuming from it)
        if self.rank == 0 and path.exists():
            if disk.is_corrupt(path):  # kept for a person to look at, out of the way of the new one
                aside = disk.set_aside(path)
                self.log(f"moved the corrupt checkpoint step {step} to {aside.name}")
            else:
                shutil.rmtree(path)  # a dead attempt's files for the same step
        self._barrier()
        path.mkdir(parents=True, exist_ok=True)  # every rank creates what it writes into: nodes may not share a view
        meta = {
            **self.meta,
            "format": FORMAT,
            "step": step,
            "data": data_position,
            "world_size": self.world_size,
            "torch_version": torch.__version__,
            "dtlaunch_version": __version__,
            "time": time.time(),
            "reason": reason,
        }
        save_torch(rng_state(), path / rank_file(self.rank))
        if self.rank == 0:
            save_torch(self._trainer_state(), path / "trainer.pt")
        if self.deepspeed:
            ds_engine: Any = self.engine.model  # DeepSpeed's engine (no type information)
            ds_engine.save_checkpoint(str(self.root), tag=path.name, save_latest=False)
            self._finish(step, meta, t0)
            return
        import torch.distributed.checkpoint as dcp

        state = self._model_optim_state()
        writer = dcpio.writer(path)
        if self.async_save and not blocking and self.distributed:
            fut = dcp.async_save(
                state,
                storage_writer=writer,
                planner=dcpio.planner(),
                process_group=self.group,
                async_stager=self._async_stager(),
            )
            if not isinstance(fut, Future):  # AsyncSaveResponse (staging + upload futures)
                fut = fut.upload_completion
            pending = Pending(step, fut, meta, t0, writer)
            fut.add_done_callback(lambda f: self._write_manifest_after(f, pending))
            self._pending = pending
            self.log(f"checkpoint step {step}: staged in {time.time() - t0:.2f}s, writing in the background")
            return
        with dcpio.save_context(synchronous=True):
            dcp.save(
                state,
                storage_writer=writer,
                planner=dcpio.planner(),
                process_group=self.group if self.distributed else None,
                no_dist=not self.distributed,
            )
        self._finish(step, meta, t0, dcpio.written_sums(writer, path))

    def _write_manifest_after(self, fut: Future, p: Pending) -> None:
        """In the writer's thread, when this rank's part of an async save is on disk: its manifest."""
        try:
            fut.result()
            path = disk.step_path(self.root, p.step)
            disk.write_manifest(path, self.rank, dcpio.written_sums(p.writer, path))
        except BaseException as e:  # noqa: BLE001 - reported at the next wait
            p.error = e
        finally:
            p.manifest.set()

    def _finish(self, step: int, meta: dict, t0: float, written: dict | None = None) -> None:
        """A synchronous save: every rank's manifest, then rank 0 commits."""
        disk.write_manifest(disk.step_path(self.root, step), self.rank, written)
        self._barrier()
        if self.rank == 0:
            self._commit(step, meta, t0, asynchronous=False)
        self._barrier()

    def _commit(self, step: int, meta: dict, t0: float, asynchronous: bool, stalled: float | None = None) -> None:
        """Rank 0: mark the checkpoint complete, then prune old ones in the background."""
        if self.faults is not None:
            self.faults.in_checkpoint(step)
        self._join_pruner()
        path = disk.commit(self.root, step, meta)
        secs = time.time() - t0
        self.log(f"checkpoint step {step} committed to {path} in {secs:.2f}s")
        self.event(
            "checkpoint",
            step=step,
            path=str(path),
            seconds=round(secs, 3),
            asynchronous=asynchronous,
            # what training waited (the goodput ledger's checkpoint stall): all of a synchronous save
            stalled=round(secs if stalled is None else stalled, 3),
            reason=meta.get("reason"),
        )
        # Deleting old checkpoints is not part of the commit (the new one is already durable and marked;
        # a prune cut short leaves unmarked directories that start-up cleans): run it off the critical path.
        self._pruner = Pruner(self.root, self.keep)

    def _join_pruner(self) -> None:
        pr, self._pruner = self._pruner, None
        if pr is None:
            return
        pr.thread.join()
        if pr.error is not None:
            self.log(f"WARNING: pruning old checkpoints failed: {pr.error}")
        if pr.removed:
            self.log(f"pruned {', '.join(p.name for p in pr.removed)}")
        for msg in pr.problems:
            self.log(f"WARNING: pruning: {msg}")

    def poll(self) -> None:
        """Rank 0, without blocking or collectives: commit a finished async save once every rank's manifest
        is visible here (on shared storage that is as soon as the last rank is done)."""
        p = self._pending
        if p is None or self.rank != 0 or p.committed or not p.manifest.is_set() or p.error is not None:
            return
        path = disk.step_path(self.root, p.step)
        if all((path / disk.manifest_name(r)).is_file() for r in range(self.world_size)):
            p.committed = True
            self._commit(p.step, p.meta, p.t0, asynchronous=True, stalled=p.stalled)

    def wait(self) -> None:
        """Collective: the save in flight is written everywhere and committed (or reported failed)."""
        p = self._pending
        if p is None:
            if self.rank == 0:
                self._join_pruner()
            return
        self.writing = p.step
        p.manifest.wait()
        ok = self._gather(p.error is None)
        failure = self.storage_failure(p.step, p.error) if self.rank == 0 and not all(ok) else None
        failure = self._broadcast(None if failure is None else (failure.message, failure.fix))
        if failure is not None:  # every rank stops: the next save would fail the same way
            self._pending = None
            raise StorageError(*failure)
        if self.rank == 0 and not p.committed:
            if all(ok):
                p.committed = True
                self._commit(p.step, p.meta, p.t0, asynchronous=True, stalled=p.stalled)
            else:
                bad = [r for r, good in enumerate(ok) if not good]
                self.log(
                    f"checkpoint step {p.step} FAILED in the background on rank(s) {bad}"
                    + (f": {p.error}" if p.error is not None else "")
                    + "; keeping the previous one"
                )
                self.event("checkpoint_failed", step=p.step, ranks=bad)
        elif p.error is not None:
            self.log(f"rank {self.rank}: background checkpoint step {p.step} failed: {p.error}")
        self._pending = None
        if self.rank == 0:
            self._join_pruner()
        self._barrier()
        self.writing = None

    # ------------------------------------------------------------------ resume

    def verify(self, step: int) -> list[str]:
        """Collective: problems with checkpoint `step` (its records and sizes by rank 0, checksums split over
        every rank). A read that keeps failing raises StorageError on every rank."""
        path = disk.step_path(self.root, step)

        def records() -> tuple[list[str], list[str]]:
            problems = disk.meta_problems(path)
            files, more = disk.expected_files(path)
            problems += more
            problems += disk.size_problems(path) if not problems else []
            return problems, sorted(files)

        problems, names = self._agree(records)
        if problems:
            return list(dict.fromkeys(problems))
        mine, error = names[self.rank :: self.world_size], None
        try:
            found = disk.crc_problems(path, mine)
        except StorageError as e:
            found, error = [], e
        return [p for part in self._all_agree(found, error) for p in part]

    def restore_latest(self) -> dict | None:
        """Load the newest checkpoint that checks out; report and skip the ones that do not.
        Returns its metadata, or None when the directory holds no checkpoint at all (a fresh start). One that
        holds only unusable checkpoints (found now, or marked CORRUPT before) stops with ConfigError naming
        them, on every attempt: starting over would silently throw the run's progress away."""
        steps, corrupt = self._broadcast(
            (disk.complete_steps(self.root), disk.corrupt_steps(self.root)) if self.rank == 0 else None
        )
        failed: list[tuple[int, str]] = []
        for step in reversed(steps):
            try:
                problems = self.verify(step)
                if problems:
                    raise CheckpointInvalid(step, problems)
                saved = self.load(step)
            except CheckpointInvalid as e:
                if self.rank == 0:
                    disk.mark_corrupt(disk.step_path(self.root, step), str(e))
                older = [s for s in steps if s < step]
                self.log(
                    f"WARNING: checkpoint step {step} cannot be used ({e}); marked CORRUPT, "
                    + (f"trying step {older[-1]}" if older else "no older checkpoint left")
                )
                self.event("checkpoint_corrupt", step=step, problems=e.problems[:10])
                failed.append((step, str(e)))
                continue
            if failed:
                saved["warnings"].append(f"skipped corrupt checkpoint(s) {', '.join(str(s) for s, _ in failed)}")
            return saved
        if failed or corrupt:
            reasons = [f"step {s}: {r}" for s, r in failed] + [
                f"step {s}: marked CORRUPT earlier (see {disk.step_name(s)}/{disk.CORRUPT})" for s in corrupt
            ]
            raise ConfigError(
                f"no checkpoint in {self.root} can be used: " + "; ".join(reasons),
                fix="restore the files, or move the directory aside to start the run from scratch",
            )
        return None

    def load(self, step: int) -> dict:
        """Restore checkpoint `step` into the engine; returns its metadata (with 'warnings').
        ConfigError when it belongs to another run; CheckpointInvalid when its files cannot be loaded."""
        path = disk.step_path(self.root, step)
        saved = self._broadcast(disk.read_meta(path) if self.rank == 0 else None)
        warnings = check_compatible(
            saved,
            self.meta,
            world_size=self.world_size,
            deepspeed=self.deepspeed,
            allow_changed_recipe=self.allow_changed_recipe,
            fmt=FORMAT,
        )
        try:
            self._load_states(path)
        except (ConfigError, StorageError):
            raise
        except (Exception, dcpio.CheckpointException) as e:  # noqa: BLE001 - a damaged file can make any loader raise anything
            if dcpio.read_failed(e):  # the files checked out a moment ago: the storage failed, not the checkpoint
                raise StorageError(
                    f"reading checkpoint {path} failed: {dcpio.first_line(e)}",
                    fix="check the storage, then run again: the same checkpoint is tried first",
                ) from e
            raise CheckpointInvalid(step, [f"loading failed: {type(e).__name__}: {dcpio.first_line(e)}"]) from e
        rng = path / rank_file(self.rank)
        relaid = "layout" in saved and saved["layout"] != self.meta.get("layout")  # a rank's place changed
        if saved.get("world_size") == self.world_size and not relaid and rng.is_file():
            set_rng_state(torch.load(rng, weights_only=False))
        else:
            torch.manual_seed(int(saved.get("seed", 0)) * 7919 + step * 1009 + self.rank)
            warnings.append(f"RNG streams re-seeded ({'layout' if relaid else 'world size'} changed)")
        saved["warnings"] = warnings
        saved["path"] = str(path)
        return saved

    def _load_states(self, path: Path) -> None:
        if self.deepspeed:
            ds_engine: Any = self.engine.model  # DeepSpeed's engine (no type information)
            load_path, _ = ds_engine.load_checkpoint(
                str(self.root), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True
            )
            if load_path is None:
                raise RuntimeError(f"DeepSpeed found no checkpoint in {path}")
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._model_optim_state()
        dcp.load(
            state,
            checkpoint_id=str(path),
            process_group=self.group if self.distributed else None,
            no_dist=not self.distributed,
        )
        set_state_dict(
            self.engine.model, self.engine.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        trainer = torch.load(path / "trainer.pt", weights_only=False)
        self.engine.scheduler.load_state_dict(trainer["scheduler"])
        scaler = getattr(self.engine, "scaler", None)
        if scaler is not None and "scaler" in trainer:
            scaler.load_state_dict(trainer["scaler"])


__all__ = ["Checkpointer", "CheckpointInvalid", "FORMAT", "staging_options"]
