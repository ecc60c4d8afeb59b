"""The training loop: assemble the parts, resume, train, checkpoint, stop cleanly.

The lifecycle around the steps is the library's (launcher.runtime.job.Job), so dtlaunch's loop and a user's
own keep the same promises: each step ends with one small collective that every rank must reach with the same
step number, carrying the preemption flag (so all ranks stop together) and each rank's step, so an off-by-one
divergence - which timeouts cannot see - ends the job at once with HANG.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .. import catalog, jobenv
from ..jobenv import ExitCode
from ..plan.cost import checkpoint_bytes
from ..plan.layout import Layout
from ..validate.rules_runtime import eval_with_pipeline
from . import preflight as preflight_mod
from .checkpoint import disk
from .checkpoint.checkpointer import Checkpointer
from .checkpoint.compat import identity
from .checkpoint.export import export_model
from .data import Batches, EvalData, build_dataloader, build_eval_data, held_out_sequences, rescale_position
from .dist import World, enable_determinism, init_distributed
from .engines import Engine, build_engine, build_partitioned, builds_partitioned
from .failures import ConfigError, Preempted, PreflightError, StorageError
from .hangs import Watchdog
from .inject import Faults
from .job import Job
from .loss import cross_entropy
from .metrics import Metrics
from .models import build_for_recipe, init_on_meta
from .models.hf import load_weights
from .nodecheck import check_model
from .signals import PreemptionFlag
from .stepgc import StepGC


@dataclass
class _Parts:
    """What one attempt trains with, built by `Trainer._setup` once the world exists: kept together and never
    None, so that the loop uses them without checking each one."""

    world: World
    faults: Faults
    job: Job
    engine: Engine
    batches: Batches
    eval_data: EvalData | None  # the held-out data, when training.eval_every asks for a validation loss


class Trainer:
    """Runs one recipe's plan to completion (or to preemption). Collective: every rank runs it.

    It builds dtlaunch's model, data and engine; the run's lifecycle around them (the per-step agreement, logs,
    checkpoint cadence, preemption, the final checkpoint) is the library's `Job`, the same as a user's loop gets."""

    def __init__(
        self,
        recipe,
        plan,
        run_dir: str | os.PathLike,
        *,
        recipe_hash: str | None = None,
        world: World | None = None,
        flag: PreemptionFlag | None = None,
    ):
        self.recipe, self.plan, self.run_dir = recipe, plan, Path(run_dir)
        self.recipe_hash = recipe_hash or recipe.digest()
        self.world = world
        self.current: int | None = None  # the step being trained
        # Installed as early as possible by the entry point: a preemption during start-up is not lost.
        self.flag = flag or PreemptionFlag().install()
        if plan.steps is None:
            raise ConfigError("the recipe gives no training length", fix="set training.steps or training.tokens")
        self.total_steps: int = plan.steps
        self.every: int = plan.checkpoint_every
        self.seq_len: int = plan.seq_len
        self.shape = recipe.model.shape()
        # Built by _setup, once the world exists (they need this rank's place in it). Each is set as soon as it
        # is built, so that after a failed set-up the caller still sees what there was (writes_flight_recorder).
        self.job: Job | None = None  # the lifecycle
        self.faults: Faults | None = None
        self.metrics: Metrics | None = None
        self.layout: Layout | None = None  # the plan's Layout for this world (Layout.for_world)
        self.ckpt_root: Path | None = None
        self.engine: Engine | None = None
        self.batches: Batches | None = None
        self.checkpointer: Checkpointer | None = None
        self.watchdog: Watchdog | None = None
        self._parts: _Parts | None = None  # what the loop uses of them, once _setup has finished

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self.job.step if self.job is not None else 0

    @property
    def start_step(self) -> int:
        """The step this attempt resumed from."""
        return self.job.start_step if self.job is not None else 0

    @property
    def _built(self) -> _Parts:
        if self._parts is None:
            raise RuntimeError("the trainer is not set up: Trainer.steps() sets it up before its first step")
        return self._parts

    # ------------------------------------------------------------------ assembly

    def _setup(self) -> _Parts:
        rec, plan = self.recipe, self.plan
        tr = rec.training
        if tr.deterministic:
            enable_determinism()
        w = self.world = self.world or init_distributed(rec, plan)
        faults = self.faults = Faults(w.rank, w.proc.restart_count)
        job = self.job = Job(rec, plan, self.run_dir, w, self.flag, faults=faults)
        metrics, layout = job.metrics, job.layout
        self.metrics, self.layout, self.ckpt_root = metrics, layout, job.checkpoint_dir
        check_model(rec)
        refused = eval_with_pipeline(rec, plan)
        if refused:
            raise ConfigError(refused[0], fix=refused[1])
        shape = self.shape
        # sharded layouts build on meta: each rank materialises only its shards (of its stages)
        meta = init_on_meta(rec.model, layout, plan.params)
        metrics.event(
            "start",
            world_size=w.world_size,
            strategy=layout.strategy,
            layout=layout.describe(),
            precision=layout.precision,
            grad_accum=layout.grad_accum,
            global_batch=layout.global_batch,
            attempt=w.proc.restart_count,
            init="partitioned" if builds_partitioned(layout, rec.model) else "meta" if meta else "eager",
            allocation_start=jobenv.allocation_start(),
        )
        if tr.preflight:
            self._preflight(w, job, faults)
        torch.manual_seed(tr.seed)  # the same initial weights on every rank and every attempt
        if builds_partitioned(layout, rec.model):
            module = build_partitioned(rec, plan, layout, w.rank, w.device, w.is_gpu)
        else:
            module = build_for_recipe(
                rec.model, layout.activation_checkpointing, device="meta" if meta else "cpu", seed=tr.seed
            )
        weights = rec.model.hf_weights if not disk.complete_steps(job.checkpoint_dir) else None
        if weights and not meta:  # fine-tuning: every rank reads the weights before the strategy wraps the model
            n = load_weights(module, weights, sharded=False)
            metrics.log(f"loaded {n} tensors of pretrained weights from {weights}")
        engine = self.engine = build_engine(module, layout, rec, plan, self.total_steps, w.device, w.is_gpu)
        if weights and meta:  # built on meta and sharded: rank 0 reads, FSDP2 shards are filled by broadcast
            n = load_weights(module, weights, sharded=True, rank=w.rank)
            metrics.log(f"loaded {n} tensors of pretrained weights from {weights} (sharded)")
        ds_config = getattr(engine, "config", None)
        if ds_config is not None and w.is_main:  # what deepspeed.initialize really got, for the record
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "deepspeed_config.json").write_text(json.dumps(ds_config, indent=2, sort_keys=True) + "\n")
        # Ranks of one tensor-parallel group and one pipeline read the same data: the data-parallel rank's.
        _, dp_rank, _ = layout.coords(w.rank)
        batches = self.batches = build_dataloader(
            tr.data,
            vocab=shape.vocab,
            seq_len=self.seq_len,
            micro_batch=layout.micro_batch,
            grad_accum=layout.grad_accum,
            rank=dp_rank,
            world_size=layout.dp,
            seed=tr.seed,
            device=w.device,
            is_gpu=w.is_gpu,
            held_out=held_out_sequences(layout.global_batch, tr.eval_batches) if tr.eval_every else 0,
        )
        eval_data = None
        if tr.eval_every:
            eval_data = build_eval_data(
                tr.data,
                vocab=shape.vocab,
                seq_len=self.seq_len,
                micro_batch=layout.micro_batch,
                global_batch=layout.global_batch,
                eval_batches=tr.eval_batches,
                rank=dp_rank,
                world_size=layout.dp,
                seed=tr.seed,
            )
        static_meta = {
            "recipe_hash": self.recipe_hash,
            "identity": identity(rec.to_dict()),
            "strategy": layout.strategy,
            "family": layout.family,
            "precision": layout.precision,
            "grad_accum": layout.grad_accum,
            "global_batch": layout.global_batch,
            "micro_batch": layout.micro_batch,
            "dp": layout.dp,
            "tp": layout.tp,
            "pp": layout.pp,
            "layout": layout.describe(),
            "seed": tr.seed,
            "shape": {
                k: getattr(shape, k)
                for k in ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "tied_embeddings")
            },
        }
        self.checkpointer = job.attach(engine, static_meta)
        return _Parts(w, faults, job, engine, batches, eval_data)

    def _preflight(self, w: World, job: Job, faults: Faults) -> None:
        rec = self.recipe
        net = catalog.NETWORKS[rec.resources.network]
        size = checkpoint_bytes(self.plan.params, rec.training.optimizer)
        rep = preflight_mod.run(
            world=w,
            network=net,
            checkpoint_dir=job.checkpoint_dir,
            checkpoint_bytes=size,
            keep=rec.checkpoint.keep,
            min_allreduce_fraction=rec.training.min_allreduce_fraction,
            link_delay=float(f.params.get("seconds", 0.05)) if (f := faults.hit("slow_link", 0)) else 0.0,
            gemm_delay=faults.slow_seconds(0),
        )
        for line in rep.lines:
            job.metrics.log(f"preflight: {line}")
        job.metrics.event("preflight", ok=not rep.failures, failures=rep.failures, **rep.figures)
        if rep.failures and rep.storage:
            raise StorageError(
                "preflight failed before any training step:\n  - " + "\n  - ".join(rep.failures),
                fix="free space in the checkpoint directory (or point checkpoint.dir at larger "
                "storage), then run again",
            )
        if rep.failures and rep.culprits and jobenv.node_name() not in rep.culprits:
            # the failure is localised to other nodes: this node's ranks end as a stop (42), so that only the
            # culprits' records say 44 with their node, and the SLURM job script excludes those alone
            raise Preempted(
                "preflight failed on node(s) "
                + ", ".join(rep.culprits)
                + ", not this one:\n  - "
                + "\n  - ".join(rep.failures),
                fix="the job is requeued without them (SLURM), or exclude them and resubmit",
            )
        if rep.failures:
            raise PreflightError(
                "preflight failed before any training step:\n  - " + "\n  - ".join(rep.failures),
                fix="fix the nodes or the recipe (training.preflight: false skips these checks)",
            )

    # ------------------------------------------------------------------ resume

    def _seek(self, saved: dict) -> tuple[str, dict, str | None]:
        """The data loader at a checkpoint's position (rescaled to this global batch): for the resume record."""
        p = self._built
        pos, warn = rescale_position(saved, p.job.layout.global_batch)
        p.batches.seek(pos)
        return f", data epoch {pos.epoch} batch {pos.step_in_epoch}", pos.to_dict(), warn

    # ------------------------------------------------------------------ the step

    def _train_step(self, step: int) -> tuple[torch.Tensor, dict]:
        if os.environ.get(jobenv.TRACK_MEMORY) == str(step):  # `dtlaunch rehearse`: this step's tensors, counted
            from .memtrack import tracked

            p = self._built
            with tracked(p.engine, p.job.run_dir, p.world.rank):
                return self._step(step)
        return self._step(step)

    def _step(self, step: int) -> tuple[torch.Tensor, dict]:
        p = self._built
        loss = p.engine.forward_backward(p.batches.next_step())
        if p.faults.hit("drop_grads", step):
            for prm in p.engine.model.parameters():
                if prm.grad is not None:
                    prm.grad.zero_()
        info = p.engine.step()
        if p.faults.hit("nan_loss", step):
            loss = loss * float("nan")
        return loss, info

    def _evaluate(self, step: int) -> None:
        """The mean loss over the held-out data, in eval mode without gradients, averaged over the ranks as the
        training loss is (every rank evaluates: the forward of a sharded model is collective). Reads no training
        data and changes no weights, so the training losses are those of a run without it."""
        p = self._built
        data, engine, w = p.eval_data, p.engine, p.world
        if data is None:
            return
        t0 = time.perf_counter()
        model = engine.model
        autocast = getattr(engine, "autocast_dtype", None)  # DDP's mixed precision; FSDP2 and ZeRO cast themselves
        total = torch.zeros((), dtype=torch.float32, device=w.device)
        count = 0
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for x, y in data.micro_batches(w.device):
                    with (
                        torch.autocast(w.device.type, dtype=autocast)
                        if autocast is not None
                        else contextlib.nullcontext()
                    ):
                        total += cross_entropy(model(x), y).float()
                    count += 1
        finally:
            model.train(training)
        loss = total / max(1, count)
        if w.distributed:
            dist.all_reduce(loss)
            loss /= w.world_size
        p.job.metrics.validation(step, float(loss), sequences=len(data.dataset), seconds=time.perf_counter() - t0)
        p.job.restart_window()  # the next tokens/s is training's, without the evaluation's time

    def _position(self) -> dict:
        return self._built.batches.position.to_dict()

    def _export(self) -> None:
        p = self._built
        w = p.world
        out = export_model(p.engine, self.run_dir, self.recipe.checkpoint.export, w.rank, w.checkpoint_group)
        if out is not None:
            p.job.metrics.log(f"exported the trained weights to {out}")
            p.job.metrics.event("export", path=str(out), step=self.step)

    def writes_flight_recorder(self) -> bool:
        """Does this rank's NCCL write a flight-recorder dump when a collective times out (or a drill says it
        does)? Only then is there a dump to wait for before exiting."""
        nccl = self.world is not None and "nccl" in self.world.backend
        return nccl or bool(self.faults and self.faults.fired("comm_abort"))

    def run(self) -> int:
        """Train to the plan's last step (or until preempted, which raises); ExitCode.OK at the end."""
        for _ in self.steps():
            pass
        return ExitCode.OK

    def steps(self) -> Iterator[int]:
        """The run, one optimizer step at a time: set up and resume on the first `next()`, then yield each
        completed step number; the final checkpoint, export and clean-up follow the last one.

        Why a generator: a caller can put its own work between our steps in the same process group, with
        everything the loop does per step (agreement collective, logging, polls) still inside each step.
        The trainer-overhead benchmark uses this to alternate a few of our steps with a few of a
        hand-written loop's, so both see the same machine at nearly the same time. Every rank must drive
        it in step with the others (each step ends in a collective), and drive it to the end or `close()`
        it: the clean-up (signal handlers restored, metrics closed) runs then. While it is suspended, the
        run's process settings stay in force for the caller too (automatic garbage collection off: StepGC).
        """
        p = self._parts = self._setup()
        job, faults, engine, tr = p.job, p.faults, p.engine, self.recipe.training
        job.restore(seek=self._seek)
        # The first step runs under the long start-up timeouts (lazy initialisation, first allocations); then every
        # training group gets training.timeout_seconds (job.end_step), and the watchdog the same bound.
        watchdog = self.watchdog = job.watchdog = Watchdog(
            jobenv.watchdog_seconds(tr.init_timeout_seconds), max(5.0, tr.timeout_seconds), p.world.rank, self.flag
        )
        watchdog.beat(job.step)
        try:
            with StepGC() as collector:
                while job.step < self.total_steps:
                    current = self.current = job.step + 1
                    faults.at_step_start(current)
                    lr = engine.lr  # the rate this step uses (the scheduler advances inside the step)
                    loss, info = self._train_step(current)
                    step = current + (1 if faults.hit("desync_step", current) else 0)
                    job.end_step(step, loss, position=self._position, info=info, lr=lr)
                    if tr.eval_every and job.step % tr.eval_every == 0:
                        self._evaluate(job.step)
                    watchdog.limit = jobenv.watchdog_seconds(tr.timeout_seconds)  # past the first step
                    collector.step(job.step)
                    watchdog.beat(job.step)
                    yield job.step
            watchdog.pause()
            job.complete(self._position(), export=self._export)
        finally:
            watchdog.pause()
            job.release()
