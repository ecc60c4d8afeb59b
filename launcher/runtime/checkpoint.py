"""Save and resume everything a run needs to continue exactly: model, optimizer, LR schedule, loss
scaler, step, data position, and every rank's RNG streams.

DDP/FSDP2 use torch.distributed.checkpoint (sharded, reshardable to any world size); ZeRO uses
DeepSpeed's own format (resumable only at the same world size). Both are written through the atomic
protocol in `ckptdir`. Async saves (DCP) run on their own gloo group, at most one in flight, and are
committed by rank 0 when they complete - before the next save and at exit at the latest.
"""
from __future__ import annotations

import io
import random
import shutil
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import __version__
from . import ckptdir
from .failures import ConfigError
from .parallel import DeepSpeedEngine, Engine

FORMAT = 1
# DCP writer threads per rank: each writes its own file of the rank's shard (fsync'd), so the
# serialisation of one tensor overlaps the disk writes of others (1 thread wrote at ~1/3 of torch.save's rate).
DCP_WRITE_THREADS = 4


def _dcp_writer(path: Path):
    """DCP's filesystem writer with every file fsync'd before the save returns (sync_files)."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=DCP_WRITE_THREADS)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])


def _save_torch(obj: Any, path: Path) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    ckptdir.write_file_durably(path, buf.getvalue())


def _rank_file(rank: int) -> str:
    return f"rng-{rank:05d}.pt"


class Checkpointer:
    """Collective save/load of one run's checkpoints under `root`. Every rank calls every method."""

    def __init__(self, root: Path, engine: Engine, *, rank: int, world_size: int, keep: int, async_save: bool,
                 meta: dict, group=None, faults=None, log: Optional[Callable[[str], None]] = None,
                 event: Optional[Callable[..., None]] = None):
        self.root, self.engine = Path(root), engine
        self.rank, self.world_size, self.keep = rank, world_size, keep
        self.deepspeed = isinstance(engine, DeepSpeedEngine)
        self.async_save = async_save and not self.deepspeed  # DeepSpeed saves synchronously
        self.meta = meta  # static fields: recipe hash, layout, shape, versions
        self.group = group
        self.faults = faults
        self.log = log or (lambda s: None)
        self.event = event or (lambda *a, **k: None)
        self._pending: Optional[_Pending] = None
        self._pruner: Optional[_Pruner] = None  # rank 0: deleting old checkpoints in the background
        self.distributed = dist.is_available() and dist.is_initialized()

    # ------------------------------------------------------------------ helpers

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def _broadcast(self, value: Any) -> Any:
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _model_optim_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.engine.model, self.engine.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def _trainer_state(self) -> dict:
        eng = self.engine
        out = {}
        if not self.deepspeed:
            out["scheduler"] = eng.scheduler.state_dict()
            if getattr(eng, "scaler", None) is not None:
                out["scaler"] = eng.scaler.state_dict()
        return out

    # ------------------------------------------------------------------ save

    def latest(self) -> Optional[int]:
        """The newest committed step, decided by rank 0 and shared (so all ranks load the same one)."""
        step = ckptdir.latest_complete(self.root) if self.rank == 0 else None
        return self._broadcast(step)

    def prepare(self) -> None:
        """At start-up: create the directory and drop partial leftovers of earlier attempts."""
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for p in ckptdir.clean_partials(self.root):
                self.log(f"removed partial checkpoint {p.name} (never committed)")
        self._barrier()

    def save(self, step: int, data_position: dict, *, blocking: bool = False, reason: str = "interval") -> None:
        """Write checkpoint `step`. Async (DCP) unless `blocking`; returns once the state is staged."""
        self.wait()  # at most one save in flight: commit the previous one first
        t0 = time.time()
        tmp = ckptdir.tmp_path(self.root, step)
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self._barrier()
        meta = {**self.meta, "format": FORMAT, "step": step, "data": data_position, "world_size": self.world_size,
                "torch_version": torch.__version__, "dtlaunch_version": __version__, "time": time.time(),
                "reason": reason}
        tmp.mkdir(parents=True, exist_ok=True)  # every rank creates what it writes into: nodes may not share a view
        _save_torch(_rng_state(), tmp / _rank_file(self.rank))
        if self.rank == 0:
            _save_torch(self._trainer_state(), tmp / "trainer.pt")
        if self.deepspeed:
            self.engine.model.save_checkpoint(str(self.root), tag=tmp.name, save_latest=False)
            self._finish(step, meta, t0, asynchronous=False)
            return
        import torch.distributed.checkpoint as dcp

        state = self._model_optim_state()
        if self.async_save and not blocking and self.distributed:
            fut = dcp.async_save(state, storage_writer=_dcp_writer(tmp), process_group=self.group)
            if not isinstance(fut, Future):  # AsyncSaveResponse (staging + upload futures)
                fut = fut.upload_completion
            self._pending = _Pending(step, fut, meta, t0)
            self.log(f"checkpoint step {step}: staged in {time.time() - t0:.2f}s, writing in the background")
            return
        dcp.save(state, storage_writer=_dcp_writer(tmp), process_group=self.group if self.distributed else None,
                 no_dist=not self.distributed)
        self._finish(step, meta, t0, asynchronous=False)

    def _finish(self, step: int, meta: dict, t0: float, asynchronous: bool) -> None:
        """All ranks' files are written: rank 0 commits (rename + marker), then prunes in the background."""
        if not asynchronous:
            self._barrier()
        if self.faults is not None:
            self.faults.in_checkpoint(step)
        if self.rank == 0:
            self._join_pruner()
            path = ckptdir.commit(self.root, step, meta)
            secs = time.time() - t0
            self.log(f"checkpoint step {step} committed to {path} in {secs:.2f}s")
            self.event("checkpoint", step=step, path=str(path), seconds=round(secs, 3), asynchronous=asynchronous,
                       reason=meta.get("reason"))
            # Deleting old checkpoints is not part of the commit (the new one is already durable and marked;
            # a prune cut short leaves unmarked directories that start-up cleans): run it off the critical path.
            self._pruner = _Pruner(self.root, self.keep)
        if not asynchronous:
            self._barrier()

    def _join_pruner(self) -> None:
        """Wait for the background prune (rank 0) and report what it removed."""
        pr, self._pruner = self._pruner, None
        if pr is None:
            return
        pr.thread.join()
        if pr.error is not None:
            self.log(f"WARNING: pruning old checkpoints failed: {pr.error}")
        elif pr.removed:
            self.log(f"pruned {', '.join(p.name for p in pr.removed)}")

    def poll(self) -> None:
        """Commit a finished async save without blocking (rank 0's future completes only after every
        rank's data is written, because DCP gathers the write results before writing .metadata)."""
        p = self._pending
        if p is not None and self.rank == 0 and not p.committed and p.future.done():
            self._commit_pending()

    def wait(self) -> None:
        """Block until the save in flight is written everywhere, committed, and old checkpoints pruned."""
        p = self._pending
        if p is None:
            self._join_pruner()
            return
        try:
            p.future.result()
        except Exception as e:  # reported by rank 0's commit; other ranks only note it
            if self.rank != 0:
                self.log(f"rank {self.rank}: background checkpoint step {p.step} failed: {e}")
        if self.rank == 0 and not p.committed:
            self._commit_pending()
        self._pending = None
        self._join_pruner()

    def _commit_pending(self) -> None:
        p = self._pending
        assert p is not None
        p.committed = True
        try:
            p.future.result()
        except Exception as e:
            self.log(f"checkpoint step {p.step} FAILED in the background: {e}; keeping the previous one")
            self.event("checkpoint_failed", step=p.step, error=str(e))
            return
        self._finish(p.step, p.meta, p.t0, asynchronous=True)

    # ------------------------------------------------------------------ load

    def check_compatible(self, saved: dict) -> list[str]:
        """Refuse what cannot be resumed (ConfigError); return warnings for what changed but can."""
        mine = self.meta
        warnings = []
        if saved.get("format") != FORMAT:
            raise ConfigError(f"checkpoint format {saved.get('format')} is not this dtlaunch's ({FORMAT})")
        if saved.get("shape") != mine.get("shape"):
            raise ConfigError(f"the checkpoint holds a different model shape: {saved.get('shape')} vs {mine.get('shape')}",
                              fix="resume with the recipe's original model, or use a new checkpoint.dir")
        if saved.get("family") != mine.get("family"):
            raise ConfigError(f"the checkpoint was written by {saved.get('strategy')} ({saved.get('family')} format) and "
                              f"cannot be loaded by {mine.get('strategy')} ({mine.get('family')} format)",
                              fix=f"resume with strategy {saved.get('strategy')}, or start a new checkpoint.dir")
        if self.deepspeed and saved.get("world_size") != self.world_size:
            raise ConfigError(f"DeepSpeed ZeRO checkpoints resume only at the same world size: saved with "
                              f"{saved.get('world_size')} ranks, now {self.world_size}",
                              fix=f"run on {saved.get('world_size')} ranks, or convert the checkpoint with "
                                  "deepspeed.utils.zero_to_fp32 and start a new run")
        if self.deepspeed and saved.get("strategy") != mine.get("strategy"):
            raise ConfigError(f"the checkpoint was written by {saved.get('strategy')}, this run is {mine.get('strategy')}",
                              fix=f"resume with strategy {saved.get('strategy')}")
        for key in ("world_size", "strategy", "precision", "grad_accum", "global_batch", "recipe_hash"):
            old = saved.get(key)
            new = self.world_size if key == "world_size" else mine.get(key)
            if old != new:
                warnings.append(f"{key} {old} -> {new}")
        return warnings

    def load(self, step: int) -> dict:
        """Restore checkpoint `step` into the engine; returns its metadata (with 'warnings')."""
        path = ckptdir.final_path(self.root, step)
        saved = self._broadcast(ckptdir.read_meta(path) if self.rank == 0 else None)
        warnings = self.check_compatible(saved)
        if self.deepspeed:
            load_path, _ = self.engine.model.load_checkpoint(str(self.root), tag=path.name, load_optimizer_states=True,
                                                             load_lr_scheduler_states=True)
            if load_path is None:
                raise ConfigError(f"DeepSpeed could not load checkpoint {path}")
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import set_state_dict

            state = self._model_optim_state()
            dcp.load(state, checkpoint_id=str(path), process_group=self.group if self.distributed else None,
                     no_dist=not self.distributed)
            set_state_dict(self.engine.model, self.engine.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            trainer = torch.load(path / "trainer.pt", weights_only=False)
            self.engine.scheduler.load_state_dict(trainer["scheduler"])
            if getattr(self.engine, "scaler", None) is not None and "scaler" in trainer:
                self.engine.scaler.load_state_dict(trainer["scaler"])
        rng = path / _rank_file(self.rank)
        if saved.get("world_size") == self.world_size and rng.is_file():
            _set_rng_state(torch.load(rng, weights_only=False))
        else:
            torch.manual_seed(int(saved.get("seed", 0)) * 7919 + step * 1009 + self.rank)
            warnings.append("RNG streams re-seeded (world size changed)")
        saved["warnings"] = warnings
        saved["path"] = str(path)
        return saved

    def close(self) -> None:
        self.wait()


class _Pruner:
    """ckptdir.prune on a background thread (rank 0); joined before the next commit and by wait()."""

    def __init__(self, root: Path, keep: int):
        self.root, self.keep = root, keep
        self.removed: list[Path] = []
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name="dtlaunch-prune", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.removed = ckptdir.prune(self.root, self.keep)
        except BaseException as e:  # reported by the joiner
            self.error = e


@dataclass
class _Pending:
    step: int
    future: Future
    meta: dict
    t0: float
    committed: bool = False


def export_model(engine: Engine, out_dir: Path, fmt: str, rank: int) -> Optional[Path]:
    """A consolidated single-file copy of the weights (fp32, unsharded) on rank 0; collective."""
    if fmt == "none":
        return None
    if isinstance(engine, DeepSpeedEngine):
        from deepspeed.utils import safe_get_full_fp32_param

        full = {}
        for name, p in engine.module.named_parameters():
            t = safe_get_full_fp32_param(p)  # a gather under ZeRO-3: every rank must call it
            if rank == 0:
                full[name] = t.detach().to("cpu", torch.float32).clone()
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        sd = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        full = {k: v.detach().to("cpu", torch.float32).clone() for k, v in sd.items()} if rank == 0 else {}
    if rank != 0:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save as st_save

        path = out_dir / "model.safetensors"
        ckptdir.write_file_durably(path, st_save({k: v.contiguous() for k, v in full.items()},
                                                 metadata={"format": "pt", "dtlaunch": __version__}))
    else:
        path = out_dir / "model.pt"
        _save_torch(full, path)
    return path


__all__ = ["Checkpointer", "export_model"]
