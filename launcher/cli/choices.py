"""`dtlaunch plan` with SkyPilot accelerator fallbacks: one row per accelerator the task may land on."""

from __future__ import annotations


def choices_json(recipe, plan) -> list[dict]:
    from ..plan.choices import plan_choices

    ch = plan_choices(recipe, plan)
    order = [c.accelerator for c in ch.kept]
    return [
        {
            "accelerator": c.accelerator,
            "memory_gb": c.device.memory_gb,
            "own_strategy": c.own.strategy,
            "own_memory_gb": round(c.own.memory.total / 1e9, 2),
            "fits": c.own.memory.fits,
            "dropped": c.dropped,
            "shipped": c.accelerator == ch.basis,
            "rank": order.index(c.accelerator) + 1 if c.accelerator in order else None,
            "step_seconds": c.step_seconds,
            "usd": None if c.usd is None else round(c.usd, 2),
        }
        for c in ch.choices
    ]


def print_choices(recipe, plan) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..plan.choices import plan_choices

    ch = plan_choices(recipe, plan)
    order = [c.accelerator for c in ch.kept]
    t = Table(
        title=f"SkyPilot accelerators ({recipe.targets.sky.fallback}); the job ships the layout planned for "
        f"{ch.basis} ({ch.shipped.strategy}, {ch.shipped.memory.total / 1e9:.1f} GB per device)"
    )
    for col in ("#", "accelerator", "GB/device", "own plan", "needs GB", "fits", "s/step", "total cost"):
        t.add_column(col, justify="left" if col in ("accelerator", "own plan", "fits") else "right", no_wrap=True)
    for c in ch.choices:
        rank = str(order.index(c.accelerator) + 1) if c.accelerator in order else "-"
        t.add_row(
            rank,
            c.accelerator,
            f"{c.device.memory_gb:g}",
            c.own.strategy,
            f"{c.own.memory.total / 1e9:.1f}",
            "yes" if c.own.memory.fits else "no",
            "-" if c.step_seconds is None else f"{c.step_seconds:.3g}",
            "-" if c.usd is None else f"${c.usd:,.0f}",
            style="dim" if c.dropped else None,
        )
    con = Console()
    con.print(t)
    con.print("# = the order the task asks for them (s/step and cost: the shipped layout on that device)")
    for n in ch.notes:
        con.print(f"  [yellow]note:[/] {n}")
