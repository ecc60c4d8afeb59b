"""dtlaunch's runtime for the user's own training loop: what `python -m launcher.train` does for its own
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
twice. A collective that times out raises, and launcher.entry turns it into exit 43 (restart).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import jobenv
from ..jobenv import ExitCode
from ..plan.cost import flops_per_token
from .agreement import NonFiniteWatch, Reporter, StepSync
from .checkpoint import Checkpointer
from .checkpoint.compat import identity
from .ckptdir import expand_dir
from .dist import World, init_distributed, set_collective_timeout, shutdown
from .failures import ConfigError, Preempted
from .layout import RuntimeLayout, resolve_layout
from .metrics import Metrics
from .optim import apply_schedule
from .parallel import Engine, wrap_model
from .signals import PreemptionFlag
from .status import record_progress

FALLBACK_STEPS = 10**9  # schedules need a length; a plan without one trains until the user's loop stops


class Job:
    """One rank's view of the job. Collective methods (wrap, resume, step_done, finish) run on every rank."""

    def __init__(self, recipe, plan, run_dir: Path, world: World, flag: PreemptionFlag):
        self.recipe, self.plan, self.run_dir, self.world, self.flag = recipe, plan, run_dir, world, flag
        self.layout: RuntimeLayout
        self.layout, notes = resolve_layout(plan, world.world_size)
        self.total_steps: int | None = plan.steps
        self.every: int = plan.checkpoint_every
        self.step = 0  # the last completed (or resumed) optimizer step
        self.start_step = 0
        self.engine: Engine | None = None
        self.checkpointer: Checkpointer | None = None
        self._last_saved: int | None = None
        self._position: dict = {}  # the caller's state at the last step, for finish()
        self.metrics = Metrics(run_dir, enabled=world.is_main, total_steps=plan.steps or 0, is_gpu=world.is_gpu)
        self.nonfinite = NonFiniteWatch(recipe.training.max_nonfinite_steps, world.device, self.metrics.log)
        self._sync = StepSync(world)
        self._reporter = Reporter(
            self._sync,
            self.nonfinite,
            self.metrics,
            is_gpu=world.is_gpu,
            tokens_per_step=self.layout.global_batch * plan.seq_len,
            flops_per_token=flops_per_token(plan.params, recipe.model.shape(), plan.seq_len),
            world_size=world.world_size,
        )
        for n in notes:
            self.metrics.log(n)
        self.checkpoint_dir = Path(
            os.path.expanduser(
                os.environ.get(jobenv.CHECKPOINT_DIR)
                or str(expand_dir(recipe.checkpoint.dir, run_dir, os.environ.get(jobenv.RUN_ID)))
            )
        )

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
                "Face model (model.hf) without an entrypoint: python -m launcher.train splits them",
            )
        steps = self.total_steps or FALLBACK_STEPS
        self.engine = wrap_model(
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
        self.checkpointer = Checkpointer(
            self.checkpoint_dir,
            self.engine,
            rank=self.rank,
            world_size=self.world_size,
            keep=rec.checkpoint.keep,
            async_save=rec.checkpoint.async_,
            meta=meta,
            group=self.world.checkpoint_group,
            log=self.metrics.log,
            event=self.metrics.event,
            allow_changed_recipe=rec.checkpoint.resume_changed_recipe,
            run_id=os.environ.get(jobenv.RUN_ID),
        )
        return self.engine

    def resume(self) -> dict:
        """Load the newest checkpoint that verifies (falling back past corrupt ones); return the `state`
        saved with it ({} on a fresh start). Sets `job.step`."""
        cp = self._need_checkpointer("resume")
        cp.prepare()
        saved = cp.restore_latest()
        if saved is None:
            self.metrics.log(f"no checkpoint in {self.checkpoint_dir}: starting from step 0")
            record_progress(start=0, step=0)
            return {}
        if self.layout.family != "deepspeed":
            apply_schedule(self.engine.optimizer, self.engine.scheduler)
        self.step = self.start_step = self._last_saved = int(saved["step"])
        record_progress(start=self.step, step=self.step)
        notes = "; ".join(saved.get("warnings") or [])
        self.metrics.log(f"resumed from step {self.step} ({saved['path']})" + (f"; {notes}" if notes else ""))
        self.metrics.event("resume", step=self.step, path=saved["path"], warnings=saved.get("warnings") or [])
        return dict(saved.get("data") or {})

    def _need_checkpointer(self, what: str) -> Checkpointer:
        if self.checkpointer is None:
            raise ConfigError(f"job.{what} needs the wrapped model", fix="call job.wrap(model) first")
        return self.checkpointer

    # ------------------------------------------------------------------ the step

    def step_done(self, step: int, *, loss: Any = None, state: dict | None = None, **metrics: Any) -> None:
        """After each optimizer step: agree on stopping, log, and checkpoint when due (async) or when
        preempted (then raise Preempted: exit 42 after the checkpoint is committed). The loss (a tensor, kept
        on the device) is read only on log and checkpoint steps."""
        cp = self._need_checkpointer("step_done")
        if step != self.step + 1:
            raise ConfigError(
                f"job.step_done({step}) after step {self.step}: steps must follow one another",
                fix="loop from job.step + 1 (after job.resume())",
            )
        value = loss.detach().float().mean() if isinstance(loss, torch.Tensor) else float(loss or 0.0)
        self.nonfinite.update(value, step)
        agreed = self._sync.agree(step, self.stopping)
        self.step = step
        record_progress(step=step)
        self._reporter.tick({})
        if step == self.start_step + 1:  # the first step of this attempt is done: the short timeouts from now on
            set_collective_timeout(self.world, self.recipe.training.timeout_seconds)
        last = step == self.total_steps
        log = step % self.recipe.training.log_every == 0 or agreed.stop or last
        due = step % self.every == 0 and not last
        finite = True
        if log or due:
            mean_loss, finite, memory = self._reporter.check(step, value, log=log)
            if log:
                self._reporter.log(
                    step, mean_loss, self.engine.step_lr or self.engine.lr, memory, extra=metrics or None
                )
        position = _json_state(state)
        cp.poll()
        if agreed.stop:
            if finite:
                self.metrics.log(
                    f"preemption signal ({self.flag.received or 'on another rank'}) at step {step}: "
                    f"saving a checkpoint, then exiting with {ExitCode.PREEMPTED}"
                )
                self._save(position, blocking=True, reason="preempt")
            raise Preempted(f"preempted at step {step}; checkpoint written, resubmit to resume", step=step)
        if finite and due:
            self._save(position, blocking=False, reason="interval")
        self._position = position

    def _save(self, position: dict, *, blocking: bool, reason: str) -> None:
        self.checkpointer.save(self.step, position, blocking=blocking, reason=reason)
        if blocking:
            self.checkpointer.wait()
        self._last_saved = self.step

    def save(self, state: dict | None = None) -> None:
        """Checkpoint the current step now (blocking), e.g. at the end of an epoch."""
        self._need_checkpointer("save")
        self._save(_json_state(state), blocking=True, reason="user")

    def finish(self, state: dict | None = None) -> None:
        """The final checkpoint (unless the last step is already saved), then a clean exit of the world."""
        cp = self._need_checkpointer("finish")
        try:
            if self._last_saved != self.step and self.nonfinite.count == 0:
                self._save(_json_state(state) if state is not None else self._position, blocking=True, reason="final")
            cp.close()
            self.metrics.event("end", step=self.step)
            self.metrics.log(f"done: {self.step} steps")
        finally:
            self.flag.uninstall()
            self.metrics.close()
        shutdown(self.world)


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
        from .loop import enable_determinism

        enable_determinism()
    world = init_distributed(recipe, plan)
    torch.manual_seed(recipe.training.seed)
    return Job(recipe, plan, rd, world, flag)
