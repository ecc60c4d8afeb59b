"""Pipeline parallelism with torch.distributed.pipelining, as torchtitan does it: the model is cut into stages
by blocks (`launcher.plan.pipeline.stage_layers`, the split the planner charges for), each pipeline rank keeps
the stages it runs and drops the rest, and a 1F1B or interleaved 1F1B schedule runs the plan's micro-batches
through them. Every stage is a `Llama.stage` of the whole model: the same modules under the same names, so a
pipeline rank's checkpoint shards are named as the whole model's and reshard into any other layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...plan.pipeline import num_stages, stage_layers, stages_of_rank
from ..failures import ConfigError


@dataclass
class Split:
    """What one pipeline rank holds: `local` (every module of its stages, for the optimizer and checkpoints;
    the stage itself when it runs one), and the stages it runs, in order."""

    local: nn.Module
    chunks: list[nn.Module]
    stage_ids: list[int]
    num_stages: int


def split_model(model: nn.Module, pp: int, pp_rank: int, schedule: str) -> Split:
    """Keep the parts of `model` that pipeline rank `pp_rank` runs."""
    from ..models.llama import Llama

    if not isinstance(model, Llama):
        raise ConfigError(
            f"pipeline parallelism splits dtlaunch's Llama into stages; {type(model).__name__} cannot "
            "run without all of its blocks (Hugging Face decoders build their masks and rotary "
            "positions in the whole model's forward)",
            fix="set parallelism.pipeline: 1 for this model",
        )
    if model.shape.tied_embeddings:
        raise ConfigError(
            "pipeline parallelism of a model with tied input and output embeddings is not supported: "
            "the embedding (first stage) and the head (last stage) share one weight",
            fix="set parallelism.pipeline: 1, or use a model with separate embeddings",
        )
    n = num_stages(pp, schedule)
    try:
        counts = stage_layers(model.shape.layers, n)
    except ValueError as e:
        raise ConfigError(
            f"the pipeline cannot be split: {e}",
            fix="lower parallelism.pipeline, or use parallelism.pipeline_schedule: 1f1b",
        ) from None
    starts = [sum(counts[:i]) for i in range(n)]
    ids = stages_of_rank(pp_rank, pp, schedule)
    chunks: list[nn.Module] = [
        Llama.stage(model, i == 0, list(range(starts[i], starts[i] + counts[i])), i == n - 1) for i in ids
    ]
    if len(chunks) == 1:
        local = chunks[0]
    else:
        every = [b for i in ids for b in range(starts[i], starts[i] + counts[i])]
        local = Llama.stage(model, 0 in ids, every, n - 1 in ids)
    return Split(local, chunks, ids, n)


def materialise_split(split: Split, device: torch.device, offload: bool) -> None:
    """Materialise a split built on the meta device, chunk by chunk: with an interleaved schedule `local` is a
    module of its own beside the chunks (they share its blocks, not its buffers), and each chunk is an FSDP2
    root whose sharded parameters are reset only by its own to_empty. `local` then shares the first chunk's
    rotary tables (it never runs forward, but must hold no meta tensor)."""
    from ..models import materialise

    for chunk in split.chunks:
        materialise(chunk, device, offload)
    if split.local not in split.chunks:
        for name in ("rope_cos", "rope_sin"):
            split.local.register_buffer(name, getattr(split.chunks[0], name), persistent=False)


def build_schedule(
    split: Split,
    device: torch.device,
    group,
    schedule: str,
    micro_batches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """The schedule that runs one optimizer step's micro-batches through this rank's stages. `loss_fn` sees
    the last stage's output and targets of one micro-batch; gradients are not rescaled afterwards (the loss
    is divided by the number of micro-batches, as the other engines do)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B

    stages: list = [  # of PipelineStage; torch's schedules take their private base class's list
        PipelineStage(c, i, split.num_stages, device, group=group)
        for c, i in zip(split.chunks, split.stage_ids, strict=True)
    ]
    if schedule == "1f1b":
        return Schedule1F1B(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False), stages
    return ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=loss_fn, scale_grads=False), stages
