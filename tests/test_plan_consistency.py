"""A plan never contradicts itself (issue 30, item 5): what `why:` says fits is what memory.total says, the table's
chosen row is the plan's figure, the batch line is true arithmetic, and validate finds nothing in a fitting plan
that `strategy: auto` could have avoided. Planner-only and fast: a few hundred plans in about a second."""

from __future__ import annotations

import itertools
import math
import re

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.plan import make_plan
from launcher.recipe import load
from launcher.validate import validate
from testpaths import RECIPES

LLAMA70B = str(RECIPES / "llama70b.yaml")  # Llama 3 70B, 8 nodes x 8 H100, global_batch 512
# The figure each verdict in `why:` states for the layout it ends on: "X fits: 12.3 GB", "... that fits (12.3 GB)",
# "nothing fits: the smallest layout tried, X, needs 12.3 GB"
VERDICT = re.compile(r"(nothing fits: the smallest layout tried, .*, needs|fits:|that fits \()\s*(\d+\.\d) GB")


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f}"


def _variant(base, mb: int, seq: int, ac: str, sp: bool | None):
    par = base.parallelism.replace(activation_checkpointing=ac)
    if sp is not None:  # written by the recipe; None leaves it to `auto`
        par = par.replace(sequence_parallel=sp)
    return base.replace(
        model=base.model.replace(seq_len=seq), training=base.training.replace(micro_batch=mb), parallelism=par
    )


def _inconsistencies(r, p) -> list[str]:
    """Every way the plan contradicts itself or validate, as text (empty: consistent)."""
    out = []
    m, lay = p.memory, p.layout
    if m.fits != (m.total <= m.gpu):
        out.append(f"fits {m.fits} but total {_gb(m.total)} of {_gb(m.gpu)}")
    if dict(p.candidates)[p.strategy].total != m.total:
        out.append(f"table row {_gb(dict(p.candidates)[p.strategy].total)} != total {_gb(m.total)}")
    verdicts = [v for reason in p.reasons for v in VERDICT.findall(reason)]
    if not verdicts:
        out.append("no verdict in why:")
    else:
        kind, figure = verdicts[-1]
        if figure != _gb(m.total):
            out.append(f"why: says {figure} GB, total {_gb(m.total)}")
        if kind.startswith("nothing") == m.fits:
            out.append(f"why: says {kind!r} but fits is {m.fits}")
    # sized at the grad_accum the job will run: global / (micro x dp) at the chosen degrees
    if lay.grad_accum != math.ceil(r.training.global_batch / (lay.micro_batch * lay.dp)):
        out.append(f"grad_accum {lay.grad_accum} is not the one of dp {lay.dp}")
    errors = {f.rule for f in validate(r, p) if f.severity == "error"}
    if "pipeline-schedule" in errors:
        out.append("auto chose a pipeline its schedule cannot run")
    if m.fits and "does-not-fit" in errors:
        out.append("validate says it does not fit")
    return out


def test_plans_over_a_sweep_never_contradict_themselves():
    """micro_batch x seq_len x activation checkpointing x sequence parallelism (auto's or off) for Llama 3 70B on
    8 x 8 H100: 336 plans. Before `auto` sized each tensor/pipeline degree at its own grad_accum, 174 of the 256
    with sequence parallelism off said `fits: X GB` (or 'nothing fits ... needs X') with an X that was not the
    plan's total, e.g. 72.5 GB against 411.4."""
    base = load(LLAMA70B)
    bad, n = [], 0
    for mb, seq, ac, sp in itertools.product(
        [1, 2, 3, 4, 8, 16],
        [2048, 4096, 8192, 12288, 16384, 24576, 32768],
        ["auto", "none", "selective", "full"],
        [None, False],
    ):
        r = _variant(base, mb, seq, ac, sp)
        p = make_plan(r)
        n += 1
        bad += [f"mb {mb} seq {seq} ac {ac} sp {sp}: {x}" for x in _inconsistencies(r, p)]
    assert n == 336
    assert not bad, f"{len(bad)} inconsistencies, e.g. {bad[:5]}"


def test_a_pipeline_is_sized_at_the_micro_batches_it_keeps_in_flight():
    """The review's reproducer (with sequence parallelism off, as the search then had it): fsdp tp8 pp8 with params
    offload was sized at the grad_accum of tp1 pp1 (4) and said 'fits: 72.5 GB', while at its own (256) the plan's
    total was 411.4 GB. Sized as it runs, nothing fits; the plan says so, with the smallest layout."""
    r = load(LLAMA70B, ["training.micro_batch=2", "model.seq_len=32768", "parallelism.sequence_parallel=false"])
    p = make_plan(r)
    assert not p.memory.fits
    assert p.reasons[-1].startswith("nothing fits: the smallest layout tried")
    assert f"needs {_gb(p.memory.total)} GB" in p.reasons[-1]
    assert not any(re.search(r"(?<!nothing) fits: ", reason) for reason in p.reasons)
    assert dict(p.candidates)[p.strategy].total == p.memory.total
    # the smallest is the one with the fewest micro-batches in flight: no pipeline
    assert (p.layout.tp, p.layout.pp) == (8, 1) and p.grad_accum == 512 // (2 * p.layout.dp)
    # with sequence parallelism left to `auto` (the shipped recipe), the same job fits
    q = make_plan(load(LLAMA70B, ["training.micro_batch=2", "model.seq_len=32768"]))
    assert q.memory.fits and q.layout.sequence_parallel and q.layout.tp == 8
    assert not _inconsistencies(load(LLAMA70B, ["training.micro_batch=2", "model.seq_len=32768"]), q)


def test_an_indivisible_global_batch_is_said_not_multiplied_out_falsely():
    """micro 3 x dp 64 x grad_accum 3 is 576, not the recipe's 512: `plan` says so, in validate's words, and
    exits 1 as validate does."""
    res = CliRunner().invoke(cli, ["plan", LLAMA70B, "--set", "training.micro_batch=3"])
    assert res.exit_code == 1, res.output
    assert "error [batch-divisible]" in res.output and "validate refuses this recipe" in res.output
    batch = next(line for line in res.output.splitlines() if line.startswith("batch:"))
    assert "= global 512" not in batch
    assert "micro 3 x dp 64 x grad_accum 3 = 576 sequences per step, not the recipe's global_batch 512" in batch
    r = load(LLAMA70B, ["training.micro_batch=3"])
    p = make_plan(r)
    (finding,) = [f for f in validate(r, p) if f.rule == "batch-divisible"]
    assert any(note.startswith(finding.message) for note in p.notes)
    assert finding.message in res.output
    # a batch that splits prints as before
    ok = CliRunner().invoke(cli, ["plan", LLAMA70B])
    assert "batch: micro 1 x dp 64 x grad_accum 8 = global 512 sequences" in ok.output


@pytest.mark.parametrize(
    "sets, blames, not_in_fix",
    [
        # auto with sequence parallelism forbidden: nothing fits, activations dominate; the fix must not say "use auto"
        (
            ["training.micro_batch=2", "model.seq_len=32768", "parallelism.sequence_parallel=false"],
            "the activations take the most",
            "use strategy: auto",
        ),
        # DDP's full copies, where they are the reason
        (["parallelism.strategy=ddp"], "DDP keeps a full copy", None),
    ],
)
def test_does_not_fit_names_what_takes_the_memory(sets, blames, not_in_fix):
    r = load(LLAMA70B, sets)
    p = make_plan(r)
    (f,) = [f for f in validate(r, p) if f.rule == "does-not-fit"]
    assert blames in f.message and f"needs {_gb(p.memory.total)} GB" in f.message
    if not_in_fix:
        assert not_in_fix not in f.fix and "DDP" not in f.message
        assert "sequence_parallel: true" in f.fix  # what the recipe kept from the search
