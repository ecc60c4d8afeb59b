"""Save and resume everything a run needs to continue exactly: model, optimizer, LR schedule, loss scaler,
step, data position, and every rank's RNG streams.

DDP/FSDP2 use torch.distributed.checkpoint (sharded, reshardable to any world size); ZeRO uses DeepSpeed's
own format (resumable only at the same world size). Both go through the protocol in `disk` (no torch, so the job scripts' decisions and the CLI read
checkpoints without it): each rank
writes its files and a manifest of them (sizes, CRC-32), then rank 0 commits. A resume only trusts a
checkpoint whose files and records check out; one that does not is reported, marked CORRUPT and skipped for
the one before it, never loaded and never deleted. A read that keeps failing is not damage: the attempt ends
with StorageError and nothing is marked. Full or read-only storage ends the run with StorageError too,
naming the path, what a checkpoint needs and what is free. Async saves (DCP) run on their own gloo group, at most one in
flight, and are committed as soon as every rank's manifest is visible, or at the next collective wait.
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy, so that `disk` (no torch) is importable without torch: `checkpointer` imports it.
_EXPORTS = {
    "Checkpointer": ".checkpointer",
    "CheckpointInvalid": ".checkpointer",
    "FORMAT": ".checkpointer",
    "staging_options": ".checkpointer",
    "export_model": ".export",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
