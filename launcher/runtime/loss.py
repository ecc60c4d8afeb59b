"""Cross-entropy over a large vocabulary without fp32 copies of all the logits.

`F.cross_entropy(logits.float(), ...)` keeps, at the start of backward, the 16-bit logits, the fp32 copy's
log-softmax and two fp32 gradients of the whole (tokens x vocab) matrix: 14 bytes per element in bf16, the
largest single block of memory of a Llama step at a 128K vocabulary. This function keeps the logits and one
fp32 log-sum-exp per token, and works on `chunk_rows` tokens at a time in fp32 in both directions, so the
whole step holds the logits, their gradient (same dtype) and one chunk of fp32 temporaries. Each chunk is
computed in place on one fp32 copy, so that the temporaries are the ones written here, on any device.

The gradient is the textbook one, (softmax - onehot) / N, computed from the saved log-sum-exp.
"""

from __future__ import annotations

import torch

# One fp32 chunk of this many bytes at a time: large enough that the per-chunk launches are noise on a GPU,
# small beside the logits (a 128K vocabulary gives ~520 tokens per chunk, the logits of 8K tokens 2.1 GB).
CHUNK_BYTES = 2**28


def chunk_rows(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per fp32 chunk of `chunk_bytes` (the planner charges the same chunk)."""
    return max(1, chunk_bytes // (4 * vocab))


def _softmax_minus_target(
    logits: torch.Tensor,
    lse: torch.Tensor,
    cols: torch.Tensor,
    grad: torch.Tensor,
    rows: int,
    outside: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of the mean cross-entropy, (softmax - onehot(cols)) * grad / N, one fp32 chunk at a time,
    into a tensor of the logits' dtype. `outside`: rows whose target another rank's slice holds (no onehot)."""
    n = logits.shape[0]
    out = torch.empty_like(logits)
    scale = grad.float() / n
    for i in range(0, n, rows):
        j = min(i + rows, n)
        p = torch.sub(logits[i:j], lse[i:j].unsqueeze(1)).exp_()  # fp32, a new chunk even for fp32 logits
        p[torch.arange(j - i, device=p.device), cols[i:j]] -= 1 if outside is None else (~outside[i:j]).float()
        torch.mul(p, scale, out=out[i:j])  # scaled straight into the gradient, in its dtype
        del p  # before the next chunk is made, so that only one chunk is alive at a time
    return out


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for i in range(0, n, rows):
            # log-sum-exp by hand: the one temporary is this chunk's fp32 `x - max`, written by the subtraction
            # itself (a 16-bit chunk minus an fp32 column promotes to fp32: no separate copy, one pass less),
            # then changed in place (logsumexp would allocate a second one inside the kernel)
            chunk = logits[i : i + rows]
            m = chunk.amax(dim=-1).float()  # exact in any dtype
            lse[i : i + rows] = (chunk - m.unsqueeze(1)).exp_().sum(dim=-1).log_().add_(m)
        picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows = rows
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        return _softmax_minus_target(logits, lse, targets, grad, ctx.rows), None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The same loss on logits split over the vocabulary across a tensor-parallel group (Megatron's
    vocabulary-parallel cross-entropy): each rank holds (tokens x V/tp) and the chunked fp32 work of its own
    slice; three all-reduces of one number per token (the max, the sum of exponentials, the target's logit)
    make the log-sum-exp and the loss whole. The gradient of a rank's slice needs nothing from the others."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int, group, start: int) -> torch.Tensor:
        import torch.distributed as dist

        n, v = logits.shape
        m = logits.amax(dim=-1).float()  # exact in any dtype: no fp32 copy needed for the max
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        total = torch.empty(n, dtype=torch.float32, device=logits.device)
        for i in range(0, n, rows):  # the fp32 `x - max` chunk is the subtraction's own result, as above
            total[i : i + rows] = (logits[i : i + rows] - m[i : i + rows].unsqueeze(1)).exp_().sum(dim=-1)
        local = targets - start
        outside = (local < 0) | (local >= v)
        local = local.masked_fill(outside, 0)
        picked = logits.gather(1, local.unsqueeze(1)).squeeze(1).float().masked_fill_(outside, 0.0)
        both = torch.stack([total, picked])
        dist.all_reduce(both, group=group)
        lse = both[0].log_().add_(m)
        ctx.save_for_backward(logits, local, outside, lse)
        ctx.rows = rows
        return (lse - both[1]).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, local, outside, lse = ctx.saved_tensors
        return _softmax_minus_target(logits, lse, local, grad, ctx.rows, outside), None, None, None, None


def _vocab_parallel(logits, targets: torch.Tensor, rows: int | None) -> torch.Tensor:
    """Logits as a DTensor sharded over the vocabulary (the tensor-parallel head's output)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if (
        logits.device_mesh.ndim != 1
        or not isinstance(logits.placements[0], Shard)
        or logits.placements[0].dim % logits.ndim != logits.ndim - 1
    ):
        raise ValueError(
            f"the vocabulary-parallel loss needs logits sharded over the vocabulary on one mesh "
            f"dimension, got {logits.placements}"
        )
    _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)
    flat = logits.to_local().flatten(0, 1)
    return _VocabParallelCrossEntropy.apply(
        flat, targets.flatten(0, 1), rows or chunk_rows(flat.shape[-1]), logits.device_mesh.get_group(), int(offset[-1])
    )


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of (batch, seq, vocab) logits against (batch, seq) targets, in fp32. Logits split
    over the vocabulary by tensor parallelism (a DTensor) take the vocabulary-parallel path."""
    if type(logits) is not torch.Tensor and hasattr(logits, "device_mesh"):
        return _vocab_parallel(logits, targets, rows)
    flat = logits.flatten(0, 1)
    return _ChunkedCrossEntropy.apply(flat, targets.flatten(0, 1), rows or chunk_rows(flat.shape[-1]))
