"""dtlaunch's runtime for the user's own training loop: what `python -m launcher.runtime.train` does for its own
model, in a handful of calls a plain PyTorch script can make.

    import launcher

    job = launcher.init()                        # the plan, the process group with its timeouts, the device
    engine = job.wrap(model)                     # the plan's strategy: DDP, FSDP2, or DeepSpeed ZeRO
    state = job.resume()                         # the newest good checkpoint, if any: {} on a fresh start
    for step in range(job.step + 1, job.total_steps + 1):
        for i in range(engine.grad_accum):
            x, y = next_batch()
            loss = engine.accumulate(lambda m: loss_fn(m(x), y), last=i == engine.grad_accum - 1)
        engine.step()
        job.step_done(step, loss=loss, state={"epoch": epoch, "batch": i})
    job.finish()

`step_done` is where the promises are kept: the preemption flag (TERM, or the USR2 a scheduler sends
before the time limit) is agreed across ranks, so all of them checkpoint the same step and the process
exits 42, which the job scripts requeue; checkpoints are written atomically (verified on resume, the
newest good one wins) at the plan's interval; metrics go to the run directory. `state` is the user's own
resume position (JSON): it comes back from `resume()`, so nothing trained is lost and nothing is trained
twice. A collective that times out raises, and launcher.runtime.entry turns it into exit 43 (restart).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import jobenv
from ..jobenv import ExitCode, read_metrics
from ..plan.cost import flops_per_token
from ..plan.layout import Layout
from ..plan.ledger import LEDGER_FILE, entry, log_line
from .agreement import Agreement, NonFiniteWatch, Reporter, StepSync
from .checkpoint import dcpio
from .checkpoint.checkpointer import Checkpointer
from .checkpoint.compat import identity
from .checkpoint.disk import expand_dir, write_file_durably
from .dist import World, init_distributed, node_names, set_collective_timeout, shutdown
from .engines import Engine, build_engine
from .failures import ConfigError, Preempted, PreflightError
from .inject import Faults
from .metrics import Metrics, check_tracking
from .optim import apply_schedule
from .signals import PreemptionFlag
from .status import Timeouts, record_progress
from .stragglers import CollectiveClock, ComputeClock, Straggler, StragglerWatch

if TYPE_CHECKING:
    from .hangs import Watchdog

FALLBACK_STEPS = 10**9  # schedules need a length; a plan without one trains until the user's loop stops


class Job:
    """One rank's view of the job, and the one lifecycle of a run: the user's loop calls wrap, resume, step_done
    and finish; dtlaunch's own loop (launcher.runtime.loop.Trainer) builds its model itself and drives the same
    lifecycle through attach, restore, end_step, complete and release. Collective methods run on every rank."""

    def __init__(
        self, recipe, plan, run_dir: Path, world: World, flag: PreemptionFlag, *, faults: Faults | None = None
    ):
        self.recipe, self.plan, self.run_dir, self.world, self.flag = recipe, plan, Path(run_dir), world, flag
        self.faults = faults  # test-only fault injection (the trainer's drills); None for the user's loop
        self.watchdog: Watchdog | None = None  # the trainer's: in its save mode while a checkpoint is written
        self.checkpoint_dir = Path(
            os.path.expanduser(
                os.environ.get(jobenv.CHECKPOINT_DIR)
                or str(expand_dir(recipe.checkpoint.dir, run_dir, os.environ.get(jobenv.RUN_ID)))
            )
        )
        # checkpoints kept apart from the run directory (a bucket beside a node's disk) keep its records too
        apart = not self.checkpoint_dir.resolve().is_relative_to(self.run_dir.resolve())
        self.metrics = Metrics(
            run_dir,
            enabled=world.is_main,
            total_steps=plan.steps or 0,
            is_gpu=world.is_gpu,
            keep_with=self.checkpoint_dir if apart else None,
        )
        self._open_sinks()
        self.layout: Layout
        self.layout, notes = plan.layout.for_world(world.world_size, plan.global_batch)
        for n in notes:
            self.metrics.log(n)
        self.total_steps: int | None = plan.steps
        self.every: int = plan.checkpoint_every
        self._began = time.time()  # this attempt's start: the records before it are the run's history
        self.step = 0  # the last completed (or resumed) optimizer step
        self.start_step = 0
        self.engine: Engine | None = None
        self.checkpointer: Checkpointer | None = None
        self._reapply_schedule = True
        self._first = True  # no step of this attempt is done yet: the start-up timeouts still hold
        self._last_saved: int | None = None
        self._position: dict = {}  # the resume position at the last step, for the final checkpoint
        self.nonfinite = NonFiniteWatch(recipe.training.max_nonfinite_steps, world.device, self.metrics.log)
        self._sync = StepSync(
            world, skip=lambda step: faults is not None and faults.hit("skip_collective", step) is not None
        )
        throttle = (lambda: faults.slow_seconds(self.step + 1)) if faults else None
        self._reporter = Reporter(
            self._sync,
            self.nonfinite,
            self.metrics,
            is_gpu=world.is_gpu,
            tokens_per_step=self.layout.global_batch * plan.seq_len,
            flops_per_token=flops_per_token(plan.params, recipe.model.shape(), plan.seq_len),
            world_size=world.world_size,
            clock=ComputeClock(world.is_gpu, throttle),
            stragglers=StragglerWatch(node_names(world)) if self._sync.distributed else None,
            collectives=CollectiveClock(world.is_gpu, _own_groups(world)) if self._sync.distributed else None,
        )

    def _open_sinks(self) -> None:
        """TensorBoard and W&B when the recipe selects them, for dtlaunch's trainer and a user's loop alike; before
        any model is built, so that a refused W&B start ends the job before the expensive part."""
        tracking = self.recipe.training.tracking
        check_tracking(tracking)
        config = self.recipe.to_dict()
        config["env"] = sorted(config["env"])  # the names only: a value may be a token, and W&B keeps the config
        run_id = os.environ.get(jobenv.RUN_ID) or self.recipe.run_id or self.recipe.job_name
        self.metrics.open_sinks(tracking, run_id=run_id, name=self.recipe.job_name, config=config)

    def restart_window(self) -> None:
        """The next logged tokens/s counts from now: time spent outside training (an evaluation) is left out."""
        self._reporter.restart_window()

    # ------------------------------------------------------------------ facts the loop needs

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def device(self) -> torch.device:
        return self.world.device

    @property
    def micro_batch(self) -> int:
        return self.layout.micro_batch

    @property
    def grad_accum(self) -> int:
        return self.layout.grad_accum

    @property
    def stopping(self) -> bool:
        """A preemption signal reached this rank (step_done acts on it for every rank together)."""
        return self.flag.received is not None

    # ------------------------------------------------------------------ assembly

    def wrap(
        self,
        model: nn.Module,
        *,
        blocks: list[nn.Module] | None = None,
        optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    ) -> Engine:
        """Wrap `model` for the plan's strategy; returns the Engine (its `model` runs forward).

        `blocks` are the repeated layers FSDP2 shards one by one (default: the model's `layers`, or its
        largest ModuleList); `optimizer(params)` builds the optimizer (default: the recipe's training
        section; DeepSpeed wraps it as its client optimizer). The recipe's learning-rate schedule scales
        the optimizer's rate either way."""
        if self.engine is not None:
            raise ConfigError("job.wrap was called twice", fix="wrap one model per job")
        if self.layout.model_parallel:
            # Tensor parallelism needs the model's module names, a pipeline runs all of a step's micro-batches in
            # one schedule: neither fits a loop that calls engine.accumulate on a model of any shape.
            raise ConfigError(
                f"the plan uses tensor={self.layout.tp} pipeline={self.layout.pp}; job.wrap trains your "
                "own model data-parallel only (DDP, FSDP2, ZeRO)",
                fix="set parallelism.tensor: 1 and pipeline: 1, or train dtlaunch's Llama or a Hugging "
                "Face model (model.hf) without an entrypoint: python -m launcher.runtime.train splits them",
            )
        # the attempt's start in the records (dtlaunch's trainer writes its own, with the model's build): the
        # goodput ledger counts attempts by it
        self.metrics.event(
            "start",
            world_size=self.world_size,
            strategy=self.layout.strategy,
            attempt=self.world.proc.restart_count,
            entrypoint=True,
            allocation_start=jobenv.allocation_start(),
        )
        steps = self.total_steps or FALLBACK_STEPS
        engine = build_engine(
            model,
            self.layout,
            self.recipe,
            self.plan,
            steps,
            self.world.device,
            self.world.is_gpu,
            blocks=blocks,
            optimizer=optimizer,
        )
        rec = self.recipe
        meta = {
            "recipe_hash": rec.digest(),
            "identity": identity(rec.to_dict()),
            "strategy": self.layout.strategy,
            "family": self.layout.family,
            "precision": self.layout.precision,
            "grad_accum": self.layout.grad_accum,
            "global_batch": self.layout.global_batch,
            "micro_batch": self.layout.micro_batch,
            "dp": self.world_size,
            "tp": self.plan.layout.tp,
            "pp": self.plan.layout.pp,
            "seed": rec.training.seed,
            "shape": None,
            "entrypoint": True,
        }
        self.attach(engine, meta, reapply_schedule=self.layout.family != "deepspeed")
        return engine

    def attach(self, engine: Engine, meta: dict, *, reapply_schedule: bool = True) -> Checkpointer:
        """Take the wrapped model: its checkpoints go to the job's checkpoint directory, with `meta` (what a
        resume compares); `reapply_schedule`: a resume sets this run's learning rate (optim.apply_schedule)."""
        rec = self.recipe
        self.engine, self._reapply_schedule = engine, reapply_schedule
        engine.clock = self._reporter.clock  # times the forward passes: stragglers
        self.checkpointer = Checkpointer(
            self.checkpoint_dir,
            engine,
            rank=self.rank,
            world_size=self.world_size,
            keep=rec.checkpoint.keep,
            async_save=rec.checkpoint.async_,
            meta=meta,
            group=self.world.checkpoint_group,
            faults=self.faults,
            log=self.metrics.log,
            event=self.metrics.event,
            allow_changed_recipe=rec.checkpoint.resume_changed_recipe,
            run_id=os.environ.get(jobenv.RUN_ID),
        )
        return self.checkpointer

    def resume(self) -> dict:
        """Load the newest checkpoint that verifies (falling back past corrupt ones); return the `state`
        saved with it ({} on a fresh start). Sets `job.step`."""
        self._need_checkpointer("resume")
        saved = self.restore()
        return dict(saved.get("data") or {}) if saved is not None else {}

    def restore(self, seek: Callable[[dict], tuple[str, dict, str | None]] | None = None) -> dict | None:
        """Load the newest checkpoint that verifies into the engine and set `step`; its record, None on a fresh
        start. `seek(saved data)` moves the trainer's data loader there and returns (what to add to the log line,
        the position for the resume event, a warning or None)."""
        engine, cp = self._attached("restore")
        cp.prepare()
        if self.recipe.checkpoint.adapt:
            self._adapt_interval()
        t0 = time.time()
        saved = cp.restore_latest()
        if saved is None:
            self.metrics.log(f"no checkpoint in {self.checkpoint_dir}: starting from step 0")
            record_progress(start=0, step=0)
            self._reporter.restart_window()  # the first log window's clock: set-up is not training
            return None
        if self._reapply_schedule:  # this run's schedule, not the saved one's
            apply_schedule(engine.optimizer, engine.scheduler)
        self.step = self.start_step = self._last_saved = int(saved["step"])
        record_progress(start=self.step, step=self.step)
        where, data, warn = seek(saved["data"]) if seek is not None else ("", None, None)
        warnings = list(saved.get("warnings") or []) + ([warn] if warn else [])
        changed = f"; changed: {', '.join(warnings)}" if warnings else ""
        self.metrics.log(
            f"resumed from step {self.step} ({saved['path']}, saved by {saved.get('world_size')} ranks "
            f"with {saved.get('strategy')}{where}, {time.time() - t0:.2f}s){changed}"
        )
        for wmsg in warnings:
            self.metrics.log(f"note: resuming with a change: {wmsg}")
        extra = {"data": data} if data is not None else {}
        self.metrics.event(
            "resume",
            step=self.step,
            path=saved["path"],
            from_world_size=saved.get("world_size"),
            world_size=self.world_size,
            warnings=warnings,
            **extra,
        )
        self._reporter.restart_window()  # the first log window's clock: set-up and restore are not training
        return saved

    def _adapt_interval(self) -> None:
        """checkpoint.adapt: from this restart on, save at the interval the run's history calls for (the goodput
        ledger's measured interval); rank 0 reads the records and every rank takes its figure (collective)."""
        from .goodput import measured_interval

        advice = None
        if self.world.is_main and self.metrics.path.exists():
            history = [r for r in read_metrics(self.run_dir) if (r.get("time") or 0) < self._began]
            advice = measured_interval([*history, {"event": "start", "time": self._began}])
        if self._sync.distributed:
            import torch.distributed as dist

            box = [advice]
            dist.broadcast_object_list(box, src=0, group=self.world.control_group)
            advice = box[0]
        if advice is None:
            self.metrics.log(f"checkpoint.adapt: no interruption measured yet: saving every {self.every} steps")
            return
        planned, self.every = self.every, int(advice["every"])
        self.metrics.log(
            f"checkpoint.adapt: saving every {self.every} steps (was {planned}): an interruption every "
            f"{advice['between_interruptions_s']:.1f}s, a save {advice['write_s']:.2f}s, a recovery "
            f"{advice['recovery_s']:.1f}s, a step {advice['step_s']:.3g}s"
        )
        self.metrics.event("interval", **{**advice, "every": self.every, "planned": planned})

    def _need_checkpointer(self, what: str) -> Checkpointer:
        return self._attached(what)[1]

    def _attached(self, what: str) -> tuple[Engine, Checkpointer]:
        """The engine and its checkpointer, which `attach` (through `wrap`) sets together."""
        if self.engine is None or self.checkpointer is None:
            raise ConfigError(f"job.{what} needs the wrapped model", fix="call job.wrap(model) first")
        return self.engine, self.checkpointer

    # ------------------------------------------------------------------ the step

    def step_done(self, step: int, *, loss: Any = None, state: dict | None = None, **metrics: Any) -> None:
        """After each optimizer step: agree on stopping, log, and checkpoint when due (async) or when
        preempted (then raise Preempted: exit 42 after the checkpoint is committed). The loss (a tensor, kept
        on the device) is read only on log and checkpoint steps."""
        self._need_checkpointer("step_done")
        if step != self.step + 1:
            raise ConfigError(
                f"job.step_done({step}) after step {self.step}: steps must follow one another",
                fix="loop from job.step + 1 (after job.resume())",
            )
        value = loss.detach().float().mean() if isinstance(loss, torch.Tensor) else float(loss or 0.0)
        self.end_step(step, value, position=lambda: _json_state(state), extra=metrics or None)

    def end_step(
        self,
        step: int,
        loss: torch.Tensor | float,
        *,
        position: Callable[[], dict],
        info: dict | None = None,
        lr: float | None = None,
        extra: dict | None = None,
    ) -> None:
        """The end of optimizer step `step` on every rank: the agreement (the same step everywhere, else HangError;
        the preemption flag), the log line, the checkpoint when due, the stop when preempted (Preempted, after the
        checkpoint is committed). `position()`: the resume position a checkpoint of this step saves; `info`: the
        engine's step report; `lr`: the rate the step used (default: the engine's record of it)."""
        engine, cp = self._attached("end_step")
        self.nonfinite.update(loss, step)
        agreed = self._sync.agree(step, self.stopping)
        self.step = step
        record_progress(step=step)
        self._reporter.tick(info or {})
        if self._first:  # the first step of this attempt is done: the short timeouts from now on
            set_collective_timeout(self.world, self.recipe.training.timeout_seconds)
            self._first = False
        last = step == self.total_steps
        log = step % self.recipe.training.log_every == 0 or agreed.stop or last
        due = step % self.every == 0 and not last
        finite = True
        if log or due:
            mean_loss, finite, memory = self._reporter.check(step, loss, log=log)
            if log:
                lr = lr if lr is not None else engine.step_lr or engine.lr
                self._reporter.log(step, mean_loss, lr, memory, extra=extra)
        self._position = position()
        cp.poll()
        slow = self._reporter.stragglers.persistent() if log and self._reporter.stragglers else []
        if slow and self.recipe.training.on_straggler == "exit" and not last and not agreed.stop:
            self._straggler_stop(slow, finite)
        if agreed.stop and not last:  # on the last step the final checkpoint is the same save, and the run is done
            self._preempt(agreed, finite)
        if finite and due:
            self._save(self._position, blocking=False, reason="interval")

    def _preempt(self, agreed: Agreement, finite: bool) -> None:
        step, signal = self.step, self.flag.received
        if finite:
            self.metrics.log(
                f"preemption signal ({signal or 'a signal'} on {agreed.who}) at step {step}: "
                f"saving a checkpoint, then exiting with {ExitCode.PREEMPTED}"
            )
            self._save(self._position, blocking=True, reason="preempt")
        else:
            self.metrics.log(
                f"preemption signal at step {step} with a non-finite loss: exiting without a "
                "checkpoint (the previous one is the last good state)"
            )
        self.metrics.event("preempt", step=step, signal=signal, ranks=list(agreed.signalled), saved=finite)
        raise Preempted(f"preempted at step {step}; checkpoint written, resubmit to resume", step=step)

    def _straggler_stop(self, slow: list[Straggler], finite: bool) -> None:
        """training.on_straggler: exit. Every rank reached the same verdict from the same rows: all save this
        step; the straggler's ranks exit 44 (PREFLIGHT) naming their node, which the SLURM job script excludes
        before it requeues; the others exit 42 (PREEMPTED: a checkpoint was written, resume)."""
        step = self.step
        names = "; ".join(s.describe() for s in slow)
        self.metrics.log(
            f"persistent straggler at step {step} (training.on_straggler: exit): {names}; "
            + ("saving a checkpoint, then ending this attempt" if finite else "the loss is not finite: no checkpoint")
        )
        if finite:
            self._save(self._position, blocking=True, reason="straggler")
        self.metrics.event("straggler", step=step, stragglers=[s.record() for s in slow], saved=finite)
        mine = next((s for s in slow if s.rank == self.rank), None)
        if mine is not None:
            raise PreflightError(
                f"this rank is a persistent straggler: {mine.describe()}",
                fix="the job script excludes the node and requeues; check the node's GPUs, clocks and neighbours",
                step=step,
            )
        raise Preempted(f"stopped at step {step} for a straggler ({names}); checkpoint written, resume", step=step)

    def _save(self, position: dict, *, blocking: bool, reason: str) -> None:
        cp = self._need_checkpointer("save")
        tr = self.recipe.training
        limit = jobenv.save_watchdog_seconds(
            tr.init_timeout_seconds, tr.timeout_seconds, self.plan.checkpoint_write_seconds
        )
        # a save may outlast many steps: the watchdog's rules are the save's while it is written (on this thread)
        watching = self.watchdog.saving(limit, dcpio.last_write) if self.watchdog is not None else nullcontext()
        with watching:
            cp.save(self.step, position, blocking=blocking, reason=reason)
            if blocking:
                cp.wait()
        self._last_saved = self.step

    def timeout(self) -> Timeouts:
        """What the message of a collective that timed out says: where this rank was (writing a checkpoint, else
        None: the step says), and the recipe fields whose timeouts its collectives had. A save's collectives run
        on the checkpoint group, which keeps the long start-up timeout (and some strategies' on the training
        groups too); the training groups keep it until the attempt's first step is done."""
        tr = self.recipe.training
        training = (
            f"training.init_timeout_seconds={tr.init_timeout_seconds} until a first step is done"
            if self._first
            else f"training.timeout_seconds={tr.timeout_seconds}"
        )
        writing = self.checkpointer.writing if self.checkpointer is not None else None
        if writing is None:
            return Timeouts(None, training, training)
        return Timeouts(
            f"while writing the checkpoint of step {writing}",
            f"the checkpoint group's training.init_timeout_seconds={tr.init_timeout_seconds}; the training "
            f"groups' {training}",
            training,
        )

    def save(self, state: dict | None = None) -> None:
        """Checkpoint the current step now (blocking), e.g. at the end of an epoch."""
        self._need_checkpointer("save")
        self._save(_json_state(state), blocking=True, reason="user")

    def finish(self, state: dict | None = None) -> None:
        """The final checkpoint (unless the last step is already saved), then a clean exit of the world."""
        self._need_checkpointer("finish")
        try:
            self.complete(_json_state(state) if state is not None else self._position)
        finally:
            self.release()
        shutdown(self.world)

    # ------------------------------------------------------------------ the end

    def complete(self, position: dict, export: Callable[[], None] | None = None) -> None:
        """A run that trained to its end: the final checkpoint (unless this step is saved, or the loss is not
        finite), every save committed, `export()` (the trainer's weights export), the end record."""
        if self._last_saved != self.step and self.nonfinite.count == 0:
            self._save(position, blocking=True, reason="final")
        self._need_checkpointer("complete").close()
        if export is not None:
            export()
        self.metrics.event("end", step=self.step)
        self.metrics.log(f"done: {self.step} steps")

    def release(self) -> None:
        """On every ending: the previous signal handlers back, the metrics closed, the plan-vs-measured ledger
        (RUN_DIR/ledger.json) written from them."""
        self.flag.uninstall()
        self.metrics.close()
        if self.metrics.enabled:
            try:
                ledger = entry(self.recipe, self.plan, jobenv.read_metrics(self.run_dir), str(self.run_dir))
                write_file_durably(self.run_dir / LEDGER_FILE, (json.dumps(ledger, indent=2) + "\n").encode())
                print(log_line(ledger), flush=True)
            except (OSError, ValueError) as e:  # a figure not recorded must not fail a run that trained
                print(f"dtlaunch: WARNING: the ledger was not written ({e})", file=sys.stderr, flush=True)


def _json_state(state: dict | None) -> dict:
    if state is None:
        return {}
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"the state passed to dtlaunch must be JSON (numbers, strings, lists, dicts): {e}",
            fix="save tensors in the model or optimizer; keep positions (epoch, batch) as numbers",
        ) from None
    return dict(state)


def init(plan_path: str | None = None, run_dir: str | None = None) -> Job:
    """The job as the job scripts describe it (DTLAUNCH_PLAN, DTLAUNCH_RUN_DIR); collective."""
    from .. import planfile

    flag = PreemptionFlag().install()  # first: a signal during start-up must not be lost
    path = plan_path or os.environ.get(jobenv.PLAN)
    if not path:
        raise ConfigError(
            "no plan: DTLAUNCH_PLAN is not set",
            fix="start the script with `dtlaunch up` or a rendered job script, or pass init(plan_path=...)",
        )
    recipe, plan, _ = planfile.read(path)
    for k, v in recipe.env.items():
        os.environ.setdefault(k, v)
    rd = Path(run_dir or os.environ.get(jobenv.RUN_DIR) or Path(path).resolve().parent)
    if recipe.training.deterministic:
        from .dist import enable_determinism

        enable_determinism()
    world = init_distributed(recipe, plan)
    torch.manual_seed(recipe.training.seed)
    return Job(recipe, plan, rd, world, flag)


def _own_groups(world) -> frozenset[str]:
    """The process groups dtlaunch's own bookkeeping uses (checkpoints, the step agreement): not training's."""
    return frozenset(g.group_name for g in (world.checkpoint_group, world.control_group) if g is not None)
