"""Initial weights that are a function of (seed, parameter name, global shape) only.

Why not `nn.init.normal_` on the global generator: a model built on the meta device and materialised after
sharding initialises each rank's shard on its own. On CUDA, DTensor's RNG tracker gives every rank of the
world the same Philox offset, so every pipeline stage would draw the same numbers for its layers (correlated
stages); on CPU, DTensor has no tracker and every shard of a parameter would hold the same values. Either way
the weights would depend on the layout.

Here each parameter is cut into blocks of whole rows (about `BLOCK_ELEMS` elements; the row count depends on
the global shape only), each block drawn from its own CPU generator seeded by (seed, name, block). A rank
draws only the blocks that overlap its shard and keeps its part, so the initial weights are the same for any
layout, any world size, eager or meta construction, and on CPU or GPU: a layout change at step 0 changes
nothing, and a rehearsal on CPU starts from the weights the GPU job starts from.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

BLOCK_ELEMS = 1 << 22  # 16 MB of fp32 per drawn block: a bounded transient, few generator set-ups


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def local_part(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's tensor, the global shape, the global offset of its first element) of a parameter that may be
    a DTensor (FSDP2 or tensor parallel shards; DCP uses the same offsets to reshard checkpoints)."""
    if hasattr(param, "device_mesh"):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        dt = cast("DTensor", param)  # the tensor with a device mesh
        local = dt.to_local()
        shape = tuple(dt.shape)
        with unset_fake_temporarily():  # offsets are plain numbers, also when tracing on fake tensors
            local_shape, offset = compute_local_shape_and_global_offset(shape, dt.device_mesh, dt.placements)
        if tuple(local_shape) != tuple(local.shape):  # pragma: no cover - a placement DCP could not reshard either
            raise RuntimeError(
                f"cannot place a shard of shape {tuple(local.shape)} in a {shape} parameter "
                f"(expected {tuple(local_shape)})"
            )
        return local, shape, tuple(offset)
    return param, tuple(param.shape), (0,) * param.dim()


def _rows(shape: tuple[int, ...], r0: int, r1: int, std: float, seed: int, name: str):
    """(first row, values) of each drawn block overlapping rows [r0, r1) of the parameter, clipped to them."""
    row_elems = math.prod(shape[1:])
    rows_per_block = max(1, BLOCK_ELEMS // max(1, row_elems))
    for b in range(r0 // rows_per_block, (r1 - 1) // rows_per_block + 1):
        lo, hi = b * rows_per_block, min((b + 1) * rows_per_block, shape[0])
        gen = torch.Generator().manual_seed(_block_seed(seed, name, b))
        block = torch.empty((hi - lo, *shape[1:]), dtype=torch.float32, device="cpu")
        block.normal_(0.0, std, generator=gen)
        a, z = max(lo, r0), min(hi, r1)
        yield a, block.narrow(0, a - lo, z - a)


@torch.no_grad()
def normal_(param: torch.Tensor, std: float, *, seed: int, name: str) -> None:
    """Fill `param` (whole, or this rank's shard of it) with N(0, std) values that depend only on
    (seed, name, its global shape)."""
    local, shape, offset = local_part(param)
    if local.numel() == 0:
        return
    r0 = offset[0]
    for a, piece in _rows(shape, r0, r0 + local.shape[0], std, seed, name):
        for d in range(1, len(shape)):
            piece = piece.narrow(d, offset[d], local.shape[d])
        local.narrow(0, a - r0, piece.shape[0]).copy_(piece)


@torch.no_grad()
def normal_flat_(dst: torch.Tensor, start: int, shape: tuple[int, ...], std: float, *, seed: int, name: str) -> None:
    """Fill the 1-D `dst` with elements [start, start + dst.numel()) of the flattened parameter that `normal_`
    would draw for the whole (DeepSpeed ZeRO-3 keeps each rank's partition so: a flat slice)."""
    n = dst.numel()
    if n == 0:
        return
    row = max(1, math.prod(shape[1:]))
    r0, r1 = start // row, -(-(start + n) // row)
    for a, piece in _rows(shape, r0, r1, std, seed, name):
        flat = piece.reshape(-1)
        lo = a * row  # flat index of the piece's first element
        i, j = max(lo, start), min(lo + flat.numel(), start + n)
        if i < j:
            dst.narrow(0, i - start, j - i).copy_(flat.narrow(0, i - lo, j - i))


__all__ = ["BLOCK_ELEMS", "local_part", "normal_", "normal_flat_"]
