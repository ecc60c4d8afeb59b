"""The DeepSpeed JSON config for a ZeRO plan: the same dict `render` writes and the runtime passes to
`deepspeed.initialize`, so what a user reviews is what runs. Pure: no torch, no deepspeed import; shared
by the renderer, the runtime and the planner (which sizes DeepSpeed's buffers from the same constants).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..strategies import spec
from .buckets import (
    DS_ALLGATHER_BUCKET,
    DS_REDUCE_BUCKET,
    STAGE3_MAX_LIVE_PARAMETERS,
    STAGE3_MAX_REUSE_DISTANCE,
    STAGE3_PARAM_PERSISTENCE_THRESHOLD,
    STAGE3_PREFETCH_BUCKET,
    overlaps_comm,
)

if TYPE_CHECKING:
    from ..recipe import Recipe
    from . import Plan


def uses_cpu_adam(recipe: Recipe, offload: str, is_gpu: bool) -> bool:
    """DeepSpeedCPUAdam steps the optimizer states on the host: only for AdamW, with the states offloaded and the
    model computing on GPUs (on a CPU-only machine the states are on the host anyway, and torch's AdamW does the
    same work without its JIT build)."""
    return offload in ("optimizer", "params") and is_gpu and recipe.training.optimizer == "adamw"


def deepspeed_config(
    recipe: Recipe,
    plan: Plan,
    *,
    dp: int | None = None,
    grad_accum: int | None = None,
    offload: str | None = None,
    is_gpu: bool | None = None,
    client_optimizer: bool = False,
) -> dict[str, Any]:
    """The config dict for `plan` (a ZeRO strategy). `dp`/`grad_accum` override the plan's when the job
    runs on a different world size than planned (the global batch stays the same). `client_optimizer`: the
    optimizer is the user's own (`job.wrap(optimizer=...)`), not the one the recipe names."""
    lay = plan.layout
    stage = spec(lay.strategy).zero_stage
    if stage is None:
        raise ValueError(f"strategy {lay.strategy!r} is not a DeepSpeed ZeRO strategy")
    strategy = lay.strategy
    tr = recipe.training
    dp = dp if dp is not None else lay.dp
    ga = grad_accum if grad_accum is not None else lay.grad_accum
    micro = lay.micro_batch
    if is_gpu is None:
        is_gpu = plan.accelerator != "cpu"
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": DS_REDUCE_BUCKET,
        "allgather_bucket_size": DS_ALLGATHER_BUCKET,
        "contiguous_gradients": True,
        "overlap_comm": overlaps_comm(bool(is_gpu)),
    }
    if stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": STAGE3_PREFETCH_BUCKET,
                "stage3_max_live_parameters": STAGE3_MAX_LIVE_PARAMETERS,
                "stage3_max_reuse_distance": STAGE3_MAX_REUSE_DISTANCE,
                "stage3_param_persistence_threshold": STAGE3_PARAM_PERSISTENCE_THRESHOLD,
                "stage3_gather_16bit_weights_on_model_save": False,
            }
        )
    offload = offload if offload is not None else lay.offload
    if offload in ("optimizer", "params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": bool(is_gpu)}
    if offload == "params":
        if stage != 3:
            raise ValueError(f"parameter offload needs ZeRO-3, the plan uses {strategy}")
        zero["offload_param"] = {"device": "cpu", "pin_memory": bool(is_gpu)}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": ga,
        "train_batch_size": micro * ga * dp,
        "gradient_clipping": tr.grad_clip,
        "zero_optimization": zero,
        # The runtime passes a torch optimizer; ZeRO accepts it (AdamW is tested upstream, SGD is not).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,  # the runtime logs; DeepSpeed's own prints would interleave
        "wall_clock_breakdown": False,
    }
    if "offload_optimizer" in zero and (client_optimizer or not uses_cpu_adam(recipe, offload, is_gpu)):
        # ZeRO-Offload refuses any optimizer but DeepSpeed's CPU Adam unless told otherwise ("client optimizer with
        # ZeRO-Offload", a ZeRORuntimeException at start-up): SGD, a user's own optimizer, or torch's AdamW on a
        # CPU-only machine step the offloaded states on the host as they are.
        cfg["zero_force_ds_cpu_optimizer"] = False
    precision = lay.precision
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        dynamic = recipe.parallelism.loss_scaling == "dynamic"
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0 if dynamic else 1.0,  # 0 = dynamic in DeepSpeed's convention
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    return cfg
