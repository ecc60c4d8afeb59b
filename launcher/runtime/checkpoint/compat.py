"""Is a checkpoint this run's? What can change between a save and a resume, and what cannot.

Elastic resumes are the point of DCP checkpoints: a different world size, a different torch strategy or
layout (data, tensor, pipeline degrees: resharded), another global batch (the data position is rescaled) only
earn a note. The run's identity does
not change: the model, the optimizer and its schedule's shape, the data. A checkpoint of another recipe
would otherwise be picked up silently by a job whose checkpoint.dir happens to hold it. Only the length of
training may differ freely: extending a finished run is how a run is continued.
"""

from __future__ import annotations

from typing import Any

from ..failures import ConfigError

# The recipe fields that make two runs the same run. Everything else is how, where and for how long it runs.
IDENTITY_TRAINING = (
    "optimizer",
    "lr",
    "min_lr",
    "weight_decay",
    "betas",
    "grad_clip",
    "warmup_steps",
    "schedule",
    "seed",
)
IDENTITY_DATA = ("source", "path", "dtype", "num_tokens")


def identity(recipe_dict: dict) -> dict[str, Any]:
    tr = recipe_dict.get("training", {})
    out = {f"model.{k}": v for k, v in sorted(recipe_dict.get("model", {}).items())}
    out.update({f"training.{k}": tr.get(k) for k in IDENTITY_TRAINING})
    out.update({f"training.data.{k}": tr.get("data", {}).get(k) for k in IDENTITY_DATA})
    return out


def identity_changes(saved: dict, mine: dict) -> list[str]:
    return [
        f"{k}: {saved.get(k)!r} -> {mine.get(k)!r}"
        for k in sorted(set(saved) | set(mine))
        if saved.get(k) != mine.get(k)
    ]


def describe_layout(d: dict) -> str:
    """'fsdp dp2 tp2 pp2 (sequence parallel, 1f1b)' from a checkpoint's layout metadata."""
    extra = ["sequence parallel"] if d.get("sequence_parallel") else []
    extra += [d["pp_schedule"]] if d.get("pp_schedule") else []
    return f"{d.get('strategy')} dp{d.get('dp')} tp{d.get('tp')} pp{d.get('pp')}" + (
        f" ({', '.join(extra)})" if extra else ""
    )


def check_compatible(
    saved: dict, mine: dict, *, world_size: int, deepspeed: bool, allow_changed_recipe: bool, fmt: int
) -> list[str]:
    """Refuse what cannot (or must not) be resumed (ConfigError); return notes for what changed but can."""
    if saved.get("format") != fmt:
        raise ConfigError(f"checkpoint format {saved.get('format')} is not this dtlaunch's ({fmt})")
    if saved.get("shape") != mine.get("shape"):
        raise ConfigError(
            f"the checkpoint holds a different model shape: {saved.get('shape')} vs {mine.get('shape')}",
            fix="resume with the recipe's original model, or use a new checkpoint.dir",
        )
    if saved.get("family") != mine.get("family"):
        into = describe_layout(mine["layout"]) if mine.get("layout") else mine.get("strategy")
        raise ConfigError(
            f"the checkpoint was written by {saved.get('strategy')} ({saved.get('family')} format) and "
            f"cannot be resharded into {into} ({mine.get('family')} format)",
            fix=f"resume with strategy {saved.get('strategy')}, or start a new checkpoint.dir",
        )
    if deepspeed and saved.get("world_size") != world_size:
        raise ConfigError(
            f"DeepSpeed ZeRO checkpoints resume only at the same world size: saved with "
            f"{saved.get('world_size')} ranks, now {world_size}",
            fix=f"run on {saved.get('world_size')} ranks, or convert the checkpoint with "
            "deepspeed.utils.zero_to_fp32 and start a new run",
        )
    if deepspeed and saved.get("strategy") != mine.get("strategy"):
        raise ConfigError(
            f"the checkpoint was written by {saved.get('strategy')}, this run is {mine.get('strategy')}",
            fix=f"resume with strategy {saved.get('strategy')}",
        )
    notes = []
    old_layout, new_layout = saved.get("layout"), mine.get("layout")
    if old_layout and new_layout and old_layout != new_layout:
        # DCP saves every tensor under its whole-model name with its global shape: any layout loads it
        notes.append(f"layout {describe_layout(old_layout)} -> {describe_layout(new_layout)} (resharded)")
    if "identity" in saved:
        changed = identity_changes(saved["identity"], mine["identity"])
        if changed and not allow_changed_recipe:
            raise ConfigError(
                "the checkpoint was written by a different recipe ("
                + "; ".join(changed[:8])
                + ("; ..." if len(changed) > 8 else "")
                + ")",
                fix="resume with the recipe that wrote it, use a new checkpoint.dir (or run id), or set "
                "checkpoint.resume_changed_recipe: true to continue from these weights anyway",
            )
        notes += [f"recipe changed (allowed): {c}" for c in changed]
    for key in ("world_size", "strategy", "precision", "grad_accum", "global_batch"):
        old = saved.get(key)
        new = world_size if key == "world_size" else mine.get(key)
        if old != new:
            notes.append(f"{key} {old} -> {new}")
    return notes
