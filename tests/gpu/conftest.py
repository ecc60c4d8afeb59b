"""The GPU suite (`make test-gpu`): what only a GPU can show, run whenever one is available.

Every test here carries the `gpu` marker and is skipped, with the reason, where torch sees no CUDA device (or
fewer than a test needs); nothing here is mocked. The CPU suite checks the same paths as far as CPU allows
(tests/runtime/test_gpu_paths.py); docs/gpu.md records each run made on a GPU, with the device and figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # rt_harness

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/gpu/" in item.path.as_posix():
            item.add_marker(pytest.mark.gpu)
            need = item.get_closest_marker("gpus")
            n = need.args[0] if need else 1
            if GPUS < n:
                why = (
                    "torch.cuda.is_available() is False on this machine"
                    if not GPUS
                    else f"this machine has {GPUS} GPU(s)"
                )
                item.add_marker(pytest.mark.skip(reason=f"needs {n} CUDA GPU(s) on one node: {why}"))
