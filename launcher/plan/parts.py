"""What one rank holds of the model: its pipeline stages' blocks, the embedding and the head, and how many
micro-batches' activations its schedule keeps at once (`pipeline`). The planner sizes the first and the last
pipeline rank (`pipeline_parts`); the memory test sizes each rank of a real run (`part_of`)."""

from __future__ import annotations

import math

import msgspec

from ..catalog import ModelShape
from .layout import Layout
from .params import layer_params_per_rank
from .pipeline import in_flight, num_stages, stage_layers, stages_of_rank, steady


class Part(msgspec.Struct, frozen=True):
    """What one rank holds of the model, and the most block activations it keeps at once: the whole model
    (pp = 1: every block of one micro-batch), or a pipeline rank's stages under its schedule."""

    emb: bool = True
    head: bool = True
    blocks: float = 0.0  # blocks held
    stage_blocks: float = 0.0  # blocks of its largest stage (what one micro-batch's backward frees)
    in_flight: float = 0.0  # blocks' worth of activations alive at the most (`pipeline.in_flight`)
    outputs: float = 0.0  # stage outputs kept for backward then (one per micro-batch and stage in flight)
    recv: float = 0.0  # the stages' receive buffers, residual-stream sized (`timeline`)
    steady: bool = True  # a backward runs before the rank's last forward (`pipeline.steady`)
    rank: int = 0  # the pipeline rank


def pipeline_parts(shape: ModelShape | None, lay: Layout) -> list[Part]:
    """The ranks to size: everything when pp = 1; else the first pipeline rank (the embedding, the most micro-
    batches in flight) and the last (the head, the logits, the loss). Middle ranks hold no more than the first."""
    if shape is None:
        return [Part()]
    return [part_of(shape, lay, r) for r in sorted({0, lay.pp - 1})]


def part_of(shape: ModelShape, lay: Layout, rank: int) -> Part:
    """What pipeline rank `rank` holds: the runtime's split (`pipeline.stage_layers`) and schedule."""
    if lay.pp == 1:
        return Part(blocks=shape.layers, in_flight=shape.layers)
    stages = num_stages(lay.pp, lay.pp_schedule)
    try:
        counts = stage_layers(shape.layers, stages)
    except ValueError:  # more stages than blocks: refused by validate; size an even split meanwhile
        counts = [math.ceil(shape.layers / stages)] * stages
    ids = stages_of_rank(rank, lay.pp, lay.pp_schedule)
    blocks = {i: float(counts[i]) for i in ids}
    return Part(
        emb=0 in ids,
        head=stages - 1 in ids,
        blocks=sum(blocks.values()),
        stage_blocks=max(blocks.values()),
        in_flight=in_flight(lay.pp_schedule, lay.pp, lay.grad_accum, rank, blocks),
        outputs=in_flight(lay.pp_schedule, lay.pp, lay.grad_accum, rank, {i: 1.0 for i in ids if i != stages - 1}),
        recv=lay.grad_accum * sum((i != 0) + (i != stages - 1) for i in ids),
        steady=steady(lay.pp_schedule, lay.pp, lay.grad_accum, rank),
        rank=rank,
    )


def rank_params(shape: ModelShape | None, arch: str, n_params: float, lay: Layout, part: Part) -> float:
    """Parameters on one rank before data-parallel sharding: its stages' blocks, the embedding and the head
    where it holds them, with tensor parallelism's split (`params.layer_params_per_rank`). A params-only or
    GPT model: an even share, n / (tp x pp)."""
    if shape is None or arch == "gpt" or not part.blocks:
        return n_params / (lay.tp * lay.pp)
    vh = shape.vocab * shape.hidden / lay.tp
    head = (0.0 if shape.tied_embeddings else vh) + shape.hidden
    return (vh if part.emb else 0.0) + part.blocks * layer_params_per_rank(shape, lay.tp) + (head if part.head else 0.0)


WHOLE_MODEL = Part()  # pp = 1 with no shape to count blocks: the embedding, the head and everything between
