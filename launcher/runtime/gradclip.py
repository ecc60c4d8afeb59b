"""Gradient clipping by the global 2-norm, computed on each rank's local shards where it can be.

`torch.nn.utils.clip_grad_norm_` takes FSDP2's gradients as they are, DTensors, so each gradient's norm and
each scaling goes through DTensor's dispatch, a cost per gradient that the local shards do not pay. When every gradient is laid out the same way (DDP's plain tensors; FSDP2 and HSDP: one mesh, one placement
for all), this module sums the squares of the local shards, all-reduces that one number over the mesh
dimensions the gradients are sharded on, and scales the local shards, which are the DTensors' own storage.
Gradients placed differently from one another (tensor parallelism shards some and replicates others) take
DTensor's own path, which reduces each by its placement.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _uniform_shards(grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list] | None:
    """The gradients' local tensors and the process groups their shards are spread over, or None when the
    gradients are DTensors placed differently from one another (or partial sums)."""
    if not any(hasattr(g, "device_mesh") for g in grads):
        return grads, []
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dtensors = [g for g in grads if isinstance(g, DTensor)]
    if len(dtensors) < len(grads):  # plain tensors beside DTensors
        return None
    mesh, placements = dtensors[0].device_mesh, dtensors[0].placements
    if not all(g.device_mesh == mesh and g.placements == placements for g in dtensors):
        return None
    if not all(isinstance(p, (Shard, Replicate)) for p in placements):
        return None
    groups = [mesh.get_group(d) for d, p in enumerate(placements) if isinstance(p, Shard) and mesh.size(d) > 1]
    return [g.to_local() for g in dtensors], groups


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, *, sum_over=None) -> torch.Tensor:
    """Scale every gradient so that their global 2-norm is at most `max_norm`; returns that norm before
    scaling, as a plain tensor on every rank (as torch.nn.utils.clip_grad_norm_, without raising on a
    non-finite norm: the loop's non-finite check reports it). `sum_over`: a process group whose ranks hold
    *different* parameters (a pipeline's stages), whose squares are summed too."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    local = _uniform_shards(grads) if grads else ([], [])
    if local is None:  # mixed placements: DTensor reduces each gradient by its own
        total = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=None)
        norm = cast("DTensor", total).full_tensor()  # the norm of DTensors is a DTensor
        groups: list = []
    elif not grads:  # nothing to clip here, but a pipeline's other stages still sum this stage's zero
        grads, groups = local
        norm = torch.zeros((), device=params[0].device if params else "cpu")
    else:
        grads, groups = local
        norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=None)
    if sum_over is not None:
        groups.append(sum_over)
    if groups:
        sq = norm.float().square()
        for g in groups:
            dist.all_reduce(sq, group=g)
        norm = sq.sqrt()
    if local is None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm
    coef = (max_norm / (norm + 1e-6)).clamp_(max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, gs in by_device.items():
        torch._foreach_mul_(gs, coef.to(device))
    return norm
