"""`status`, `logs`, `down` and `plot`: following a job after `up`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import DtlaunchError
from ..jobenv import last_logged_step

# States in which a job still runs (or waits to), on any target: `down NAME` acts on such a job.
LIVE = frozenset(
    {
        "RUNNING",
        "STOPPING",
        "PENDING",
        "CONFIGURING",
        "COMPLETING",
        "REQUEUED",
        "RESIZING",
        "SUSPENDED",
        "INIT",
        "STARTING",
        "SETTING_UP",
        "RECOVERING",
        "CANCELLING",
        "SUBMITTED",
    }
)


def status_rows(recs) -> list[dict]:
    """`status`'s rows. One backend per target, so the local one scans the process table once for all rows,
    and each run directory's newest step is read once."""
    from ..targets import JobStatus, backend

    backends, steps, rows = {}, {}, []
    for r in recs:
        try:
            if r.target not in backends:
                backends[r.target] = backend(r.target)
            st = backends[r.target].status(r)
        except DtlaunchError as e:
            st = JobStatus("UNKNOWN", detail=str(e))
        if r.run_dir not in steps:
            steps[r.run_dir] = last_logged_step(r.run_dir) if r.run_dir and Path(r.run_dir).is_dir() else None
        rows.append(
            {
                "name": r.name,
                "target": r.target,
                "job_id": r.job_id,
                "run_dir": r.run_dir,
                **st.to_dict(),
                "last_step": steps[r.run_dir],
            }
        )
    return rows


@click.command("status")
@click.argument("job", required=False)
@click.option("--json", "as_json", is_flag=True)
def status_cmd(job, as_json):
    """Show the state of one job (by name or id), or of all recorded jobs."""
    from ..targets.registry import Registry

    reg = Registry()
    rows = status_rows([reg.find(job)] if job else reg.all())
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no jobs recorded yet (dtlaunch up RECIPE)")
    for row in rows:
        extra = f" exit={row['exit_code']}" if row.get("exit_code") is not None else ""
        detail = f" ({row['detail']})" if row.get("detail") else ""
        progress = f"\t{describe_step(row['last_step'])}" if row.get("last_step") else ""
        click.echo(
            f"{row['name']}\t{row['target']}:{row['job_id']}\t{row['state']}{extra}{detail}\t{row['run_dir']}{progress}"
        )


def describe_step(rec: dict) -> str:
    """The newest logged step as `status` shows it: step, loss, throughput, MFU, memory (the maximum over ranks)."""
    parts = [f"step {rec['step']}", f"loss {rec['loss']:.4f}" if isinstance(rec.get("loss"), (int, float)) else ""]
    if rec.get("tokens_per_s"):
        tps = rec["tokens_per_s"]
        parts.append(f"{tps / 1e3:.1f}k tok/s" if tps >= 1e3 else f"{tps:.0f} tok/s")
    if rec.get("mfu") is not None:
        parts.append(f"mfu {rec['mfu']:.1%}")
    where = f" (rank {rec['peak_rank']})" if rec.get("peak_rank") is not None else ""
    if rec.get("reserved_peak_mb") is not None:
        parts.append(f"mem {rec['active_peak_mb'] / 1024:.1f}/{rec['reserved_peak_mb'] / 1024:.1f} GiB{where}")
        if rec.get("alloc_retries"):
            parts.append(f"alloc retries {rec['alloc_retries']:.0f}")
        if rec.get("ooms"):
            parts.append(f"OOMs {rec['ooms']:.0f}")
    elif rec.get("host_rss_mb") is not None:
        parts.append(f"rss {rec['host_rss_mb']:.0f} MB{where}")
    return " | ".join(p for p in parts if p)


@click.command("logs")
@click.argument("job")
@click.option("-f", "--follow", is_flag=True, help="Keep streaming until the job ends.")
def logs_cmd(job, follow):
    """Print a job's output."""
    from ..targets import backend
    from ..targets.registry import Registry

    rec = Registry().find(job)
    try:
        for line in backend(rec.target).logs(rec, follow=follow):
            click.echo(line, nl=False)
    except KeyboardInterrupt:
        pass


@click.command("down")
@click.argument("job")
def down_cmd(job):
    """Stop a job: SIGTERM first, so it checkpoints; what does not stop in time is killed."""
    from ..targets import backend
    from ..targets.registry import Registry

    rec = running_one(Registry().matching(job), job)
    click.echo(backend(rec.target).cancel(rec))


def running_one(hits: list, key: str):
    """Of the jobs `key` names (oldest first), the one still running; the newest if none is. A name used again
    (a loser of two racing `up`, an older run elsewhere) must not hide the live job behind a newer dead one."""
    from ..targets import backend

    if len(hits) == 1:
        return hits[0]
    backends, live = {}, []
    for r in hits:
        try:
            if r.target not in backends:  # one per target: the local one scans the process table once
                backends[r.target] = backend(r.target)
            if backends[r.target].status(r).state in LIVE:
                live.append(r)
        except DtlaunchError:
            continue
    if len(live) > 1:
        ids = ", ".join(f"{r.target}:{r.job_id} ({r.run_dir})" for r in live)
        raise DtlaunchError(
            f"{len(live)} jobs named {key!r} are running: {ids}",
            fix=f"name one by its id, e.g. `dtlaunch down {live[-1].job_id}`",
        )
    return live[0] if live else hits[-1]


@click.command("plot")
@click.argument("run")
@click.option("-o", "--out", "out_png", default=None, help="PNG path (default: RUN/loss.png).")
def plot_cmd(run, out_png):
    """Draw the loss curve of a run directory (or its metrics.jsonl) as a PNG."""
    run_path = Path(run)
    if not run_path.exists():
        from ..targets.registry import Registry

        run_path = Path(Registry().find(run).run_dir)
    try:
        from ..plot import plot_metrics
    except ImportError as e:
        raise DtlaunchError(f"plotting needs matplotlib ({e})", fix="pip install 'dtlaunch[train]'") from None
    out = out_png or str((run_path if run_path.is_dir() else run_path.parent) / "loss.png")
    try:
        plot_metrics(str(run_path), out)
    except OSError as e:
        raise DtlaunchError(f"cannot write {out}: {e.strerror}", fix="pass -o with a writable path") from None
    click.echo(f"wrote {out}")


def register(cli: click.Group) -> None:
    for cmd in (status_cmd, logs_cmd, down_cmd, plot_cmd):
        cli.add_command(cmd)
