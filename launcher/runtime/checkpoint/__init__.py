"""Save and resume everything a run needs to continue exactly: model, optimizer, LR schedule, loss scaler,
step, data position, and every rank's RNG streams.

DDP/FSDP2 use torch.distributed.checkpoint (sharded, reshardable to any world size); ZeRO uses DeepSpeed's
own format (resumable only at the same world size). Both go through the protocol in `disk`, which imports no
torch (the job scripts' decisions and the CLI read checkpoints with it, so this __init__ imports nothing): each
rank writes its files and a manifest of them (sizes, CRC-32), then rank 0 commits. A resume only trusts a
checkpoint whose files and records check out; one that does not is reported, marked CORRUPT and skipped for
the one before it, never loaded and never deleted. A read that keeps failing is not damage: the attempt ends
with StorageError and nothing is marked. Full or read-only storage ends the run with StorageError too,
naming the path, what a checkpoint needs and what is free. Async saves (DCP) run on their own gloo group, at
most one in flight, and are committed as soon as every rank's manifest is visible, or at the next collective
wait. The torch side is `checkpointer.Checkpointer`; the export of the final weights is `export`.
"""
