"""What a checkpoint holds besides the model and optimizer: each rank's RNG streams, the LR schedule and
loss scaler; and the one way such small files are written (through a buffer, durably)."""

from __future__ import annotations

import io
import random
import sys
from pathlib import Path
from typing import Any

import torch

from . import disk


def rng_state() -> dict:
    """This rank's generators. On a GPU only the device this rank drives: saving every visible device's state
    (get_rng_state_all) made a resume with fewer visible GPUs per process fail (IndexError), and the other
    devices' generators belong to the other ranks anyway."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # written by earlier dtlaunch versions: every visible device's state
            index = torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])


def save_torch(obj: Any, path: Path) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    disk.write_file_durably(path, buf.getvalue())


def rank_file(rank: int) -> str:
    return f"rng-{rank:05d}.pt"
