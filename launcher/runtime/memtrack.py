"""One training step's tensors counted on every rank with PyTorch's MemTracker, on real tensors: `dtlaunch
rehearse` compares each rank's peak with the plan's figure for the rehearsal layout. The model's parameters,
gradients and optimizer states exist before the step, so they are registered first (track_external); everything
the step allocates is counted as it happens. MemTracker is a private torch API (torch.distributed._tools), used
only here and only when DTLAUNCH_TRACK_MEMORY names a step."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from ..jobenv import MEMTRACK_DIR


class StepTracker(MemTracker):
    """MemTracker's device peak without its per-module statistics: those refuse a module's second forward in one
    session (a second micro-batch), and lose their place in an interleaved pipeline's schedule. The device's peak
    is kept apart from them (MemTracker._update_peak_stats); only the split by module is lost, which is not used."""

    def _pre_fw_hook(self, module, inputs) -> None:
        pass

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        pass

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass


@contextlib.contextmanager
def tracked(engine, run_dir: Path, rank: int):
    mt = StepTracker()
    opt = engine.optimizer
    if not isinstance(opt, torch.optim.Optimizer):  # DeepSpeed's ZeRO wrapper: the torch optimizer it steps
        opt = opt.optimizer
    mt.track_external(engine.model, opt)
    with mt:
        yield
    # per device: "Total" bytes at the peak, and the same split by kind (parameter, gradient, optstate, ...)
    peak = {str(dev): {k: int(v) for k, v in kinds.items()} for dev, kinds in mt.get_tracker_snapshot("peak").items()}
    d = Path(run_dir) / MEMTRACK_DIR
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank-{rank:05d}.json").write_text(json.dumps({"rank": rank, "peak": peak}, sort_keys=True) + "\n")
