"""Rules about what dtlaunch's runtime would refuse at start-up: found here, before the queue."""
from __future__ import annotations

import os

from ..plan import Plan
from ..recipe import Recipe
from .core import rule


@rule("no-training-length", "error", "training.steps", "no training length", trainer_only=True)
def _length(r: Recipe, p: Plan):
    if p.steps is None:
        return ("the recipe gives neither training.steps nor training.tokens: `plan` can size memory, but a job needs "
                "to know when to stop", "set training.steps (or training.tokens)")


@rule("runtime-architecture", "error", "model.architecture", "an architecture the runtime does not build", trainer_only=True)
def _arch(r: Recipe, p: Plan):
    if r.model.architecture != "llama":
        return (f"the runtime trains llama decoders; architecture {r.model.architecture!r} is for planning only",
                "set model.architecture: llama (or use your own training script)")


@rule("runtime-shape", "error", "model", "a model given only by its parameter count", trainer_only=True)
def _shape(r: Recipe, p: Plan):
    if r.model.shape() is None:
        return ("the runtime builds the model from its shape, and this one has only `params`",
                "give model.preset, or layers/hidden/ffn_hidden/heads/vocab")


@rule("runtime-tp-pp", "warning", "parallelism", "tensor/pipeline parallel training is planned, not run, by this runtime", trainer_only=True)
def _tp_runtime(r: Recipe, p: Plan):
    if p.layout.tp > 1 or p.layout.pp > 1:
        return ("dtlaunch's runtime trains with data parallelism (DDP/FSDP2/ZeRO); tensor and pipeline degrees are for "
                "planning here", "use your own TP/PP training script with `dtlaunch render`, or tensor: 1, pipeline: 1")


@rule("data-too-small", "error", "training.data.num_tokens", "less data than one global batch", trainer_only=True)
def _data_small(r: Recipe, p: Plan):
    d = r.training.data
    if d.source == "synthetic":
        sequences = (d.num_tokens - 1) // p.seq_len
        if sequences < p.global_batch:
            return (f"{d.num_tokens:,} synthetic tokens make {sequences} sequences of {p.seq_len}, fewer than one "
                    f"global batch ({p.global_batch})",
                    f"set training.data.num_tokens to at least {p.global_batch * p.seq_len + 1:,}")


@rule("data-path", "warning", "training.data.path", "the data file does not exist here", trainer_only=True)
def _data_path(r: Recipe, p: Plan):
    d = r.training.data
    if d.source == "file" and d.path and "{" not in d.path and not os.path.exists(os.path.expanduser(d.path)):
        return (f"{d.path} does not exist on this machine", "check the path; it must exist on every node of the job")


@rule("entrypoint-missing", "error", "entrypoint.script", "the entrypoint script is not in its workdir")
def _entry_missing(r: Recipe, p: Plan):
    ep = r.entrypoint
    if ep is None or r.base_dir() is None and ep.workdir is None:
        return None
    from ..render.code import workdir

    wd = workdir(r)
    if not wd.is_dir():
        return (f"entrypoint.workdir {wd} is not a directory", "point it at your code (relative to the recipe file)")
    if ep.script is not None and not (wd / ep.script).is_file():
        return (f"{ep.script} is not in {wd}: the job runs a copy of entrypoint.workdir",
                "give the script's path relative to entrypoint.workdir (default: the recipe file's directory)")
    return None
