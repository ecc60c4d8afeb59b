"""`plan --trace`: run the trace (torch, imported only here and only then) and print it beside the plan."""

from __future__ import annotations


def run(recipe, plan):
    """The plan's Comparison with its trace; TraceError (a user-facing message) when it cannot be traced."""
    from ..plan.memory import CPU_CONTEXT_BYTES, FRAGMENTATION, GPU_CONTEXT_BYTES
    from ..plan.moments import timeline
    from ..trace import trace
    from ..trace.report import compare_plan

    traced = trace(recipe, plan)
    lay = plan.layout
    planned = timeline(
        recipe.model.shape(), recipe.model.architecture, plan.params / (lay.tp * lay.pp), plan.seq_len, lay
    )
    context = GPU_CONTEXT_BYTES if recipe.resources.device().is_gpu else CPU_CONTEXT_BYTES
    return compare_plan(planned, traced, context, FRAGMENTATION, plan.memory.gpu)


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


def print_comparison(c) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    tr = c.traced
    how = (
        f"traced in full ({tr.layers} layers)"
        if tr.exact
        else f"traced at {', '.join(map(str, tr.depths))} layers and extrapolated to {tr.layers}"
        + (f" (third depth {tr.linearity:.2%} off the line)" if tr.linearity is not None else "")
    )
    con.print(
        f"[bold]trace[/]: the runtime's model and wrapping on fake tensors under PyTorch's FSDPMemTracker, "
        f"{how}, {tr.seconds:.1f} s; the second iteration"
    )
    t = Table(title=f"At the peak, GB: trace {c.peak_traced}, planner {c.peak_planned}")
    for col in ("term", "planner", "trace", "planner/trace"):
        t.add_column(col, justify="left" if col == "term" else "right", no_wrap=True)
    flagged_terms = {w.split(":")[0] for w in c.warnings}
    for r in c.rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        style = "bold" if r.term == "total" else ("yellow" if r.term in flagged_terms else None)
        t.add_row(r.term, _gb(r.planned), _gb(r.traced), ratio, style=style)
    con.print(t)
    m = Table(title="Every moment of the step, tensors only, GB")
    for col in ("moment", "planner", "trace", "planner/trace"):
        m.add_column(col, justify="left" if col == "moment" else "right", no_wrap=True)
    for name, p, tv in c.moments:
        m.add_row(
            name, _gb(p), _gb(tv), f"{p / tv:.3f}" if tv else "-", style="bold" if name == c.peak_traced else None
        )
    con.print(m)
    verdict = "fits" if c.fits else "does NOT fit"
    con.print(
        f"by the trace: {_gb(c.traced_total)} GB of tensors + {c.fragmentation:.0%} fragmentation + "
        f"{_gb(c.context)} GB context (which a tensor tracker cannot see) = {_gb(c.projected)} GB of "
        f"{_gb(c.gpu)} GB: {verdict}"
    )
    for w in c.warnings:
        con.print(f"  [yellow]warning:[/] {w}")
    if not c.warnings:
        con.print("  planner and trace agree within 10% on the total and on every term over 5% of it")
