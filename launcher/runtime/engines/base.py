"""The surface every engine offers the training loop: micro-steps, the optimizer step, the learning rate. The
loop drives every strategy through it, with no per-strategy branches."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from ...plan.layout import Layout
from ..loss import cross_entropy

OptimizerFactory = Callable[[Iterable[nn.Parameter]], Any]  # params -> a torch optimizer


class Engine:
    """One optimizer step = `grad_accum` calls of `micro_step`, then `step()`."""

    layout: Layout
    model: nn.Module  # what forward runs through (wrapped)
    module: nn.Module  # the bare model (parameter names match the checkpoint and export)
    optimizer: Any
    scheduler: Any
    step_lr: float | None = None  # the learning rate the last optimizer step used
    # times each forward (the job's stragglers.ComputeClock, set by Job.attach); accumulate enters it
    clock: AbstractContextManager = nullcontext()

    def accumulate(self, loss_fn: Callable[[nn.Module], torch.Tensor], last: bool) -> torch.Tensor:
        """One micro-batch: `loss_fn(model)` runs the forward and returns the loss; its gradients are added
        (divided by grad_accum), and reduced across ranks once the `last` micro-batch of the step is done.
        Returns the loss, detached."""
        raise NotImplementedError

    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, last: bool) -> torch.Tensor:
        """dtlaunch's own language-model loss on one micro-batch."""
        return self.accumulate(lambda model: cross_entropy(model(inputs), targets), last)

    def forward_backward(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step's micro-batches, forward and backward; returns their mean loss (fp32, detached).
        A pipeline runs them all in one schedule (`engines.mesh`)."""
        total = torch.zeros((), dtype=torch.float32, device=micro[0][0].device)
        for i, (x, y) in enumerate(micro):
            total += self.micro_step(x, y, last=i == len(micro) - 1).float()
        return total / len(micro)

    @property
    def grad_accum(self) -> int:
        return self.layout.grad_accum

    def step(self) -> dict:
        raise NotImplementedError

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
