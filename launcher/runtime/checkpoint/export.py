"""The trained weights as one consolidated file (fp32, unsharded), for use outside dtlaunch."""
from __future__ import annotations

from pathlib import Path

import torch

from ... import __version__
from .. import ckptdir
from ..parallel import DeepSpeedEngine, Engine
from .state import save_torch


def export_model(engine: Engine, out_dir: Path, fmt: str, rank: int) -> Path | None:
    """A consolidated single-file copy of the weights on rank 0; collective (every rank gathers)."""
    if fmt == "none":
        return None
    if isinstance(engine, DeepSpeedEngine):
        from deepspeed.utils import safe_get_full_fp32_param

        full = {}
        for name, p in engine.module.named_parameters():
            t = safe_get_full_fp32_param(p)  # a gather under ZeRO-3: every rank must call it
            if rank == 0:
                full[name] = t.detach().to("cpu", torch.float32).clone()
    elif hasattr(engine, "full_state_dict"):  # tensor/pipeline layouts: the stages' parts gathered on rank 0
        full = engine.full_state_dict(rank)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        full = {k: v.detach().to("cpu", torch.float32).clone() for k, v in sd.items()} if rank == 0 else {}
    if rank != 0:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config = getattr(getattr(engine.module, "hf", None), "config", None)
    if fmt == "safetensors" and hf_config is not None:
        return _export_hf(full, hf_config, out_dir / "hf")
    if fmt == "safetensors":
        from safetensors.torch import save as st_save

        path = out_dir / "model.safetensors"
        ckptdir.write_file_durably(path, st_save({k: v.contiguous() for k, v in sorted(full.items())},
                                                 metadata={"format": "pt", "dtlaunch": __version__}))
    else:
        path = out_dir / "model.pt"
        save_torch(full, path)
    return path


def _export_hf(full: dict, config, out: Path) -> Path:
    """A Hugging Face model directory (config.json + model.safetensors) that `from_pretrained` loads."""
    from safetensors.torch import save as st_save

    out.mkdir(parents=True, exist_ok=True)
    sd = {k[len("hf."):]: v.contiguous() for k, v in sorted(full.items()) if k.startswith("hf.")}
    if getattr(config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    path = out / "model.safetensors"
    ckptdir.write_file_durably(path, st_save(sd, metadata={"format": "pt", "dtlaunch": __version__}))
    ckptdir.write_file_durably(out / "config.json", config.to_json_string().encode())
    return path
