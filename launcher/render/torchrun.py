"""The one launch command every target runs, with the per-target values filled in."""
from __future__ import annotations

from typing import Optional

from .shell import Word, flag

TRAIN_MODULE = "launcher.train"


def torchrun_command(*, python: Word, nnodes: Word, nproc_per_node: Word, rdzv_endpoint: Word, rdzv_id: Word,
                     max_restarts: int, plan_path: Word, run_dir: Optional[Word] = None,
                     extra: tuple[Word, ...] = ()) -> list[Word]:
    """c10d rendezvous with an explicit endpoint (never a silent localhost fallback), and no --node-rank:
    with c10d the ranks are assigned at rendezvous (field lessons: rendezvous address)."""
    cmd: list[Word] = [
        python, "-m", "torch.distributed.run",
        flag("--nnodes", nnodes),
        flag("--nproc-per-node", nproc_per_node),
        "--rdzv-backend=c10d",
        flag("--rdzv-endpoint", rdzv_endpoint),
        flag("--rdzv-id", rdzv_id),
        f"--max-restarts={int(max_restarts)}",
        *extra,
        "-m", TRAIN_MODULE, "--plan", plan_path,
    ]
    if run_dir is not None:
        cmd += ["--run-dir", run_dir]
    return cmd

