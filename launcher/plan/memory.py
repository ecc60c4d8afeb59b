"""Per-GPU memory of a layout: the largest moment of a training step, plus the device context and slack.

Sources, cited at each formula:
- [ZeRO] Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 3
  and 5 (model states: `moments.model_states`).
- [ZeRO-Offload] Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", sec. 3 (with
  optimizer offload only the 16-bit parameters stay on the GPU: `moments.model_states`), and DeepSpeed's own
  estimators, `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs`
  (`dtlaunch plan --compare deepspeed` prints them beside these figures).
- [MLM3] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4,
  Table 2 (GPT layers, pipeline in-flight micro-batches: `activations`, `moments`).
- the runtime itself for the Llama activations, the loss and FSDP2's buffers (`activations`, `moments`): each
  term is derived from what `launcher.runtime` keeps alive, and `dtlaunch plan --trace` checks it against
  PyTorch's memory tracker run on that same code.

How the per-GPU figure is built (`breakdown`):
1. `moments.timeline` lists, for each moment of a step (end of forward, loss backward, the first layer's
   backward, end of backward, optimizer step, ...), the bytes alive per term: params, grads, optimizer state,
   the layers' activations, what the layer in backward adds, the loss, the strategy's buffers.
2. The peak is the moment with the largest sum: terms are added only where they coincide.
3. On top: the device context (CUDA context, cuBLAS workspace, NCCL; a tensor tracker cannot see it) and
   allocator fragmentation, FRAGMENTATION x the peak's tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..catalog import ModelShape
from ..jobenv import GB
from .activations import activation_bytes_per_layer
from .layout import Layout
from .moments import MOMENTS, TERMS, model_states, optimizer_state_bytes, pipeline_parts, rank_params, timeline

# CUDA context, cuBLAS workspace and NCCL's own buffers on a GPU: ~1 GB measured on H100s with NCCL 2.2x.
GPU_CONTEXT_BYTES = 1.0 * GB
CPU_CONTEXT_BYTES = 0.2 * GB
# The caching allocator rarely packs perfectly; keep this fraction of the peak's tensors as slack.
FRAGMENTATION = 0.05

__all__ = ["Memory", "breakdown", "activations", "activation_bytes_per_layer", "model_states",
           "optimizer_state_bytes", "Layout", "MOMENTS", "TERMS"]


@dataclass(frozen=True)
class Memory:
    """The peak moment's memory. `activations` = layers + layer in backward + loss; `buffers` = the strategy's
    buffers + context + fragmentation; `terms` has them apart, `moments` the tensor total of every moment."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    total: float
    gpu: float
    fits: bool
    peak_at: str = ""
    terms: dict[str, float] = field(default_factory=dict)
    moments: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {k: int(round(getattr(self, k))) for k in ("params", "grads", "optimizer", "activations", "buffers",
                                                        "total", "gpu")}
        d["fits"] = self.fits
        d["peak_at"] = self.peak_at
        d["terms"] = {k: int(round(v)) for k, v in self.terms.items()}
        d["moments"] = {k: int(round(v)) for k, v in self.moments.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Memory:
        return cls(*(float(d[k]) for k in ("params", "grads", "optimizer", "activations", "buffers", "total", "gpu")),
                   bool(d["fits"]), d.get("peak_at", ""), {k: float(v) for k, v in d.get("terms", {}).items()},
                   {k: float(v) for k, v in d.get("moments", {}).items()})


def activations(shape: ModelShape, arch: str, seq: int, lay: Layout) -> float:
    """The activations one pipeline stage keeps between forward and backward, per GPU (the layers' term)."""
    return timeline(shape, arch, 0.0, seq, lay)["loss backward"]["activations"]


def breakdown(shape: ModelShape | None, arch: str, n_params: int, seq: int, lay: Layout, gpu_bytes: float,
              is_gpu: bool = True) -> Memory:
    """The whole per-GPU picture for one layout: the largest moment of the step, with context and slack; under
    pipeline parallelism, of the rank (first or last stage) whose step peaks higher."""
    best = None
    for part in pipeline_parts(shape, lay):
        # TP splits the blocks, PP gives each rank its stages' blocks (`moments.rank_params`)
        n = rank_params(shape, arch, n_params, lay, part)
        moments = timeline(shape, arch, n, seq, lay, part)
        totals = {m: sum(t.values()) for m, t in moments.items()}
        at = max(totals, key=totals.__getitem__)
        if best is None or totals[at] > best[1][best[2]]:
            best = (moments, totals, at, part)
    moments, totals, peak_at, part = best
    t = dict(moments[peak_at])
    t["context"] = GPU_CONTEXT_BYTES if is_gpu else CPU_CONTEXT_BYTES
    t["fragmentation"] = FRAGMENTATION * totals[peak_at]
    total = sum(t.values())
    acts = t["activations"] + t["backward"] + t["loss"]
    bufs = t["buffers"] + t["context"] + t["fragmentation"]
    where = f"{peak_at} on pipeline rank {part.rank}" if lay.pp > 1 else peak_at
    return Memory(t["params"], t["grads"], t["optimizer"], acts, bufs, total, gpu_bytes, total <= gpu_bytes,
                  where, t, totals)
