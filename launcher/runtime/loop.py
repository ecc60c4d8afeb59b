"""The training loop: assemble the parts, resume, train, checkpoint, stop cleanly.

Each step ends with one small collective that every rank must reach with the same step number: it
carries the loss for logging, the preemption flag (so all ranks stop together), and each rank's step,
so an off-by-one divergence - which timeouts cannot see - ends the job at once with HANG.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from .. import catalog, jobenv
from ..jobenv import ExitCode
from ..plan.cost import checkpoint_bytes, flops_per_token
from . import ckptdir
from . import preflight as preflight_mod
from .agreement import Agreement, NonFiniteWatch, Reporter, StepSync
from .check import check_model
from .checkpoint import Checkpointer, export_model
from .checkpoint.compat import identity
from .ckptdir import expand_dir
from .data import Batches, build_dataloader, rescale_position
from .dist import World, init_distributed, set_collective_timeout
from .failures import ConfigError, Preempted, PreflightError, StorageError
from .faults import Faults
from .layout import resolve_layout
from .metrics import Metrics
from .models import build_for_recipe, init_on_meta
from .models.hf import load_weights
from .optim import apply_schedule
from .parallel import Engine, build_partitioned, builds_partitioned, wrap_model
from .signals import PreemptionFlag
from .stepgc import StepGC


def enable_determinism() -> None:
    """Bit-reproducible kernels: a restarted run must end with the same weights as an uninterrupted one. The
    environment part (cuBLAS, NCCL) is jobenv's, set before the process group exists. Deterministic mode would
    also fill every new tensor's memory (a kernel per torch.empty); the runtime reads only memory it wrote."""
    for k, v in jobenv.DETERMINISTIC_ENV.items():
        os.environ.setdefault(k, v)
    import torch.utils.deterministic

    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.benchmark = False


class Watchdog:
    """Backstop for what no collective timeout catches: a rank stuck outside communication.

    Exits with HANG when no step finishes within `limit` seconds, or when a signal (SIGTERM from
    torchrun tearing the world down after a peer failed, or a preemption) was received and no step
    boundary follows within `grace` seconds: a stuck rank would otherwise ignore torchrun's SIGTERM
    (the handler only sets a flag) and delay the restart until torchrun's SIGKILL 30 s later.
    """

    def __init__(self, limit: float, grace: float, rank: int, flag: PreemptionFlag | None = None):
        self.limit, self.grace, self.rank, self.flag = limit, grace, rank, flag
        self.step = 0
        self.armed = False
        self.last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="dtlaunch-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        self.step, self.last, self.armed = step, time.monotonic(), True

    def pause(self) -> None:
        self.armed = False

    def _exit(self, why: str) -> None:
        print(
            f"dtlaunch: rank {self.rank}: {why} (last completed step {self.step}): exiting with HANG ({ExitCode.HANG})",
            file=sys.stderr,
            flush=True,
        )
        os._exit(ExitCode.HANG)

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            if not self.armed:
                continue
            now = time.monotonic()
            if now - self.last > self.limit:
                self._exit(f"no progress for {self.limit:.0f}s")
            sig_at = self.flag.received_at if self.flag is not None else None
            if sig_at is not None and now - max(sig_at, self.last) > self.grace:
                self._exit(f"received {self.flag.received} but reached no step boundary within {self.grace:.0f}s")


class Trainer:
    """Runs one recipe's plan to completion (or to preemption). Collective: every rank runs it."""

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
        self.step = 0  # optimizer steps completed
        self.start_step = 0  # the step this attempt resumed from
        self.current: int | None = None  # the step being trained
        self.nonfinite: NonFiniteWatch | None = None  # built with the loop (it counts on this rank's device)
        # Installed as early as possible by the entry point: a preemption during start-up is not lost.
        self.flag = flag or PreemptionFlag().install()
        if plan.steps is None:
            raise ConfigError("the recipe gives no training length", fix="set training.steps or training.tokens")
        self.total_steps: int = plan.steps
        self.every: int = plan.checkpoint_every
        self.seq_len: int = plan.seq_len
        # Built by _setup, once the world exists (they need this rank's place in it).
        self.faults: Faults | None = None
        self.metrics: Metrics | None = None
        self.layout = None  # the RuntimeLayout: the plan at this world size
        self.shape = recipe.model.shape()
        self.ckpt_root: Path | None = None
        self.engine: Engine | None = None
        self.batches: Batches | None = None
        self.checkpointer: Checkpointer | None = None
        self.watchdog: Watchdog | None = None

    # ------------------------------------------------------------------ assembly

    def _setup(self) -> None:
        rec, plan = self.recipe, self.plan
        tr = rec.training
        if tr.deterministic:
            enable_determinism()
        self.world = self.world or init_distributed(rec, plan)
        w = self.world
        self.faults = Faults(w.rank, w.proc.restart_count)
        self.metrics = Metrics(self.run_dir, enabled=w.is_main, total_steps=plan.steps, is_gpu=w.is_gpu)
        self.layout, notes = resolve_layout(plan, w.world_size)
        for n in notes:
            self.metrics.log(n)
        check_model(rec)
        shape = self.shape
        self.ckpt_root = Path(
            os.path.expanduser(
                os.environ.get(jobenv.CHECKPOINT_DIR)
                or str(expand_dir(rec.checkpoint.dir, self.run_dir, os.environ.get(jobenv.RUN_ID)))
            )
        )
        # sharded layouts build on meta: each rank materialises only its shards (of its stages)
        meta = init_on_meta(rec.model, self.layout, plan.params)
        self.metrics.event(
            "start",
            world_size=w.world_size,
            strategy=self.layout.strategy,
            layout=self.layout.describe(),
            precision=self.layout.precision,
            grad_accum=self.layout.grad_accum,
            global_batch=self.layout.global_batch,
            attempt=w.proc.restart_count,
            init="partitioned" if builds_partitioned(self.layout, rec.model) else "meta" if meta else "eager",
        )
        if tr.preflight:
            self._preflight()
        torch.manual_seed(tr.seed)  # the same initial weights on every rank and every attempt
        if builds_partitioned(self.layout, rec.model):
            module = build_partitioned(rec, plan, self.layout, w.rank, w.device, w.is_gpu)
        else:
            module = build_for_recipe(
                rec.model, self.layout.activation_checkpointing, device="meta" if meta else "cpu", seed=tr.seed
            )
        weights = rec.model.hf_weights if not ckptdir.complete_steps(self.ckpt_root) else None
        if weights and not meta:  # fine-tuning: every rank reads the weights before the strategy wraps the model
            n = load_weights(module, weights, sharded=False)
            self.metrics.log(f"loaded {n} tensors of pretrained weights from {weights}")
        self.engine = wrap_model(module, self.layout, rec, plan, self.total_steps, w.device, w.is_gpu)
        if weights and meta:  # built on meta and sharded: rank 0 reads, FSDP2 shards are filled by broadcast
            n = load_weights(module, weights, sharded=True, rank=w.rank)
            self.metrics.log(f"loaded {n} tensors of pretrained weights from {weights} (sharded)")
        ds_config = getattr(self.engine, "config", None)
        if ds_config is not None and w.is_main:  # what deepspeed.initialize really got, for the record
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "deepspeed_config.json").write_text(json.dumps(ds_config, indent=2, sort_keys=True) + "\n")
        # Ranks of one tensor-parallel group and one pipeline read the same data: the data-parallel rank's.
        _, dp_rank, _ = self.layout.coords(w.rank)
        self.batches = build_dataloader(
            tr.data,
            vocab=shape.vocab,
            seq_len=self.seq_len,
            micro_batch=self.layout.micro_batch,
            grad_accum=self.layout.grad_accum,
            rank=dp_rank,
            world_size=self.layout.dp,
            seed=tr.seed,
            device=w.device,
            is_gpu=w.is_gpu,
        )
        static_meta = {
            "recipe_hash": self.recipe_hash,
            "identity": identity(rec.to_dict()),
            "strategy": self.layout.strategy,
            "family": self.layout.family,
            "precision": self.layout.precision,
            "grad_accum": self.layout.grad_accum,
            "global_batch": self.layout.global_batch,
            "micro_batch": self.layout.micro_batch,
            "dp": self.layout.dp,
            "tp": self.layout.tp,
            "pp": self.layout.pp,
            "layout": self.layout.describe(),
            "seed": tr.seed,
            "shape": {
                k: getattr(shape, k)
                for k in ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "tied_embeddings")
            },
        }
        self.checkpointer = Checkpointer(
            self.ckpt_root,
            self.engine,
            rank=w.rank,
            world_size=w.world_size,
            keep=rec.checkpoint.keep,
            async_save=rec.checkpoint.async_,
            meta=static_meta,
            group=w.checkpoint_group,
            faults=self.faults,
            log=self.metrics.log,
            event=self.metrics.event,
            allow_changed_recipe=rec.checkpoint.resume_changed_recipe,
            run_id=os.environ.get(jobenv.RUN_ID),
        )

    def _preflight(self) -> None:
        w, rec = self.world, self.recipe
        net = catalog.NETWORKS[rec.resources.network]
        size = checkpoint_bytes(self.plan.params, rec.training.optimizer)
        rep = preflight_mod.run(
            world=w,
            network=net,
            checkpoint_dir=self.ckpt_root,
            checkpoint_bytes=size,
            keep=rec.checkpoint.keep,
            min_allreduce_fraction=rec.training.min_allreduce_fraction,
        )
        for line in rep.lines:
            self.metrics.log(f"preflight: {line}")
        self.metrics.event("preflight", ok=not rep.failures, failures=rep.failures, **rep.figures)
        if rep.failures and rep.storage:
            raise StorageError(
                "preflight failed before any training step:\n  - " + "\n  - ".join(rep.failures),
                fix="free space in the checkpoint directory (or point checkpoint.dir at larger "
                "storage), then run again",
            )
        if rep.failures:
            raise PreflightError(
                "preflight failed before any training step:\n  - " + "\n  - ".join(rep.failures),
                fix="fix the nodes or the recipe (training.preflight: false skips these checks)",
            )

    # ------------------------------------------------------------------ resume

    def _resume(self) -> None:
        cp = self.checkpointer
        cp.prepare()
        t0 = time.time()
        saved = cp.restore_latest()
        if saved is None:
            self.metrics.log(f"no checkpoint in {self.ckpt_root}: starting from step 0")
            return
        apply_schedule(self.engine.optimizer, self.engine.scheduler)  # this run's schedule, not the saved one's
        self.step = self.start_step = int(saved["step"])
        pos, warn = rescale_position(saved["data"], self.layout.global_batch)
        self.batches.seek(pos)
        warnings = list(saved["warnings"]) + ([warn] if warn else [])
        changed = f"; changed: {', '.join(warnings)}" if warnings else ""
        self.metrics.log(
            f"resumed from step {self.step} ({saved['path']}, saved by {saved.get('world_size')} ranks "
            f"with {saved.get('strategy')}, data epoch {pos.epoch} batch {pos.step_in_epoch}, "
            f"{time.time() - t0:.2f}s){changed}"
        )
        for wmsg in warnings:
            self.metrics.log(f"note: resuming with a change: {wmsg}")
        self.metrics.event(
            "resume",
            step=self.step,
            path=saved["path"],
            from_world_size=saved.get("world_size"),
            world_size=self.world.world_size,
            warnings=warnings,
            data=pos.to_dict(),
        )

    # ------------------------------------------------------------------ the step

    def _train_step(self) -> tuple[torch.Tensor, dict]:
        loss = self.engine.forward_backward(self.batches.next_step())
        info = self.engine.step()
        if self.faults.hit("nan_loss", self.step + 1):
            loss = loss * float("nan")
        return loss, info

    def _save(self, blocking: bool, reason: str) -> None:
        self.watchdog.pause()
        self.checkpointer.save(self.step, self.batches.position.to_dict(), blocking=blocking, reason=reason)
        if blocking:
            self.checkpointer.wait()

    def _preempt(self, agreed: Agreement, flag: PreemptionFlag, finite: bool) -> None:
        who = f"rank{'s' if len(agreed.signalled) > 1 else ''} {', '.join(map(str, agreed.signalled))}"
        if finite:
            self.metrics.log(
                f"preemption signal ({flag.received or 'a signal'} on {who}) at step {self.step}: "
                f"saving a checkpoint, then exiting with {ExitCode.PREEMPTED}"
            )
            self._save(blocking=True, reason="preempt")
        else:
            self.metrics.log(
                f"preemption signal at step {self.step} with a non-finite loss: exiting without a "
                "checkpoint (the previous one is the last good state)"
            )
        self.metrics.event("preempt", step=self.step, signal=flag.received, ranks=list(agreed.signalled), saved=finite)
        raise Preempted(f"preempted at step {self.step}; checkpoint written, resubmit to resume", step=self.step)

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
        self._setup()
        self._resume()
        tr = self.recipe.training
        w = self.world
        flag = self.flag
        # The first step runs under the long start-up timeouts (lazy initialisation, first allocations); then every
        # training group gets training.timeout_seconds, and the watchdog the same bound.
        self.watchdog = Watchdog(
            jobenv.watchdog_seconds(tr.init_timeout_seconds), max(5.0, tr.timeout_seconds), w.rank, flag
        )
        sync = StepSync(w, skip=lambda step: self.faults.hit("skip_collective", step) is not None)
        watch = NonFiniteWatch(tr.max_nonfinite_steps, w.device, self.metrics.log)
        self.nonfinite = watch
        reporter = Reporter(
            sync,
            watch,
            self.metrics,
            is_gpu=w.is_gpu,
            tokens_per_step=self.layout.global_batch * self.seq_len,
            flops_per_token=flops_per_token(self.plan.params, self.shape, self.seq_len),
            world_size=w.world_size,
        )
        last_saved = self.step if self.step else None
        first = True
        self.watchdog.beat(self.step)
        try:
            with StepGC() as collector:
                while self.step < self.total_steps:
                    self.current = self.step + 1
                    self.faults.at_step_start(self.current)
                    lr = self.engine.lr  # the rate this step uses (the scheduler advances inside the step)
                    loss, info = self._train_step()
                    self.step += 1
                    if self.faults.hit("desync_step", self.step):
                        self.step += 1
                    watch.update(loss, self.step)
                    agreed = sync.agree(self.step, flag.received is not None)
                    reporter.tick(info)
                    if first:
                        set_collective_timeout(w, tr.timeout_seconds)
                        self.watchdog.limit = jobenv.watchdog_seconds(tr.timeout_seconds)
                        first = False
                    last = self.step == self.total_steps
                    log = self.step % tr.log_every == 0 or last or agreed.stop
                    due = self.step % self.every == 0 and not last
                    finite = True
                    if log or due:
                        mean_loss, finite, memory = reporter.check(self.step, loss, log=log)
                        if log:
                            reporter.log(self.step, mean_loss, lr, memory)
                    self.checkpointer.poll()
                    if agreed.stop and not last:
                        self._preempt(agreed, flag, finite)
                    if finite and due:
                        self._save(blocking=False, reason="interval")
                        last_saved = self.step
                    collector.step(self.step)
                    self.watchdog.beat(self.step)
                    yield self.step
            self.watchdog.pause()
            if last_saved != self.step and watch.count == 0:
                self._save(blocking=True, reason="final")
            self.checkpointer.close()
            out = export_model(self.engine, self.run_dir, self.recipe.checkpoint.export, w.rank, w.checkpoint_group)
            if out is not None:
                self.metrics.log(f"exported the trained weights to {out}")
                self.metrics.event("export", path=str(out), step=self.step)
            self.metrics.event("end", step=self.step)
            self.metrics.log(f"done: {self.step} steps")
        finally:
            flag.uninstall()
            self.watchdog.pause()
            self.metrics.close()
