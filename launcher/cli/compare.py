"""`plan --compare deepspeed`: DeepSpeed's own model-state estimators beside the planner's figures.

DeepSpeed ships `estimate_zero2_model_states_mem_needs_all_cold` and `estimate_zero3_..._all_cold`, which print
per-GPU and per-CPU memory of the model states for a parameter count and a cluster. This prints exactly what
they print, then the same layout term by term in the planner's unit (GB = 1e9 bytes; DeepSpeed divides by 2**30
and labels it GB), each difference with its reason. DeepSpeed (and torch) are imported here only, and only
for this flag.
"""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import dataclass

from ..errors import DtlaunchError
from ..jobenv import GB

GIB = 2**30


class CompareError(DtlaunchError):
    """The comparison cannot be made (DeepSpeed missing, or a plan DeepSpeed's estimators do not cover)."""


@dataclass
class Row:
    term: str
    ours: float  # bytes per GPU
    deepspeed: float  # bytes per GPU
    why: str  # why they differ ("" when they agree)


@dataclass
class Comparison:
    version: str
    printed: str  # the estimator's own output, verbatim
    function: str
    args: dict
    layout: str
    rows: list[Row]
    deepspeed_cpu: float  # bytes per node, DeepSpeed's figure for host memory
    notes: list[str]

    def to_dict(self) -> dict:
        return {
            "deepspeed_version": self.version,
            "function": self.function,
            "arguments": self.args,
            "printed": self.printed,
            "layout": self.layout,
            "deepspeed_cpu_bytes_per_node": int(self.deepspeed_cpu),
            "rows": [
                {
                    "term": r.term,
                    "dtlaunch_bytes": int(round(r.ours)),
                    "deepspeed_bytes": int(round(r.deepspeed)),
                    "why": r.why,
                }
                for r in self.rows
            ],
            "notes": list(self.notes),
        }


def _deepspeed():
    """DeepSpeed's ZeRO estimator modules, or a CompareError saying how to install it.

    Any failure to import counts, not only ImportError: a DeepSpeed built against another torch raises
    whatever its extension loader raises, and the user needs the same advice either way."""
    try:
        # DeepSpeed's logger writes to the stdout it finds at import: send it to stderr, where `plan --json`'s
        # readers do not look.
        from ..runtime.engines.deepspeed import name_the_accelerator

        # its estimators are arithmetic on the host: no GPU is used, and DeepSpeed need not guess one (and warn)
        name_the_accelerator(is_gpu=False)
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed
            from deepspeed.runtime.zero import stage3, stage_1_and_2
    except Exception as e:  # noqa: BLE001 - reported as one line with the fix, never as a traceback
        raise CompareError(
            f"--compare deepspeed needs DeepSpeed, which is not importable here ({type(e).__name__}: {e})",
            fix="pip install 'dtlaunch[deepspeed]' (DeepSpeed builds against the installed torch: "
            "pip install torch first, then pip install --no-build-isolation deepspeed)",
        ) from None
    import logging

    for h in logging.getLogger("DeepSpeed").handlers:  # its later warnings too
        if type(h) is logging.StreamHandler:  # DeepSpeed's own (not a log-capturing subclass of a test harness)
            h.stream = _Stderr()  # not setStream: it flushes the old stream, which may be closed
    return deepspeed.__version__, stage_1_and_2, stage3


class _Stderr:
    """Whatever `sys.stderr` is at the time of writing (a handler keeps the stream object it was given)."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


def largest_module_params(shape) -> int:
    """What DeepSpeed's `_all_live` estimators call the largest layer: the most parameters any one module owns
    itself (an embedding, the output head or one projection), here from the shape."""
    if shape is None:
        return 0
    kv = shape.hidden // shape.heads * shape.kv_heads
    return max(
        shape.vocab * shape.hidden, shape.hidden * shape.ffn_hidden, shape.hidden * shape.hidden, shape.hidden * kv
    )


def compare(recipe, plan) -> Comparison:
    from ..plan.moments import units, zero3_gathered
    from ..plan.states import deepspeed_step_fp32_grads, states
    from ..strategies import spec

    lay = plan.layout
    sp = spec(lay.strategy)
    stage = sp.zero_stage
    if stage is None:
        raise CompareError(
            f"the plan uses {lay.strategy}; DeepSpeed's estimators cover ZeRO-2 and ZeRO-3",
            fix="compare a ZeRO plan: --set parallelism.strategy=zero3 (or zero1, zero2)",
        )
    if lay.tp * lay.pp > 1:
        raise CompareError(
            f"the plan combines {lay.strategy} with tensor {lay.tp} x pipeline {lay.pp}; DeepSpeed's "
            "estimators (and dtlaunch's DeepSpeed runtime) cover data parallelism only",
            fix="--set parallelism.tensor=1 --set parallelism.pipeline=1",
        )
    version, z12, z3 = _deepspeed()
    shape = recipe.model.shape()
    n = plan.params
    d = plan.world_size  # DeepSpeed's estimators shard over every GPU of the cluster
    per_node, nodes = plan.gpus_per_node, plan.nodes
    offload_opt = lay.offload in ("optimizer", "params")
    offload_par = lay.offload == "params"
    w = 2 if lay.precision in ("bf16", "fp16") else 4
    st = states(n, lay)
    notes = [
        f"DeepSpeed's estimators count model states only (16-bit weights and gradients, fp32 master weights, "
        f"Adam's moments); the planner's per-GPU total ({plan.memory.total / GB:.1f} GB) also holds activations, "
        f"buffers, the CUDA context and fragmentation.",
        "DeepSpeed prints GiB (2**30 bytes) labelled GB; the table above gives both columns in GB = 1e9 bytes.",
    ]
    if w != 2:
        notes.append(f"DeepSpeed's estimators assume 16-bit weights; this plan trains in {lay.precision}.")

    printed = io.StringIO()
    rows: list[Row] = []
    if stage == 3:
        big = largest_module_params(shape) or n / 40
        args = {
            "total_params": int(n),
            "largest_layer_params": int(big),
            "num_gpus_per_node": per_node,
            "num_nodes": nodes,
        }
        with contextlib.redirect_stdout(printed):
            z3.estimate_zero3_model_states_mem_needs_all_cold(**args)
        cpu, gpu, layer = z3.estimate_zero3_model_states_mem_needs(
            total_params=int(n),
            largest_layer_params=int(big),
            num_gpus_per_node=per_node,
            num_nodes=nodes,
            cpu_offload=offload_opt,
            cpu_offload_params=offload_par,
            zero_init=True,
        )
        function = "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold"
        ds_params = 0.0 if offload_par else 2 * n / d
        ds_grads = 0.0 if offload_opt else 2 * n / d
        ds_fp32g = 0.0 if offload_opt else 4 * n / d
        ds_optim = 0.0 if offload_opt else 12 * n / d
        u = units(shape, recipe.model.architecture, n, lay)
        unit = max(u.layer, u.emb, u.head, u.root)
        rows.append(Row("16-bit weights (partition)", st.params, ds_params, ""))
        gathered = zero3_gathered(u, w)
        rows.append(
            Row(
                "gathered layer",
                gathered,
                layer,
                f"DeepSpeed: the largest single module ({big / 1e6:.0f}M params) with its 16-bit weight and "
                f"gradient, 4 bytes/param; dtlaunch: a whole block ({unit / 1e6:.0f}M params), in use and "
                f"prefetched (2 x {w} bytes) plus its fp32 gradient (4 bytes)",
            )
        )
    else:
        args = {"total_params": int(n), "num_gpus_per_node": per_node, "num_nodes": nodes}
        with contextlib.redirect_stdout(printed):
            z12.estimate_zero2_model_states_mem_needs_all_cold(**args)
        cpu, gpu = z12.estimate_zero2_model_states_mem_needs(
            total_params=int(n), num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=offload_opt
        )
        function = "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold"
        ds_params = 2 * n
        ds_grads = 0.0 if offload_opt else 2 * n / d
        ds_fp32g = 0.0 if offload_opt else 4 * n / d
        ds_optim = 0.0 if offload_opt else 12 * n / d
        rows.append(Row("16-bit weights", st.params, ds_params, ""))
        if stage == 1:
            notes.append(
                "DeepSpeed has no ZeRO-1 estimator; its ZeRO-2 one is used (ZeRO-1 keeps every rank's gradients whole)."
            )
    grads_why = ""
    if stage == 1 and not offload_opt:
        grads_why = "ZeRO-1 keeps each rank's 16-bit gradients whole; DeepSpeed's ZeRO-2 estimator shards them"
    rows.append(Row("16-bit gradients", st.grads, ds_grads, grads_why))
    fp32 = deepspeed_step_fp32_grads(n, lay)
    fp32_why = ""
    if ds_fp32g:
        fp32_why = (
            "DeepSpeed counts it for the whole step; it exists only in the optimizer step (built from the "
            "reduced 16-bit gradients, deleted after the update), where dtlaunch counts it"
        )
        if fp32 < ds_fp32g - 1:
            fp32_why += "; ZeRO-3 builds it one sub-group (1e9 elements) at a time"
    rows.append(Row("fp32 gradients (optimizer step)", fp32, ds_fp32g, fp32_why))
    rows.append(
        Row(
            "fp32 weights + Adam moments",
            st.optimizer,
            ds_optim,
            ""
            if abs(st.optimizer - ds_optim) < 1
            else f"{lay.optimizer} here; DeepSpeed's estimators assume Adam (12 bytes/param)",
        )
    )
    for r in rows:
        if not r.why and abs(r.ours - r.deepspeed) >= 0.005 * GB:
            r.why = (
                f"{lay.precision} training: 4-byte weights and gradients, no separate fp32 master copy; "
                "DeepSpeed's estimators assume 16-bit ones"
                if w == 4
                else f"dtlaunch's formula for {lay.strategy} with offload={lay.offload} (launcher/plan/states.py, "
                "model_states) differs from DeepSpeed's here"
            )
    ours = sum(r.ours for r in rows)
    total_why = "the differences of the lines above" if abs(ours - gpu) >= 0.005 * GB else ""
    rows.append(Row("model states per GPU", ours, gpu, total_why))
    if offload_opt:
        notes.append(
            "optimizer offload: as in DeepSpeed's estimate and the ZeRO-Offload paper, only the 16-bit "
            "weights stay on the GPU; gradients and optimizer state live in host memory."
        )
    layout = (
        f"{lay.strategy} (ZeRO-{stage}), offload={lay.offload}, {plan.world_size} GPUs "
        f"({nodes} node(s) x {per_node}), {lay.precision}"
    )
    return Comparison(version, printed.getvalue().rstrip(), function, args, layout, rows, float(cpu), notes)


def _gb(b: float | None) -> str:
    return "-" if b is None else f"{b / GB:.2f}"


def print_comparison(c: Comparison) -> None:
    """Plain lines, not a table: each reason stays on one line however narrow the terminal."""
    import click

    args = ", ".join(f"{k}={v}" for k, v in c.args.items())
    click.echo(f"\nDeepSpeed {c.version}, {c.function}({args}), as it prints it (its GB are GiB, 2**30 bytes):")
    click.echo(c.printed)
    click.echo(f"\nModel states per GPU in GB (1e9 bytes), {c.layout}:")
    width = max(len(r.term) for r in c.rows)
    click.echo(f"  {'term':{width}s}  {'dtlaunch':>9s}  {'DeepSpeed':>9s}")
    for r in c.rows:
        click.echo(
            f"  {r.term:{width}s}  {_gb(r.ours):>9s}  {_gb(r.deepspeed):>9s}  {'why: ' + r.why if r.why else 'same'}"
        )
    click.echo(
        f"DeepSpeed's host memory for this layout: {c.deepspeed_cpu / GB:.1f} GB per node "
        f"({c.deepspeed_cpu / GIB:.1f} GiB); dtlaunch does not plan host memory."
    )
    for n in c.notes:
        click.echo(f"  note: {n}")
