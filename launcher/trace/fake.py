"""One traced training step of the runtime's own code, on fake tensors and a fake process group.

What runs is what `launcher.runtime.train` runs: `Layout.for_world` -> `build_model(shape, ac, "meta")` -> `build_engine`
(FSDP2 units, MixedPrecisionPolicy, AdamW, LambdaLR) -> `engine.micro_step` x grad_accum -> `engine.step`,
under `FakeTensorMode` (no memory is allocated, shapes and dtypes are exact) with PyTorch's memory tracker
counting every live tensor by category. Four deliberate differences from a GPU job, each because fake tensors
or a CPU-only torch cannot do otherwise, none of which moves a byte the planner counts:

- the DeviceMesh is built outside fake mode (it holds real rank tensors);
- gradient clipping (the runtime's own `clip_grad_norm`) runs here, before `engine.step()` with the engine's
  clipping off: the engine turns the norm into a Python float, which a fake tensor cannot give;
- fp16's loss scaler is told that no gradient overflowed (`_steady_loss_scale`): it would read that off a
  tensor's value;
- the device is `cpu` (FSDP2 creates CUDA streams on a cuda device), so AdamW is set to `foreach`, as it
  defaults on CUDA (it falls back to a per-tensor loop on CPU), and SDPA runs the CPU flash kernel, which
  saves what the CUDA one saves (q, k, v, the output and an fp32 log-sum-exp).

Two iterations run; the second is reported: the first also counts DTensor's one-off sharding propagation and
creates the optimizer state. `StepTracker` files each tensor by what it is (an unsharded gradient, a collective's
buffer) from the moment it exists, and records each moment's own peak besides the step's. Uses private torch APIs (`torch.distributed._tools`, `torch.testing._internal`),
checked against the supported torch range by `launcher.trace.check_torch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.utils.weak import WeakIdKeyDictionary


@dataclass
class Snapshot:
    """The peak of one traced step: bytes per tracker category, and where in the step it happened."""

    layers: int
    world_size: int
    categories: dict[str, int]
    total: int
    at: str  # the planner's name of the moment: see launcher.plan.moments.MOMENTS
    where: str  # the tracker's finer position, e.g. "backward of layers.31"
    seconds: float
    moments: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # moment -> its own peak
    # "phase|op|ranks" -> calls in the second step: a micro-step before the last (when there are several), the
    # last micro-step, the optimizer step (with clipping)
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake process group of `world_size` ranks (this process is rank 0), torn down afterwards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; trace in a fresh one")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _mesh_outside_fake_mode():
    """DeviceMesh keeps real tensors of rank ids, and computes from them whenever a mesh is built (FSDP2 builds
    one of the data-parallel and tensor dimensions together), read, or asked where a shard starts (the
    vocabulary-parallel loss): all of that runs with fake mode suspended."""
    import torch.distributed.device_mesh as dm
    import torch.distributed.tensor._utils as dt_utils
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def real(f):
        def call(*args, **kwargs):
            with unset_fake_temporarily():
                return f(*args, **kwargs)

        return call

    mesh_prop = vars(dm.DeviceMesh)["mesh"]
    patches = [
        (dm, "init_device_mesh", real(dm.init_device_mesh)),
        (dm.DeviceMesh, "__init__", real(dm.DeviceMesh.__init__)),
        (dm.DeviceMesh, "mesh", property(real(mesh_prop.fget))),
        (dt_utils, "compute_local_shape_and_global_offset", real(dt_utils.compute_local_shape_and_global_offset)),
    ]
    saved = [(obj, name, vars(obj)[name]) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


def _moment(
    stage: str, unit: str | None, is_bw: bool, in_opt: bool, units: list[str], last_micro: bool = True
) -> tuple[str, str]:
    """(planner moment, finer position) of the tracker's state; `units` are the FSDP units in forward order,
    the root last; `last_micro`: in the step's last micro-step."""
    if in_opt:
        return "optimizer step", "optimizer step"
    if not is_bw:
        if stage == "forward":
            return "forward", f"forward of {unit}"
        if stage == "after forward":
            return "loss forward", "loss forward (after the model's forward)"
        if not last_micro:
            return "between micro-steps", "after a micro-step's backward, before the next one's forward"
        return "step", "between backward and the optimizer step (clipping, zero_grad)"
    if stage == "after forward":
        return "loss backward", "loss backward (before any unit's backward)"
    root = units[-1]
    if unit == root:
        return (
            ("head backward", "backward of the head")
            if stage == "backward"
            else ("end of backward", "end of backward (the root's reduce-scatter)")
        )
    if unit == "output":  # the head as a unit of its own
        return "head backward", f"backward of {unit}"
    if unit == "tok_embeddings":
        return "end of backward", f"backward of {unit}"
    if unit == units[0] and stage == "after backward":  # the first block done: the root's embedding's backward
        return "end of backward", "backward of the embedding (in the root)"
    return "layer backward", f"backward of {unit}"


MICRO, LAST_MICRO, OPTIMIZER = "micro-step", "last micro-step", "optimizer step"
# The dispatcher's namespaces of collectives: c10d's (what FSDP2 and the pipeline's sends call) and the
# functional ones (what DTensor's redistributions call); waits are not collectives of their own.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
NOT_SENT = ("wait_tensor", "wait", "barrier", "monitored_barrier")


KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "broadcast", "send", "recv")


def _kind(opname: str) -> str:
    """One name for a collective whichever API issued it (c10d's `_allgather_base_`, the functional
    `all_gather_into_tensor`, ...)."""
    bare = opname.replace("_", "")
    return next((k for k in KINDS if bare.startswith(k.replace("-", ""))), opname)


def _group_size(args) -> int:
    """The ranks of the collective's process group: a ProcessGroup argument, or a functional op's group name."""
    from torch.distributed.distributed_c10d import ProcessGroup, _resolve_process_group

    for a in args:
        if isinstance(a, str):
            try:
                return _resolve_process_group(a).size()  # type: ignore[arg-type]
            except (ValueError, RuntimeError, KeyError):
                continue
        if isinstance(a, torch.ScriptObject):  # c10d's ops take the group boxed
            return ProcessGroup.unbox(a).size()
    return 0


class StepTracker(FSDPMemTracker):
    """FSDPMemTracker that also records where in the step the peak is reached, and each moment's own peak.

    `units` are the FSDP units' names in forward order, the root last (`runtime.engines.mesh.fsdp_units`).
    """

    def __init__(self, model, optimizer, units: list[str]):
        super().__init__(model, optimizer)
        self.model, self.units = model, units
        self.stage, self.peak_at = "start", ("start", "start")
        self.unit: str | None = None
        self.moments: dict = {}  # moment -> (snapshot at its own peak, op index)
        self._born = WeakIdKeyDictionary()  # storage -> the op that made it
        self._ops, self._peak_op = 0, 0
        self._undo: list = []
        self.last_micro = True  # set by the caller: is this the step's last micro-step
        self.phase: str | None = None  # set by the caller: the collectives are counted under this name
        self.collectives: dict[tuple[str, str, int], int] = {}  # (phase, op, group size) -> calls

    def _mark(self, fsdp_mod, inner, stage):
        def wrapped(*args, **kwargs):
            fqn = self._mod_tracker.get_known_fqn(fsdp_mod) or "?"
            fqn = "root" if fsdp_mod is self.model else fqn.removeprefix(type(self.model).__name__ + ".")
            recompute = stage == "forward" and self._mod_tracker.is_bw  # activation checkpointing
            if not recompute and stage != "forward-done":
                self.stage, self.unit = stage, fqn
            out = inner(*args, **kwargs)
            if stage == "forward-done" and fsdp_mod is self.model and not self._mod_tracker.is_bw:
                self.stage, self.unit = "after forward", fqn
            elif stage == "backward-done":
                self.stage, self.unit = "after backward", fqn
            return out

        return wrapped

    def _fsdp_state_pre_forward(self, fsdp_mod, orig):
        return self._mark(fsdp_mod, super()._fsdp_state_pre_forward(fsdp_mod, orig), "forward")

    def _fsdp_state_post_forward(self, fsdp_mod, orig):
        return self._mark(fsdp_mod, super()._fsdp_state_post_forward(fsdp_mod, orig), "forward-done")

    def _fsdp_param_group_pre_backward(self, fsdp_mod, orig):
        return self._mark(fsdp_mod, super()._fsdp_param_group_pre_backward(fsdp_mod, orig), "backward")

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
        inner = self._mark(fsdp_mod, super()._fsdp_param_group_post_backward(fsdp_mod, orig), "backward-done")

        def wrapped(*args, **kwargs):
            out = inner(*args, **kwargs)
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            if group is not None and not group.reduce_grads:  # reducing once per step: kept for the next one
                for fp in group.fsdp_params:
                    kept = self._kept_grad(fp)
                    if kept is not None:
                        self._relabel(kept, _FSDPRefType.SHARDED_GRAD)
            return out

        return wrapped

    @staticmethod
    def _kept_grad(fp):
        """A parameter's unsharded gradient kept across micro-steps: `unsharded_accumulated_grad` in the reduce
        dtype, or the unsharded parameter's own `.grad` when that is the reduce dtype already."""
        if fp.unsharded_accumulated_grad is not None:
            return fp.unsharded_accumulated_grad
        return fp._unsharded_param.grad if hasattr(fp, "_unsharded_param") else None

    # Op counter and each storage's birth op: a gradient is known as one only when it is accumulated into
    # `.grad`, an op or two after the matmul that made it; `_relabel` also moves its bytes in the peaks
    # recorded in between, during which it was alive.
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._ops += 1
        if self.phase is not None and func.namespace in COLLECTIVE_NAMESPACES and func._opname not in NOT_SENT:
            key = (self.phase, _kind(func._opname), _group_size(args))
            self.collectives[key] = self.collectives.get(key, 0) + 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track(self, reftype, t):
        super()._track(reftype, t)
        for st in get_untyped_storages(t):
            if st not in self._born:
                self._born[st] = self._ops

    def _relabel(self, t, reftype):
        for st in get_untyped_storages(t):
            winfo, _ = self._WINFO.get(st, (None, None))
            born = self._born.get(st)
            if winfo is None or born is None or winfo.reftype == reftype:
                continue
            recorded = [(self._peak_mem_snap.get(winfo.device), self._peak_op)]
            recorded += [(snap, op) for snap, op in self.moments.values()]
            for snap, op in recorded:
                if snap is not None and born <= op:
                    snap[winfo.reftype] -= winfo.mem_consumed
                    snap[reftype] = snap.get(reftype, 0) + winfo.mem_consumed
        self._update_and_maybe_create_winfos(t, reftype)

    def _update_peak_stats(self, peak_state):
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        moment = _moment(self.stage, self.unit, self._mod_tracker.is_bw, self._in_opt, self.units, self.last_micro)
        if self._peak_mem != before:
            self.peak_at, self._peak_op = moment, self._ops
        cur = next(iter(self._curr_mem_snap.values()), None)
        if cur is not None and cur["Total"] > self.moments.get(moment[0], ({"Total": -1}, 0))[0]["Total"]:
            self.moments[moment[0]] = (dict(cur), self._ops)

    # The tracker files a buffer by the op that first touches it; these make the filing exact for the two
    # kinds it would otherwise see as Temp for a while: an unsharded gradient (until its unit's
    # post-backward) and a collective's buffer (between its allocation and the collective).
    def _instrument_fsdp_module(self):
        super()._instrument_fsdp_module()
        for group in self._param_groups():
            for comm, ref in (
                (group._all_gather_comm, _FSDPRefType.ALL_GATHER),
                (group._reduce_scatter_comm, _FSDPRefType.REDUCE_SCATTER),
            ):
                if "allocate" in vars(comm):
                    continue  # one comm object may serve several groups
                comm.allocate = self._labelled(comm.allocate, ref)
                self._undo.append(lambda c=comm: c.__dict__.pop("allocate", None))

    def _labelled(self, allocate, ref):
        def wrapped(*args, **kwargs):
            t = allocate(*args, **kwargs)
            self._relabel(t, ref)
            return t

        return wrapped

    def _param_groups(self):
        for m in self._root_mod.modules():
            state = getattr(m, "_get_fsdp_state", None)  # an FSDP2 module's
            if state is not None and state()._fsdp_param_group is not None:
                yield state()._fsdp_param_group

    def _label_unsharded_grads(self):
        def hook(p):
            if self._kept(p.grad):
                return  # an unsharded gradient kept from an earlier micro-step, added to in place
            self._relabel(p.grad, _FSDPRefType.UNSHARDED_GRAD)

        for group in self._param_groups():
            for fp in group.fsdp_params:
                if hasattr(fp, "_unsharded_param"):
                    h = fp._unsharded_param.register_post_accumulate_grad_hook(hook)
                    self._undo.append(h.remove)

    def _kept(self, t) -> bool:
        return t is not None and any(
            self._WINFO.get(st, (None,))[0] is not None and self._WINFO[st][0].reftype == _FSDPRefType.SHARDED_GRAD
            for st in get_untyped_storages(t)
        )

    def label_partial_grads(self):
        """HSDP between micro-steps keeps reduce-scattered, not yet all-reduced, gradients per unit
        (`_partial_reduce_output`): accumulated gradients, whatever buffer they were born in. (Reducing once
        per step, the kept unsharded ones are labelled at each unit's post-backward.)"""
        for group in self._param_groups():
            if getattr(group, "_partial_reduce_output", None) is not None:
                self._update_and_maybe_create_winfos(group._partial_reduce_output, _FSDPRefType.SHARDED_GRAD)

    def _deregister_module_and_optimizer_hooks(self):
        for undo in getattr(self, "_undo", []):
            undo()
        self._undo = []
        super()._deregister_module_and_optimizer_hooks()

    def reset_peak(self):
        """Start counting the peak afresh (the second iteration); the unsharded parameters exist by now."""
        self._label_unsharded_grads()
        self.reset_mod_stats()
        self._peak_mem_snap = self.get_tracker_snapshot("current")
        self._peak_mem = {d: s["Total"] for d, s in self._peak_mem_snap.items()}
        self.peak_at = ("start", "start")
        self.moments = {}


def _steady_loss_scale(scaler) -> None:
    """fp16's dynamic loss scaling decides from tensor values (did a gradient overflow? has the scale gone long
    enough without one to grow?), which fake tensors do not have. Under the trace no gradient overflows and the
    scale stays at its initial value, as in a healthy run's steady state: the optimizer steps every time. The
    scaling, the unscaling and the optimizer step still run on the fake tensors; only the two decisions are
    given their answer (GradScaler's private `_maybe_opt_step` and `_init_scale`: torch range in `check_torch`)."""
    update = scaler.update

    def step_anyway(optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)

    scaler._maybe_opt_step = step_anyway
    # a given scale is filled in without reading found_inf; update also readies the scaler for the next step
    scaler.update = lambda new_scale=None: update(float(scaler._init_scale))


def trace_step(recipe, plan, layers: int | None = None) -> Snapshot:
    """The peak of the second training step of `recipe`/`plan` with the preset cut to `layers` layers.

    Must run inside `fake_world(plan.world_size)`.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..runtime.engines import build_engine, fsdp_units
    from ..runtime.gradclip import clip_grad_norm
    from ..runtime.models import build_model

    t0 = time.monotonic()
    shape = recipe.model.shape()
    if layers is not None:
        shape = msgspec.structs.replace(shape, layers=layers)
    layout, _ = plan.layout.for_world(plan.world_size)
    no_clip = recipe.replace(training=recipe.training.replace(grad_clip=0.0))
    n_micro = min(layout.grad_accum, 2)  # from the second micro-step on, every micro-step looks alike
    with _mesh_outside_fake_mode(), FakeTensorMode():
        module = build_model(shape, layout.activation_checkpointing, device="meta")
        engine = build_engine(module, layout, no_clip, plan, plan.steps or 1000, torch.device("cpu"), is_gpu=False)
        scaler = getattr(engine, "scaler", None)
        if scaler is not None:
            _steady_loss_scale(scaler)
        for group in engine.optimizer.param_groups:
            group["foreach"] = True  # what AdamW picks on CUDA
        names = {m: n for n, m in module.named_modules()}
        units = [names[u] or "root" for u in fsdp_units(module, model_parallel=layout.model_parallel)]
        # As `runtime.data.Batches`: the step's grad_accum micro-batches of s+1 tokens, loaded up front.
        batches = [
            torch.randint(0, shape.vocab, (layout.micro_batch, plan.seq_len + 1)) for _ in range(layout.grad_accum)
        ]
        x, y = batches[0][:, :-1], batches[0][:, 1:]
        tracker = StepTracker(engine.model, engine.optimizer, units)
        tracker.track_inputs(tuple(batches))
        with tracker:
            for it in range(2):
                if it == 1:
                    gc.collect()
                    tracker.reset_peak()
                for i in range(n_micro):
                    if i:
                        tracker.reset_mod_stats()
                        tracker.label_partial_grads()
                    tracker.last_micro = i == n_micro - 1
                    if it == 1:
                        tracker.phase = LAST_MICRO if tracker.last_micro else MICRO
                    engine.micro_step(x, y, last=tracker.last_micro)
                if it == 1:
                    tracker.phase = OPTIMIZER
                if recipe.training.grad_clip > 0:
                    clip_grad_norm(module.parameters(), recipe.training.grad_clip)
                engine.step()
                tracker.phase = None
        peak = tracker.get_tracker_snapshot("peak")
    dev = next(iter(peak.values()), {"Total": 0})
    cats = {str(getattr(k, "value", k)): int(v) for k, v in dev.items() if k != "Total" and v}
    at, where = tracker.peak_at
    moments = {
        m: {str(getattr(k, "value", k)): int(v) for k, v in snap.items() if v and k != "Total"}
        for m, (snap, _) in tracker.moments.items()
    }
    collectives = {"|".join(map(str, k)): n for k, n in sorted(tracker.collectives.items())}
    return Snapshot(
        shape.layers, plan.world_size, cats, int(dev["Total"]), at, where, time.monotonic() - t0, moments, collectives
    )
