"""Per-GPU memory of a layout: the largest moment of a training step, plus the device context and slack.

Sources, cited at each formula:
- [ZeRO] Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 3
  and 5 (model states: `states.model_states`).
- [ZeRO-Offload] Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", sec. 3 (with
  optimizer offload only the 16-bit parameters stay on the GPU: `states.model_states`), and DeepSpeed's own
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
3. On top: the device context (CUDA context and NCCL, which a tensor tracker cannot see; cuBLAS's workspaces,
   which the allocator holds, apart as `workspace`) and allocator fragmentation, FRAGMENTATION x the peak's
   tensors.

Choices where the sources disagree (`UNITS`, `NOT_MODELLED`; the plan states them in its output):
- GB means 1e9 bytes everywhere in the output, as accelerator vendors size device memory (an "80 GB" H100 has
  80e9 bytes usable by the catalog's figure). DeepSpeed's estimators divide by 2**30 and print "GB"; their GiB
  are 7.4% larger, which `plan --compare deepspeed` converts.
- Bytes per parameter of mixed-precision Adam: [ZeRO] counts 2 + 2 + 12 = 16 (16-bit weights and gradients,
  fp32 master weights and two moments); DeepSpeed's estimators count 18 besides the 16-bit weights, the extra
  4 being the fp32 copy of the gradient partition its optimizer step builds. The planner follows what each
  runtime keeps: 16 for DDP/FSDP2 (fp32 weights double as the master copy; torch keeps fp32 gradients, which
  is also where gradients accumulate across micro-batches), and for DeepSpeed 16 for the whole step plus that
  fp32 gradient partition in the optimizer-step moment only (`states.deepspeed_step_fp32_grads`).
- Not modelled (`NOT_MODELLED`): float8 linears, torch.compile and context parallelism; the recipe cannot ask
  for them, and a run that adds them in its own code is outside these figures.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from ..catalog import ModelShape
from ..jobenv import GB
from .activations import activation_bytes_per_layer
from .layout import Layout
from .moments import MOMENTS, TERMS, timeline
from .parts import pipeline_parts, rank_params
from .states import model_states, optimizer_state_bytes

# What the figures leave out, said in every plan (printed and `plan --json`'s "not_modelled"): none of them has a
# source this planner could cite for its memory, and the runtime does not use them.
NOT_MODELLED = (
    "float8 linears (torchao Float8Linear: fp8 weight/activation casts and scales)",
    "torch.compile (fused kernels change which activations are saved)",
    "context parallelism (sequence sharded across ranks in attention)",
)
# The output's units: GB = 1e9 bytes (DeepSpeed's estimators print GiB labelled GB).
UNITS = {"gb_bytes": int(GB), "bytes_per_param_mixed_adam": 16, "deepspeed_step_fp32_grads_bytes_per_param": 4}

# CUDA context, cuBLAS workspace and NCCL's own buffers on a GPU: ~1 GB measured on H100s with NCCL 2.2x.
GPU_CONTEXT_BYTES = 1.0 * GB
# Of that, what the caching allocator holds: cuBLAS's and cuBLASLt's workspaces, 32 MiB each on Hopper, taken at
# the first matmul (every run of the GPU suite's ledger on an H200 counted 64 MiB more than the plan's tensors).
# Kept as its own term so that a comparison with the allocator's figures leaves out only the rest.
GPU_WORKSPACE_BYTES = 64 * 2**20
CPU_CONTEXT_BYTES = 0.2 * GB
# The caching allocator rarely packs perfectly; keep this fraction of the peak's tensors as slack.
FRAGMENTATION = 0.05

__all__ = [
    "NOT_MODELLED",
    "UNITS",
    "Memory",
    "breakdown",
    "activations",
    "activation_bytes_per_layer",
    "model_states",
    "optimizer_state_bytes",
    "Layout",
    "MOMENTS",
    "TERMS",
]


class Memory(msgspec.Struct, frozen=True):
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
    terms: dict[str, float] = msgspec.field(default_factory=dict)
    moments: dict[str, float] = msgspec.field(default_factory=dict)
    # The model states the strategy keeps on this GPU for the whole step (`states.model_states`: params, grads,
    # optimizer, total), whatever the moment: the figure of [ZeRO] and DeepSpeed's estimators. The peak's
    # params/grads/optimizer above are what is alive at the peak (unsharded gradients kept between
    # micro-batches, say), which can differ.
    model_states: dict[str, float] = msgspec.field(default_factory=dict)

    @property
    def reserved(self) -> float:
        """What the caching allocator should reserve at the peak: everything but the CUDA context (and NCCL),
        which live outside it."""
        return self.total - self.terms.get("context", 0.0)

    @property
    def active(self) -> float:
        """What the caching allocator's tensors hold at the peak (its active bytes): `reserved` less fragmentation."""
        return self.reserved - self.terms.get("fragmentation", 0.0)

    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            k: int(round(getattr(self, k)))
            for k in ("params", "grads", "optimizer", "activations", "buffers", "total", "gpu")
        }
        d["fits"] = self.fits
        d["peak_at"] = self.peak_at
        d["terms"] = {k: int(round(v)) for k, v in self.terms.items()}
        d["moments"] = {k: int(round(v)) for k, v in self.moments.items()}
        d["model_states"] = {k: int(round(v)) for k, v in self.model_states.items()}
        return d


def activations(shape: ModelShape, arch: str, seq: int, lay: Layout) -> float:
    """The activations one pipeline stage keeps between forward and backward, per GPU (the layers' term)."""
    return timeline(shape, arch, 0.0, seq, lay)["loss backward"]["activations"]


@functools.lru_cache(maxsize=16384)
def breakdown(
    shape: ModelShape | None, arch: str, n_params: int, seq: int, lay: Layout, gpu_bytes: float, is_gpu: bool = True
) -> Memory:
    """The whole per-GPU picture for one layout: the largest moment of the step, with context and slack; under
    pipeline parallelism, of the rank (first or last stage) whose step peaks higher.

    Cached: a pure function of frozen values, and `auto`'s search and a sweep ask for the same layout of the
    same model again and again (bench/planner_scale.py's 792 plans make 9,970 calls, 2,184 of them distinct).
    The Memory returned is shared between callers, so nobody changes its dicts."""
    best = None
    for part in pipeline_parts(shape, lay):
        # TP splits the blocks, PP gives each rank its stages' blocks (`parts.rank_params`)
        n = rank_params(shape, arch, n_params, lay, part)
        moments = timeline(shape, arch, n, seq, lay, part, is_gpu)
        totals = {m: sum(t.values()) for m, t in moments.items()}
        at = max(totals, key=totals.__getitem__)
        if best is None or totals[at] > best[1][best[2]]:
            best = (moments, totals, at, part, n)
    assert best is not None  # pipeline_parts gives at least one part
    moments, totals, peak_at, part, n = best
    p, g, o = model_states(n, lay)  # of the rank the figure describes
    t = dict(moments[peak_at])
    t["workspace"] = GPU_WORKSPACE_BYTES if is_gpu else 0.0
    t["context"] = GPU_CONTEXT_BYTES - t["workspace"] if is_gpu else CPU_CONTEXT_BYTES
    t["fragmentation"] = FRAGMENTATION * totals[peak_at]
    total = sum(t.values())
    acts = t["activations"] + t["backward"] + t["loss"]
    bufs = t["buffers"] + t["workspace"] + t["context"] + t["fragmentation"]
    where = f"{peak_at} on pipeline rank {part.rank}" if lay.pp > 1 else peak_at
    return Memory(
        t["params"],
        t["grads"],
        t["optimizer"],
        acts,
        bufs,
        total,
        gpu_bytes,
        total <= gpu_bytes,
        where,
        t,
        totals,
        {"params": p, "grads": g, "optimizer": o, "total": p + g + o},
    )
