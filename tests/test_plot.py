"""`dtlaunch plot`: the panels, the zero-based throughput axis, and event labels that never overlap."""

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from launcher.cli.plot import LABEL_GID, PlotError, metrics_figure, plot_metrics  # noqa: E402


def _write(path, lines):
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def _step(s, **over):
    rec = {
        "step": s,
        "loss": 6 * math.exp(-s / 80) + 1,
        "lr": 3e-4 * min(1, s / 20),
        "tokens_per_s": 50_000 - (4_000 if 100 <= s < 110 else 0),  # a small dip after the resume
        "grad_norm": None if s % 7 == 0 else 1 + 5 / s,  # null on some rows
        "mfu": 0.4,
    }
    return {**rec, **over}


def _busy_run(tmp_path, **over):
    """200 steps; a checkpoint every 10; a preemption, resumes and a checkpoint at the same and nearby steps."""
    lines = [{"event": "start", "time": 1.0, "world_size": 8}]
    lines += [_step(s, **over) for s in range(1, 201)]
    lines += [{"event": "checkpoint", "step": s, "path": f"ckpt/{s}"} for s in range(10, 201, 10)]
    lines += [
        {"event": "preempt", "step": 100, "signal": "SIGUSR2"},
        {"event": "resume", "step": 100},  # same step as the preemption and a checkpoint: one label
        {"event": "preempt", "step": 104},  # nearby steps: their labels would collide on one row
        {"event": "resume", "step": 104},
        {"event": "resume", "step": 107},
        {"event": "resume", "step": 199},  # at the right edge: its label must stay inside the panel
    ]
    lines += [_step(s, **over) for s in range(100, 121)]  # re-logged after the resume: the later record wins
    return _write(tmp_path / "metrics.jsonl", lines)


@pytest.fixture(scope="module")
def busy(tmp_path_factory):
    """The busy run's figure, drawn (built once: a figure takes most of a second)."""
    fig = metrics_figure(_busy_run(tmp_path_factory.mktemp("busy")))
    fig.canvas.draw()
    return fig


def _ylabels(fig):
    return [ax.get_ylabel() for ax in fig.axes]


def _labels(fig):
    return [t for ax in fig.axes for t in ax.texts if t.get_gid() == LABEL_GID]


def test_panels_share_the_step_axis_in_order(busy):
    fig = busy
    assert _ylabels(fig) == ["loss", "tokens/s", "lr", "grad norm"]
    assert fig.axes[-1].get_xlabel() == "step"
    assert all(ax.get_shared_x_axes().joined(fig.axes[0], ax) for ax in fig.axes)
    assert "loss 6." in fig.axes[0].get_title() and "over 200 steps" in fig.axes[0].get_title()
    # the grad-norm curve skips the null rows rather than drawing them as 0
    (gn,) = fig.axes[3].get_lines()[:1]
    assert 7 not in gn.get_xdata() and min(gn.get_ydata()) > 1


def test_throughput_axis_starts_at_zero(busy):
    fig = busy
    ax = fig.axes[_ylabels(fig).index("tokens/s")]
    lo, hi = ax.get_ylim()
    assert lo == 0 and hi >= 50_000


def test_event_labels_do_not_overlap_and_stay_in_the_panel(busy):
    fig = busy
    labels = _labels(fig)
    texts = sorted(t.get_text() for t in labels)
    # one label per step with a preemption or a resume; events at one step share it, a checkpoint included
    assert texts == [
        "checkpoint, preempt, resume @ 100",
        "preempt, resume @ 104",
        "resume @ 107",
        "resume @ 199",
    ]
    boxes = [t.get_window_extent() for t in labels]
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), (a, b)
    panel = fig.axes[0].get_window_extent()
    for t, b in zip(labels, boxes, strict=True):
        assert panel.x0 <= b.x0 and b.x1 <= panel.x1 and panel.y0 <= b.y0 and b.y1 <= panel.y1, t.get_text()
    # nearby steps were staggered: not all on one row
    assert len({round(b.y1) for b in boxes}) > 1
    # the 20 checkpoints: a line each, counted once in the legend, no label each
    ax = fig.axes[0]
    assert sum(ln.get_linestyle() == ":" for ln in ax.get_lines()) == 20
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["checkpoint (20)", "preempt (2)", "resume (4)"]


def test_many_interruptions_are_labelled_only_as_far_as_they_fit(tmp_path):
    lines = [{"step": s, "loss": 5 - s / 100, "tokens_per_s": 1000} for s in range(1, 201)]
    lines += [{"event": e, "step": s} for s in range(5, 200, 5) for e in ("preempt", "resume")]
    fig = metrics_figure(_write(tmp_path / "metrics.jsonl", lines))
    fig.canvas.draw()
    labels = _labels(fig)
    assert 1 < len(labels) < 39  # some labelled, not all 39
    for a, b in itertools.combinations([t.get_window_extent() for t in labels], 2):
        assert not a.overlaps(b)
    # every event keeps its line on every panel
    assert all(sum(ln.get_color() == "tab:red" for ln in ax.get_lines()) == 39 for ax in fig.axes)
    assert len(fig.axes) == 2


def test_a_metric_without_values_gets_no_panel(tmp_path):
    src = _write(tmp_path / "metrics.jsonl", [_step(s, grad_norm=None) for s in range(1, 50)])
    assert _ylabels(metrics_figure(src)) == ["loss", "tokens/s", "lr"]
    # an older file without the keys at all, and no events: no legend, no labels
    src = _write(tmp_path / "old.jsonl", [{"step": s, "loss": 5 - s / 10} for s in range(1, 20)])
    fig = metrics_figure(src)
    assert _ylabels(fig) == ["loss"] and fig.axes[0].get_legend() is None and not _labels(fig)


def test_png_is_written_and_missing_metrics_are_refused(tmp_path):
    out = plot_metrics(_busy_run(tmp_path))
    assert out == tmp_path / "loss.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(PlotError, match="no metrics"):
        plot_metrics(tmp_path / "nowhere")
    with pytest.raises(PlotError, match="no logged steps"):
        plot_metrics(_write(tmp_path / "e.jsonl", [{"event": "start"}]))


def test_plot_through_the_cli(run_cli, tmp_path):
    _busy_run(tmp_path)
    code, out, err = run_cli("plot", tmp_path / "metrics.jsonl", "-o", tmp_path / "sub" / "x.png")
    assert code == 0, err
    assert f"wrote {tmp_path / 'sub' / 'x.png'}" in out
    assert (tmp_path / "sub" / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "sub" / "x.png").stat().st_size > 10_000


def test_cli_help_does_not_import_matplotlib():
    code = (
        "import sys\nfrom launcher.cli import main\nsys.argv = ['dtlaunch', 'plot', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\nassert 'matplotlib' not in sys.modules\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1]
    )
    assert r.returncode == 0, r.stderr
