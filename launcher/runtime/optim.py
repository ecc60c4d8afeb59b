"""Optimizer and learning-rate schedule from the recipe; the same objects for every strategy.

The schedule is a pure function of the step (LambdaLR), so a resumed run computes the same rate
as an uninterrupted one from the saved step alone.
"""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, *, steps: int, warmup: int, schedule: str, lr: float, min_lr: float) -> float:
    """Multiplier of the peak rate after `step` optimizer steps: linear warmup, then the decay."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or steps <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    floor = min_lr / lr if lr > 0 else 0.0
    if schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on norms and other 1-D parameters (the usual GPT/Llama practice)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        # a ZeRO-3 parameter built under zero.Init is an empty placeholder; its real shape is ds_shape
        ndim = len(getattr(p, "ds_shape", p.shape))
        (decay if ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    model: torch.nn.Module, training, *, cpu_adam: bool = False, fused: bool = False
) -> torch.optim.Optimizer:
    """`fused`: AdamW in one kernel over all parameters (torchtitan's default on GPUs; on the host too, for
    offloaded states, where the default loops over the tensors one by one). GPU jobs set it; CPU-only jobs keep
    torch's default."""
    groups = param_groups(model, training.weight_decay)
    if training.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=training.lr, momentum=0.9)
    if cpu_adam:  # DeepSpeed's vectorised CPU Adam: the only fast optimizer for offloaded states
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=training.lr, betas=tuple(training.betas), adamw_mode=True)
    return torch.optim.AdamW(groups, lr=training.lr, betas=tuple(training.betas), eps=1e-8, fused=fused or None)


def build_scheduler(optimizer: torch.optim.Optimizer, training, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    def f(step: int) -> float:
        return lr_factor(
            step,
            steps=steps,
            warmup=training.warmup_steps,
            schedule=training.schedule,
            lr=training.lr,
            min_lr=training.min_lr,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)


def apply_schedule(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set each group's rate to what *this* run's schedule gives at the restored step.

    A resumed scheduler restores its step count, but the rate in the optimizer is whatever the *saved*
    schedule ended at: extending a finished 20-step cosine run to 30 steps would train its next step at
    rate 0. LambdaLR keeps this run's function (functions are not part of its state), so recompute from it.
    """
    step = scheduler.last_epoch
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * fn(step)
