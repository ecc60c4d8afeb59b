"""The batch split: global batch = micro_batch x data-parallel degree x grad_accum, and what is wrong with one.

One home for these facts: the planner derives grad_accum for every layout it sizes (`grad_accum_for`), the
`strategy: auto` search refuses a tensor/pipeline degree that would break a split the recipe's own degrees keep
(`batch_problem`), `plan` prints the split as it is, and validate's batch rules say the same words.
"""

from __future__ import annotations

import math


def grad_accum_for(global_batch: int | None, micro_batch: int, dp: int, grad_accum) -> tuple[int, int]:
    """(grad_accum, global_batch): global = micro_batch * dp * grad_accum; derive whichever is 'auto'.

    Where global_batch is not a multiple of micro_batch * dp, grad_accum is rounded up and global_batch stays the
    recipe's: the product then differs from it, which `indivisible_batch` reports."""
    if isinstance(grad_accum, int):
        return grad_accum, global_batch if global_batch is not None else micro_batch * dp * grad_accum
    if global_batch is None:
        return 1, micro_batch * dp
    return max(1, math.ceil(global_batch / (micro_batch * dp))), global_batch


def indivisible_batch(global_batch: int | None, micro_batch: int, dp: int, grad_accum) -> tuple[str, str] | None:
    """(message, fix) when global_batch cannot be split into micro-batches over dp ranks as the recipe asks."""
    if global_batch is None:
        return None
    per_step = micro_batch * dp
    if global_batch % per_step:
        return (
            f"global_batch {global_batch} is not a multiple of micro_batch {micro_batch} x data-parallel {dp} = "
            f"{per_step}",
            f"use a global_batch such as {max(1, global_batch // per_step) * per_step} or change micro_batch",
        )
    if isinstance(grad_accum, int) and global_batch != per_step * grad_accum:
        return (
            f"global_batch {global_batch} != micro_batch {micro_batch} x dp {dp} x grad_accum {grad_accum}",
            "set grad_accum: auto, or make the three agree",
        )
    return None


def batch_too_small(global_batch: int | None, micro_batch: int, dp: int) -> tuple[str, str] | None:
    """(message, fix) when one micro-batch on every data-parallel rank is already more than the global batch."""
    if global_batch is not None and global_batch < micro_batch * dp:
        return (
            f"global_batch {global_batch} < micro_batch x dp = {micro_batch * dp}: some ranks would get no data",
            f"raise global_batch to at least {micro_batch * dp}",
        )
    return None


def batch_problem(global_batch: int | None, micro_batch: int, dp: int, grad_accum) -> tuple[str, str] | None:
    """The first thing wrong with the split, (message, fix), or None."""
    return batch_too_small(global_batch, micro_batch, dp) or indivisible_batch(
        global_batch, micro_batch, dp, grad_accum
    )
