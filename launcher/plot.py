"""`dtlaunch plot RUN`: the loss curve of a run as a PNG, from its metrics.jsonl.

Restarts append to the same metrics.jsonl, so a step can appear twice (before a crash and after the
resume): the later record wins, and resume/checkpoint/preempt events are drawn as markers so the
reader sees where the run was interrupted. matplotlib is imported lazily with the Agg backend (no
display needed on a cluster head node).
"""

from __future__ import annotations

from pathlib import Path

from .errors import DtlaunchError
from .jobenv import METRICS_FILE, metrics_path, read_metrics


class PlotError(DtlaunchError):
    """No metrics to plot (a wrong path, or a run that never logged a step): the user's to fix."""


def plot_metrics(run_dir_or_jsonl: str | Path, out_png: str | Path | None = None) -> Path:
    """Write the loss curve (and tokens/s) to `out_png` (default: next to metrics.jsonl, loss.png)."""
    src = metrics_path(run_dir_or_jsonl)
    if not src.is_file():
        raise PlotError(
            f"no metrics at {src} (expected RUN_DIR/{METRICS_FILE}); is this a run directory? "
            "`dtlaunch status` lists each job's run directory"
        )
    records = read_metrics(src)
    by_step: dict[int, dict] = {}
    for r in records:
        if "loss" in r and "step" in r:
            by_step[int(r["step"])] = r
    if not by_step:
        raise PlotError(f"{src} has no logged steps yet")
    events = [
        r
        for r in records
        if "event" in r and r.get("step") is not None and r["event"] in ("resume", "checkpoint", "preempt")
    ]
    if sum(e["event"] == "checkpoint" for e in events) > 40:  # dense checkpoints would hide the curve
        events = [e for e in events if e["event"] != "checkpoint"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(by_step)
    losses = [by_step[s]["loss"] for s in steps]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(steps, losses, color="tab:blue", linewidth=1.5, label="loss")
    styles = {"checkpoint": ("tab:green", ":"), "resume": ("tab:orange", "--"), "preempt": ("tab:red", "-")}
    seen = set()
    for e in events:
        color, ls = styles[e["event"]]
        ax.axvline(
            e["step"], color=color, linestyle=ls, linewidth=1, label=e["event"] if e["event"] not in seen else None
        )
        seen.add(e["event"])
    ax.set_ylabel("loss")
    ax.set_title(f"{src.parent.name}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps[-1]} steps")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    tps = [by_step[s].get("tokens_per_s") or 0 for s in steps]
    ax2.plot(steps, tps, color="tab:purple", linewidth=1)
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_png) if out_png else src.with_name("loss.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
