"""`dtlaunch plot RUN`: a run's metrics as a PNG, from its metrics.jsonl.

Panels, sharing the step axis: loss, throughput (tokens/s), learning rate and gradient norm; a metric with no
value in the file gets no panel (an empty one would read as "zero"). Restarts append to the same
metrics.jsonl, so a step can appear twice (before a crash and after the resume): the later record wins, and
checkpoint/preempt/resume events are drawn as vertical lines so the reader sees where the run was interrupted.

matplotlib is imported lazily (`--help` and `plan` must not pay for it) and drawn through the Agg canvas
directly, not pyplot: no display is needed on a cluster head node, and no global backend is switched under a
caller that has its own.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DtlaunchError
from ..jobenv import METRICS_FILE, metrics_path, read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.typing import LineStyleType


class PlotError(DtlaunchError):
    """No metrics to plot (a wrong path, or a run that never logged a step): the user's to fix."""


# (record key, y label, colour), top to bottom.
PANELS = (
    ("loss", "loss", "tab:blue"),
    ("tokens_per_s", "tokens/s", "tab:purple"),
    ("lr", "lr", "tab:olive"),
    ("grad_norm", "grad norm", "tab:brown"),
)
# event -> (colour, line style); the events the runtime writes with a step.
EVENT_STYLES: dict[str, tuple[str, LineStyleType]] = {
    "checkpoint": ("tab:green", ":"),
    "preempt": ("tab:red", "-"),
    "resume": ("tab:orange", "--"),
}
LABEL_GID = "event-label"  # the gid of each event's text label, so that callers (and tests) can find them
MAX_LABEL_ROWS = 4  # rows of staggered labels at the top of the loss panel; what does not fit is not labelled
DPI = 100


def _number(v) -> float | None:
    """A plottable value: grad_norm is null when it was not computed, a diverged loss is NaN."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def metrics_figure(run_dir_or_jsonl: str | Path) -> Figure:
    """The figure of a run's metrics (a run directory or its metrics.jsonl), laid out and labelled."""
    src = metrics_path(run_dir_or_jsonl)
    if not src.is_file():
        raise PlotError(
            f"no metrics at {src} (expected RUN_DIR/{METRICS_FILE}); is this a run directory? "
            "`dtlaunch status` lists each job's run directory"
        )
    records = read_metrics(src)
    by_step: dict[int, dict] = {}
    for r in records:
        if "loss" in r and _number(r.get("step")) is not None:
            by_step[int(r["step"])] = r
    if not by_step:
        raise PlotError(f"{src} has no logged steps yet")
    steps = sorted(by_step)
    series = {}
    for key, _, _ in PANELS:
        pts = [(s, v) for s in steps if (v := _number(by_step[s].get(key))) is not None]
        if pts:
            series[key] = pts
    if not series:
        raise PlotError(f"{src} has logged steps but no loss, tokens/s, lr or grad norm values")
    events = [
        (int(r["step"]), r["event"])
        for r in records
        if r.get("event") in EVENT_STYLES and _number(r.get("step")) is not None
    ]

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [p for p in PANELS if p[0] in series]
    ratios = [2.5 if key == "loss" else 1.2 for key, _, _ in panels]
    fig = Figure(figsize=(9, 0.9 + 1.5 * sum(ratios)), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": ratios})[:, 0]
    for ax, (key, ylabel, color) in zip(axes, panels, strict=True):
        xs, ys = zip(*series[key], strict=True)
        ax.plot(xs, ys, color=color, linewidth=1.2 if key == "loss" else 1, zorder=3)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if key == "tokens_per_s":
            # from 0, so that a dip of a few percent (a checkpoint save, a slow node) does not look like a collapse
            ax.set_ylim(0, max(ys) * 1.08 or 1)
        for step, name in events:
            color_e, ls = EVENT_STYLES[name]
            faint = name == "checkpoint"  # possibly hundreds of them: behind the curves, light
            ax.axvline(step, color=color_e, linestyle=ls, linewidth=0.8, alpha=0.45 if faint else 0.9, zorder=1)
    axes[-1].set_xlabel("step")
    top = axes[0]
    if "loss" in series:
        l0, l1 = series["loss"][0][1], series["loss"][-1][1]
        top.set_title(f"{src.parent.name}: loss {l0:.3f} -> {l1:.3f} over {steps[-1]} steps")
    else:
        top.set_title(f"{src.parent.name}: {steps[-1]} steps")
    _legend(top, events)
    # Labels are placed in pixels, so the layout must be final before they are measured.
    fig.tight_layout()
    _label_events(fig, top, events)
    return fig


def _legend(ax: Axes, events: list[tuple[int, str]]) -> None:
    from matplotlib.lines import Line2D

    handles = []
    for name, (color, ls) in EVENT_STYLES.items():
        n = sum(e == name for _, e in events)
        if n:
            handles.append(Line2D([], [], color=color, linestyle=ls, linewidth=1, label=f"{name} ({n})"))
    if handles:
        # lower left: a loss curve falls from the upper left, and the event labels sit along the top
        ax.legend(handles=handles, loc="lower left", fontsize=8, framealpha=0.85)


def _label_events(fig: Figure, ax: Axes, events: list[tuple[int, str]]) -> None:
    """A text label per step with a preemption or a resume, along the top of `ax`, never overlapping.

    Checkpoints alone get no label (there can be hundreds; the legend counts them), but one at the same step
    as a labelled event is named in its label. Events at one step share a label ("preempt, resume @ 40");
    labels of nearby steps are staggered into rows, each placed in the first row where it overlaps nothing,
    measured in pixels; one that fits in no row is left out (its line stays).
    """
    at: dict[int, list[str]] = {}
    for step, name in events:
        if name not in at.setdefault(step, []):
            at[step].append(name)
    labelled = sorted(s for s, names in at.items() if any(n != "checkpoint" for n in names))
    if not labelled:
        return
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    assert isinstance(fig.canvas, FigureCanvasAgg)  # metrics_figure draws on Agg: it can measure text
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    pad, gap = 3.0, 6.0  # pixels: from the line to its label; between two labels of a row
    rows: list[list[tuple[float, float]]] = [[] for _ in range(MAX_LABEL_ROWS)]
    for step in labelled:
        names = sorted(at[step], key=list(EVENT_STYLES).index)
        t = ax.text(
            0,
            1,
            f"{', '.join(names)} @ {step}",
            transform=ax.transAxes,
            fontsize=8,
            va="top",
            color=EVENT_STYLES[names[-1]][0],
            bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
            zorder=5,
            gid=LABEL_GID,
        )
        ext = t.get_window_extent(renderer)
        w, h = ext.width, ext.height
        x = ax.transData.transform((step, 0))[0]
        # right of its line, or left of it where it would run out of the panel
        x0 = x + pad if x + pad + w <= box.x1 else max(box.x0, x - pad - w)
        span = (x0 - gap / 2, x0 + w + gap / 2)
        row = next((i for i, r in enumerate(rows) if all(span[1] <= a or b <= span[0] for a, b in r)), None)
        y_top = box.y1 - pad - (row or 0) * (h + 2 * pad)
        if row is None or y_top - h < box.y0:
            t.remove()
            continue
        rows[row].append(span)
        t.set_position(((x0 - box.x0) / box.width, (y_top - box.y0) / box.height))


def _write(fig: Figure, run_dir_or_jsonl: str | Path, out_png: str | Path | None, name: str) -> Path:
    """Save `fig` to `out_png` (default: `name` next to the run's metrics.jsonl)."""
    out = Path(out_png) if out_png else metrics_path(run_dir_or_jsonl).with_name(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out


def plot_metrics(run_dir_or_jsonl: str | Path, out_png: str | Path | None = None) -> Path:
    """Write the metrics figure to `out_png` (default: next to metrics.jsonl, loss.png)."""
    return _write(metrics_figure(run_dir_or_jsonl), run_dir_or_jsonl, out_png, "loss.png")


# the goodput ledger's causes (runtime/goodput.py), left to right: useful first; the queue is not allocated time
GOODPUT_COLOURS = {
    "useful": "tab:green",
    "preflight": "tab:gray",
    "startup": "tab:blue",
    "checkpoint": "tab:cyan",
    "lost": "tab:red",
    "ending": "tab:purple",
    "recovery": "tab:orange",
}
GOODPUT_GID = "goodput-cause"  # the gid of each cause's bar, so that callers (and tests) can find them


def goodput_figure(run_dir: str | Path) -> Figure:
    """One bar of the run's allocated time, split by cause (`status --goodput`'s ledger), goodput in the title."""
    from ..runtime.goodput import CAUSES, ledger

    src = metrics_path(run_dir)
    if not src.is_file():
        raise PlotError(f"no metrics at {src} (expected RUN_DIR/{METRICS_FILE}); is this a run directory?")
    led = ledger(read_metrics(src))
    if led["allocated"] <= 0:
        raise PlotError(f"{src} has no attempt with any time in it yet")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 2.4), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    names = dict(CAUSES)
    left = 0.0
    for key, colour in GOODPUT_COLOURS.items():
        width = led[key]
        if width <= 0:
            continue
        (bar,) = ax.barh([0], [width], left=left, color=colour, label=names[key])
        bar.set_gid(GOODPUT_GID)
        left += width
    ax.set_yticks([])
    ax.set_xlabel("allocated seconds (the queue between allocations left out)")
    ax.set_title(f"goodput {led['goodput']:.1%}: useful training / allocated time")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=3, fontsize="small", frameon=False)
    fig.tight_layout()
    return fig


def plot_goodput(run_dir: str | Path, out_png: str | Path | None = None) -> Path:
    """Write the goodput figure to `out_png` (default: RUN/goodput.png)."""
    return _write(goodput_figure(run_dir), run_dir, out_png, "goodput.png")
