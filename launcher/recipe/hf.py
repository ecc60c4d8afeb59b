"""Hugging Face models (`model.hf: DIR`): the shape comes from DIR/config.json, read once where the recipe is
loaded and kept in the resolved recipe (`model.hf_config`), so the plan, the job and a resume all see the
same config, and a node needs the directory only for the weights.

Llama-style decoders only (Llama, Mistral, Qwen2): the planner's layer is RMSNorm + GQA attention with
rotary positions + SwiGLU, which is what these are. Their differences that change the parameter count are
kept in the shape (Qwen2's q/k/v biases; Llama's optional attention and MLP biases), so the plan counts
exactly what `transformers` builds from the same config. Torch- and transformers-free.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SUPPORTED = ("llama", "mistral", "qwen2")
MAX_CONFIG_BYTES = 1 << 20
# Without model.seq_len, train at the model's context length up to this (a 128K context is a choice to make
# on purpose: it multiplies activation memory).
DEFAULT_MAX_SEQ = 4096
WEIGHT_SUFFIXES = (".safetensors",)


class HFConfigError(ValueError):
    """What is wrong with the config, in words a user can act on (the loader adds file and line)."""


def resolve_dir(path: str, base_dir: str | None) -> Path:
    p = Path(os.path.expanduser(path))
    if not p.is_absolute() and base_dir:
        p = Path(base_dir) / p
    return p.resolve()


def read_config(model_dir: Path) -> dict[str, Any]:
    f = model_dir / "config.json"
    if not model_dir.is_dir():
        raise HFConfigError(f"{model_dir} is not a directory (model.hf names a directory with config.json)")
    try:
        with open(f, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise HFConfigError(f"{f} not found: model.hf names a Hugging Face model directory") from None
    except OSError as e:
        raise HFConfigError(f"cannot read {f}: {e.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise HFConfigError(f"{f} is over {MAX_CONFIG_BYTES:,} bytes: not a model config")
    try:
        cfg = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFConfigError(f"{f} is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{f} must hold a JSON object")
    shape_fields(cfg)  # refuse what the planner cannot describe now, not at plan time
    return cfg


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES) if model_dir.is_dir() else []


def _int(cfg: dict, key: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise HFConfigError(f"config.json: {key} must be a positive whole number, got {v!r}")
    return v


def shape_fields(cfg: dict, seq_len: int | None = None) -> dict[str, Any]:
    """The ModelShape fields for a config.json dict; HFConfigError for what is not a supported decoder."""
    kind = cfg.get("model_type")
    if kind not in SUPPORTED:
        raise HFConfigError(
            f"config.json: model_type {kind!r} is not a decoder dtlaunch can plan and train "
            f"(supported: {', '.join(SUPPORTED)})"
        )
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    kv = _int(cfg, "num_key_value_heads", heads) if cfg.get("num_key_value_heads") is not None else heads
    if hidden % heads or heads % kv:
        raise HFConfigError(
            f"config.json: hidden_size {hidden}, num_attention_heads {heads} and "
            f"num_key_value_heads {kv} do not divide evenly"
        )
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise HFConfigError(
            f"config.json: head_dim {head_dim} differs from hidden_size/num_attention_heads = "
            f"{hidden // heads}; dtlaunch's planner models head_dim = hidden/heads only"
        )
    if cfg.get("rope_scaling") not in (None, {}) and not isinstance(cfg.get("rope_scaling"), dict):
        raise HFConfigError("config.json: rope_scaling must be an object or null")
    biased_attention = bool(cfg.get("attention_bias", False))
    max_pos = cfg.get("max_position_embeddings")
    if seq_len:
        seq = seq_len
    elif isinstance(max_pos, int) and not isinstance(max_pos, bool) and max_pos > 0:
        seq = min(max_pos, DEFAULT_MAX_SEQ)
    else:
        seq = DEFAULT_MAX_SEQ
    theta = cfg.get("rope_theta", 10000.0)
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise HFConfigError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise HFConfigError(f"config.json: rms_norm_eps must be a positive number, got {eps!r}")
    return {
        "layers": _int(cfg, "num_hidden_layers"),
        "hidden": hidden,
        "ffn_hidden": _int(cfg, "intermediate_size"),
        "heads": heads,
        "kv_heads": kv,
        "vocab": _int(cfg, "vocab_size"),
        "tied_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "seq_len": seq,
        "rope_theta": float(theta),
        "norm_eps": float(eps),
        # Qwen2 always has q/k/v biases; Llama has q/k/v/o biases with attention_bias, MLP biases with mlp_bias.
        "qkv_bias": kind == "qwen2" or biased_attention,
        "out_bias": kind == "llama" and biased_attention,
        "mlp_bias": kind == "llama" and bool(cfg.get("mlp_bias", False)),
    }
