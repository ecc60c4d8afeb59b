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


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for i in range(0, n, rows):
            # log-sum-exp by hand, in place on one fp32 copy: the one temporary is this chunk (logsumexp would
            # allocate a second one inside the kernel)
            x = logits[i:i + rows].to(torch.float32, copy=True)
            m = x.amax(dim=-1)
            lse[i:i + rows] = x.sub_(m.unsqueeze(1)).exp_().sum(dim=-1).log_().add_(m)
            del x
        picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows = rows
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        n, rows = logits.shape[0], ctx.rows
        out = torch.empty_like(logits)
        scale = grad.float() / n
        for i in range(0, n, rows):
            j = min(i + rows, n)
            p = logits[i:j].to(torch.float32, copy=True)  # a copy even for fp32 logits: modified in place below
            p.sub_(lse[i:j].unsqueeze(1)).exp_()
            p[torch.arange(j - i, device=p.device), targets[i:j]] -= 1
            p.mul_(scale)
            out[i:j].copy_(p)
            del p  # before the next chunk's copy is made, so that only one chunk is alive at a time
        return out, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of (batch, seq, vocab) logits against (batch, seq) targets, in fp32."""
    flat = logits.flatten(0, 1)
    return _ChunkedCrossEntropy.apply(flat, targets.flatten(0, 1), rows or chunk_rows(flat.shape[-1]))
