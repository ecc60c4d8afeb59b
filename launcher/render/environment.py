"""The job's environment: what makes failures loud, the NCCL profile of the network, and the user's env.

Secrets never appear here: they are passed by name by each target (exported from the submitting shell).
"""

from __future__ import annotations

from ..catalog import NETWORKS
from ..jobenv import job_environment
from ..recipe import Recipe


def job_env(recipe: Recipe) -> dict[str, str]:
    res = recipe.resources
    is_gpu = res.device().is_gpu
    env = job_environment(
        NETWORKS[res.network].nccl_env,
        is_gpu=is_gpu,
        socket_ifname=res.socket_ifname,
        omp_threads=None if is_gpu else 1,
        deterministic=recipe.training.deterministic,
    )
    env.update(recipe.env)
    return env


def checkpoint_template(recipe: Recipe) -> str | None:
    """checkpoint.dir as the job script expands it ({run_id} filled in by the script); None: under the run dir."""
    return recipe.checkpoint.dir
