"""Rules about the layout, memory, batch and precision: what the plan itself says is wrong."""

from __future__ import annotations

from ..jobenv import gb as _gb
from ..plan import Plan
from ..plan.batch import batch_too_small, indivisible_batch
from ..plan.strategy import describe
from ..recipe import Recipe
from ..strategies import Family, names_in
from .core import rule

TORCH_FAMILY = names_in(Family.TORCH)
ZERO_FAMILY = names_in(Family.DEEPSPEED)


@rule("fp16-loss-scaling", "error", "parallelism.loss_scaling", "fp16 without loss scaling")
def _fp16(r: Recipe, p: Plan):
    if r.parallelism.precision == "fp16" and r.parallelism.loss_scaling == "none":
        return (
            "fp16 without loss scaling: small gradients underflow to zero and training silently stalls",
            "set parallelism.loss_scaling: dynamic, or use precision: bf16",
        )


@rule("bf16-unsupported", "error", "parallelism.precision", "bf16 on a GPU without bf16")
def _bf16(r: Recipe, p: Plan):
    dev = r.resources.device()
    if r.parallelism.precision == "bf16" and dev.is_gpu and not dev.bf16:
        return (f"{dev.name} has no bf16 tensor cores", "use precision: fp16 (with loss scaling) or a newer GPU")


@rule("deepspeed-fp16-cpu", "error", "parallelism.precision", "DeepSpeed fp16 on CPU")
def _ds_fp16_cpu(r: Recipe, p: Plan):
    if r.parallelism.precision == "fp16" and p.strategy in ZERO_FAMILY and not r.resources.device().is_gpu:
        return (
            "DeepSpeed's CPU accelerator has no fp16 support: the job would stop at start-up",
            "use precision: bf16 or fp32 on cpu, or a GPU accelerator",
        )


@rule("fp32-on-bf16-gpu", "warning", "parallelism.precision", "fp32 training on a bf16-capable GPU")
def _fp32(r: Recipe, p: Plan):
    dev = r.resources.device()
    if r.parallelism.precision == "fp32" and dev.is_gpu and dev.bf16:
        return (
            f"fp32 on {dev.name} runs at a fraction of the bf16 tensor-core peak and doubles activation memory",
            "use precision: bf16",
        )


@rule("fp32-gqa-gpu", "warning", "parallelism.precision", "fp32 attention with grouped-query heads on a GPU")
def _fp32_gqa(r: Recipe, p: Plan):
    s, dev = r.model.shape(), r.resources.device()
    if s is None or not dev.is_gpu or p.layout.precision != "fp32" or s.kv_heads >= s.heads:
        return None
    extra: float = 2 * 4 * p.seq_len * p.layout.micro_batch * (s.hidden - s.hidden * s.kv_heads // s.heads) * s.layers
    extra /= max(1, p.layout.tp * p.layout.pp)
    return (
        f"fp32 attention has no flash kernel, and the memory-efficient kernel has no grouped-query attention: "
        f"the runtime expands k and v from {s.kv_heads} to {s.heads} heads (about {extra / 1e9:.1f} GB more "
        "activations per GPU, counted in the plan) rather than fall back to the math kernel, which would keep "
        "every attention score",
        "use parallelism.precision: bf16 (flash attention, grouped heads kept)",
    )


@rule("offload-torch-optimizer", "warning", "training.optimizer", "ZeRO-Offload stepping SGD on the host")
def _offload_sgd(r: Recipe, p: Plan):
    lay = p.layout
    if (
        lay.spec.family.value == "deepspeed"
        and lay.offload != "none"
        and r.resources.device().is_gpu
        and r.training.optimizer != "adamw"
    ):
        return (
            f"with offload: {lay.offload}, DeepSpeed steps the optimizer on the host; its fast CPU optimizer is "
            f"Adam only, so {r.training.optimizer} runs as torch's, tensor by tensor on the CPU, every step",
            "use training.optimizer: adamw (DeepSpeed's CPU Adam), or parallelism.offload: none",
        )


@rule("does-not-fit", "error", "parallelism.strategy", "the chosen layout does not fit in GPU memory")
def _fit(r: Recipe, p: Plan):
    m, lay, par = p.memory, p.layout, r.parallelism
    if m.fits:
        return None
    # name what takes the most at the peak, not a guess from the strategy's name
    parts = {
        "the model states": m.params + m.grads + m.optimizer,
        "the activations": m.activations,
        "the buffers": m.buffers,
    }
    top = max(parts, key=parts.__getitem__)
    if top == "the model states":
        what = (
            "DDP keeps a full copy of the weights, gradients and optimizer state on every GPU"
            if not lay.spec.sharded
            else f"{lay.strategy} shards them over {lay.shard_group} GPUs"
        )
    elif top == "the activations":
        what = (
            f"micro_batch {lay.micro_batch} x seq_len {p.seq_len}, activation checkpointing "
            f"{lay.activation_checkpointing}"
        )
    else:
        what = "gathered weights and communication buffers" + (
            f", and the pipeline's buffers for the {lay.grad_accum} micro-batches of a step" if lay.pp > 1 else ""
        )
    msg = (
        f"{describe(lay)} needs {_gb(m.total)} per GPU but the {p.accelerator} has {_gb(m.gpu)}: at its peak, "
        f"the {m.peak_at}, {top} take the most ({what}); states {_gb(parts['the model states'])}, activations "
        f"{_gb(m.activations)}, buffers {_gb(m.buffers)}"
    )
    if par.strategy == "auto":  # the search has tried what it may: say what the recipe kept from it
        pinned = [
            f"{k}: auto (it is {v})"
            for k, v in (("activation_checkpointing", par.activation_checkpointing), ("offload", par.offload))
            if v != "auto"
        ]
        pinned += [f"{k}: auto (it is {getattr(par, k)})" for k in ("tensor", "pipeline") if getattr(par, k) != "auto"]
        if lay.tp > 1 and par.sequence_parallel is False:
            pinned.append("sequence_parallel: true")
        fix = (
            "no layout that strategy: auto may choose fits (`dtlaunch plan` lists what it tried): "
            + (f"let it choose more ({', '.join(pinned)}), or " if pinned else "")
            + "add GPUs or nodes, or lower micro_batch or seq_len"
        )
    else:
        fix = (
            "use strategy: auto (it searches sharding, checkpointing, offload and tensor/pipeline degrees), or "
            + {
                "the model states": "shard more (fsdp/zero3) or offload",
                "the activations": "enable activation_checkpointing (selective or full)",
                "the buffers": "shard less or use fewer micro-batches per step",
            }[top]
            + ", add GPUs, or lower micro_batch/seq_len"
        )
    return msg, fix


@rule("layout-world-size", "error", "parallelism", "tensor x pipeline x data must equal the GPU count")
def _world(r: Recipe, p: Plan):
    lay = p.layout
    if lay.tp * lay.pp * lay.dp != p.world_size:
        return (
            f"tensor {lay.tp} x pipeline {lay.pp} x data {lay.dp} = {lay.tp * lay.pp * lay.dp}, "
            f"but the job has {p.world_size} GPUs ({p.nodes} nodes x {p.gpus_per_node})",
            "make tensor*pipeline*data equal nodes*GPUs per node, or set data: auto",
        )


@rule("batch-divisible", "error", "training.global_batch", "global batch divisible by micro_batch x dp")
def _batch(r: Recipe, p: Plan):
    return indivisible_batch(r.training.global_batch, p.layout.micro_batch, p.layout.dp, r.parallelism.grad_accum)


@rule("batch-too-small", "error", "training.global_batch", "global batch smaller than one micro-batch per rank")
def _small(r: Recipe, p: Plan):
    return batch_too_small(r.training.global_batch, p.layout.micro_batch, p.layout.dp)


@rule("heads-tp", "error", "parallelism.tensor", "attention heads divisible by tensor parallel degree")
def _heads(r: Recipe, p: Plan):
    s = r.model.shape()
    t = p.layout.tp
    if s is not None and t > 1 and (s.heads % t or s.kv_heads % t):
        return (
            f"tensor {t} does not divide heads {s.heads} / kv_heads {s.kv_heads}",
            "use a tensor degree that divides both (often 8, 4 or 2)",
        )


@rule("tp-across-nodes", "warning", "parallelism.tensor", "tensor parallelism wider than a node")
def _tp_nodes(r: Recipe, p: Plan):
    if p.layout.tp > p.gpus_per_node:
        return (
            f"tensor {p.layout.tp} > {p.gpus_per_node} GPUs per node: every layer all-reduces over the network",
            "keep tensor <= GPUs per node; use pipeline across nodes",
        )


@rule("pipeline-layers", "error", "parallelism.pipeline", "more pipeline stages than layers")
def _pp(r: Recipe, p: Plan):
    s = r.model.shape()
    if s is not None and p.layout.pp > s.layers:
        return (f"pipeline {p.layout.pp} > {s.layers} layers", "lower pipeline")


@rule("offload-ddp", "error", "parallelism.offload", "offload with DDP")
def _offload_ddp(r: Recipe, p: Plan):
    if r.parallelism.strategy == "ddp" and r.parallelism.offload in ("optimizer", "params"):
        return (
            "DDP cannot offload: every rank holds the whole model and optimizer on its GPU",
            "use zero2/zero3 (offload: optimizer) or fsdp (offload: params)",
        )


@rule("offload-params-stage", "error", "parallelism.offload", "parameter offload needs full sharding")
def _offload_params(r: Recipe, p: Plan):
    if r.parallelism.offload == "params" and r.parallelism.strategy in ("zero1", "zero2", "fsdp_grad_op"):
        return (
            f"{r.parallelism.strategy} keeps whole parameters on every GPU, so they cannot be offloaded",
            "use zero3 or fsdp for offload: params, or offload: optimizer",
        )


@rule("fsdp-optimizer-offload", "warning", "parallelism.offload", "FSDP2 offloads params, grads and optimizer together")
def _fsdp_off(r: Recipe, p: Plan):
    if r.parallelism.offload == "optimizer" and r.parallelism.strategy in ("fsdp", "hybrid"):
        return (
            "FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer state together; dtlaunch uses it",
            "say offload: params to be explicit, or use zero2/zero3 for optimizer-only offload",
        )


@rule("grad-reduce-ignored", "warning", "parallelism.grad_reduce", "once_per_step where FSDP2 does not accumulate")
def _grad_reduce(r: Recipe, p: Plan):
    lay = p.layout
    if r.parallelism.grad_reduce != "once_per_step" or lay.reduces_once_per_step:
        return None
    if not lay.spec.sharded or lay.spec.family.value != "torch":
        why = (
            f"{lay.strategy} reduces gradients once per step already"
            if lay.strategy == "ddp"
            else f"DeepSpeed {lay.strategy} reduces gradients by its own schedule"
        )
    elif lay.grad_accum == 1:
        why = "there is one micro-batch per step, so nothing accumulates"
    elif lay.tp > 1 or lay.pp > 1:
        why = "with tensor or pipeline parallelism the runtime's FSDP2 follows the pipeline's own reduction"
    else:
        why = "with CPU offload the unsharded gradients would sit on the GPU the offload is meant to relieve"
    return (f"grad_reduce: once_per_step has no effect here: {why}", "remove parallelism.grad_reduce (or use auto)")


@rule(
    "long-seq-no-ac",
    "error",
    "parallelism.activation_checkpointing",
    "activation checkpointing off on a long sequence that does not fit",
)
def _ac(r: Recipe, p: Plan):
    if (
        r.parallelism.activation_checkpointing == "none"
        and p.seq_len >= 4096
        and not p.memory.fits
        and p.memory.activations > 0.3 * p.memory.gpu
    ):
        return (
            f"activations need {_gb(p.memory.activations)} at seq_len {p.seq_len} with checkpointing off",
            "set activation_checkpointing: selective or full (or auto)",
        )


@rule("tiny-batch-many-gpus", "warning", "training.micro_batch", "many GPUs with a tiny per-GPU batch")
def _tiny_batch(r: Recipe, p: Plan):
    tokens = p.layout.micro_batch * p.seq_len
    if p.world_size >= 64 and tokens < 4096:
        return (
            f"{tokens} tokens per GPU per micro-step on {p.world_size} GPUs: communication dominates, utilisation will be low",
            "raise micro_batch or seq_len, or use fewer GPUs",
        )


NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/scratch/local", "/local", "/mnt/local")


@rule(
    "checkpoint-dir-multinode",
    "error",
    "checkpoint.dir",
    "checkpoints on node-local storage in a multi-node job",
    ("local", "slurm"),
)
def _ckpt_dir(r: Recipe, p: Plan):
    # Unset, checkpoints go under the run directory in the submit directory, which every node already reads
    # the job's scripts from: as shared as the job itself.
    d = (r.checkpoint.dir or "").rstrip("/")
    if p.nodes > 1 and any(d == root or d.startswith(root + "/") for root in NODE_LOCAL):
        return (
            f"{d} is on each node's own disk: every node would write its part of each checkpoint to its own "
            "copy, and a requeued job on other nodes would find none of them",
            "put checkpoint.dir on a filesystem every node shares (or leave it unset: the submit directory's "
            "runs/<run id>/checkpoints)",
        )


@rule(
    "checkpoint-dir-relative",
    "warning",
    "checkpoint.dir",
    "relative checkpoint dir on a multi-node job",
    ("local", "slurm"),
)
def _ckpt_rel(r: Recipe, p: Plan):
    d = r.checkpoint.dir
    if p.nodes > 1 and d and not (d.startswith("/") or d.startswith("~") or "://" in d):
        return (
            f"{d!r} is relative: each node resolves it against its own working directory",
            "use an absolute path on a filesystem every node shares",
        )


@rule("async-keep", "error", "checkpoint.keep", "keep < 2 with async checkpointing")
def _async_keep(r: Recipe, p: Plan):
    if r.checkpoint.async_ and r.checkpoint.keep < 2:
        return (
            "with async checkpointing the newest checkpoint may still be in flight; keep: 1 would delete the only complete one",
            "set checkpoint.keep: 2 or more",
        )


@rule("no-checkpoint-before-end", "warning", "checkpoint.every", "no checkpoint before the run ends")
def _every(r: Recipe, p: Plan):
    if p.steps is not None and p.checkpoint_every > p.steps:
        return (
            f"checkpoint every {p.checkpoint_every} steps but the run has {p.steps}: a crash loses everything",
            f"set checkpoint.every below {p.steps}",
        )


@rule(
    "sequence-parallel-no-tp", "warning", "parallelism.sequence_parallel", "sequence parallel without tensor parallel"
)
def _sp(r: Recipe, p: Plan):
    if r.parallelism.sequence_parallel is True and p.layout.tp == 1:
        return (
            "sequence_parallel splits activations across the tensor-parallel group, which has size 1 here",
            "set tensor > 1 or sequence_parallel: false",
        )


@rule("hybrid-single-node", "warning", "parallelism.strategy", "hybrid sharding on one node")
def _hybrid(r: Recipe, p: Plan):
    if r.parallelism.strategy == "hybrid" and p.nodes == 1:
        return (
            "hybrid shards within a node and replicates across nodes; on one node it is plain fsdp",
            "use strategy: fsdp",
        )


@rule("deepspeed-launcher-strategy", "error", "parallelism.launcher", "the deepspeed launcher needs a ZeRO strategy")
def _ds_launcher(r: Recipe, p: Plan):
    if r.parallelism.launcher == "deepspeed" and p.strategy not in ZERO_FAMILY:
        return (
            f"launcher: deepspeed runs DeepSpeed engines, but the strategy is {p.strategy}",
            "use strategy zero1/zero2/zero3, or launcher: torchrun",
        )


@rule("backend-strategy", "warning", "parallelism.backend", "strategy outside the chosen backend family")
def _backend(r: Recipe, p: Plan):
    s = r.parallelism.strategy
    if s != "auto" and (
        (r.parallelism.backend == "deepspeed" and s in TORCH_FAMILY)
        or (r.parallelism.backend == "torch" and s in ZERO_FAMILY)
    ):
        return (
            f"strategy {s} with backend {r.parallelism.backend}: the strategy wins",
            f"set backend: {'deepspeed' if s in ZERO_FAMILY else 'torch'} to say what you mean",
        )


@rule("secret-in-env", "error", "env", "a secret name also given a value in env")
def _secret_env(r: Recipe, p: Plan):
    both = sorted(set(r.secrets) & set(r.env))
    if both:
        return (
            f"{', '.join(both)} listed in secrets and given a value in env: the value would be written into job files",
            "remove it from env; export it in the submitting shell instead",
        )


@rule("secret-looking-env", "warning", "env", "an env value that looks like a secret")
def _secretish(r: Recipe, p: Plan):
    words = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "CREDENTIALS"}
    sus = [k for k in r.env if words & set(k.upper().split("_")) or k.upper().endswith(("API_KEY", "ACCESS_KEY"))]
    if sus:
        return (
            f"{', '.join(sus)} look like credentials; env values are written into rendered files",
            "move them to `secrets:` (names only) and export them when you submit",
        )


@rule("mfu-optimistic", "warning", "resources.mfu", "an optimistic MFU assumption")
def _mfu(r: Recipe, p: Plan):
    if r.resources.mfu > 0.65:
        return (
            f"mfu {r.resources.mfu} is above what large runs report (0.35-0.55); time and cost will be underestimated",
            "use 0.4 unless you have measured more",
        )
