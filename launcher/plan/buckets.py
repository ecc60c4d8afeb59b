"""DeepSpeed's buffer sizes: the config (plan/deepspeed.py) writes them and the planner (plan/moments.py) counts
the same buffers. Apart from the config builder, which takes a Plan, so that the planner does not import it."""

from __future__ import annotations

# Bucket sizes written into the config (elements); the planner counts the same buffers.
DS_REDUCE_BUCKET = 200_000_000
DS_ALLGATHER_BUCKET = 200_000_000
# ZeRO-3 parameter fetching: DeepSpeed's documented defaults, written out so the plan's memory
# estimate and the job agree (prefetch ~ 0.9 * reduce bucket; at most 1e9 live gathered elements).
STAGE3_PREFETCH_BUCKET = int(0.9 * DS_REDUCE_BUCKET)
STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000
STAGE3_MAX_REUSE_DISTANCE = 1_000_000_000
STAGE3_PARAM_PERSISTENCE_THRESHOLD = 100_000


def overlaps_comm(is_gpu: bool) -> bool:
    """DeepSpeed's overlap_comm: on GPUs (a second stream; ZeRO-1/2 then double-buffer their reduce bucket), not on
    CPU ranks, where it would only add copies."""
    return is_gpu
