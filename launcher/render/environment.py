"""The job's environment: what makes failures loud, the NCCL profile of the network, and the user's env.

Secrets never appear here: they are passed by name by each target (exported from the submitting shell).
"""
from __future__ import annotations

from ..catalog import NETWORKS
from ..recipe import Recipe

# Failures must be loud and diagnosable (field lessons: NCCL timeouts that say nothing).
LOUD_FAILURES = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # tear down the process on a failed/timed-out collective
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # flight recorder dump on timeout
    "TORCH_FR_BUFFER_SIZE": "2000",
    "NCCL_DEBUG": "WARN",
    "PYTHONUNBUFFERED": "1",
    "PYTHONFAULTHANDLER": "1",
    # torchrun restarts must not reuse the previous attempt's gloo/NCCL addresses (shared notes, pitfall 2).
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}


def job_env(recipe: Recipe) -> dict[str, str]:
    env = dict(LOUD_FAILURES)
    env.update(NETWORKS[recipe.resources.network].nccl_env)
    if not recipe.resources.device().is_gpu:
        env["OMP_NUM_THREADS"] = "1"  # one thread per rank: oversubscription made DDP 8x slower here
    env.update(recipe.env)
    return env
