"""`status`, `logs`, `down` and `plot`: following a job after `up`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..errors import DtlaunchError
from ..jobenv import last_logged_step, span
from ..targets import LIVE


def status_rows(recs, everyone=None) -> list[dict]:
    """`status`'s rows. A job's progress is the newest step in its own records (Backend.records_dir) logged after
    it was submitted and before the next job of the same records was (of `everyone` recorded; `recs` by default):
    each `up` into a run directory trains on in the same metrics.jsonl, and a row shows its own job's steps only.
    The total is the one that step was trained towards (a later `up` may have changed the plan in the directory)."""
    everyone = recs if everyone is None else everyone
    where: dict[int, str | None] = {}
    for r in (*everyone, *recs):
        if id(r) not in where:
            where[id(r)] = records_dir(r)
    starts: dict[str, list[float]] = {}
    for o in everyone:
        if (w := where[id(o)]) is not None:
            starts.setdefault(w, []).append(o.created)
    rows = []
    for r, st in zip(recs, job_states(recs), strict=True):
        mine = where[id(r)]
        last = None
        if mine is not None and Path(mine).is_dir():
            until = min((t for t in starts.get(mine, ()) if t > r.created), default=None)
            last = last_logged_step(mine, between=(r.created, until))
        rows.append(
            {
                "name": r.name,
                "target": r.target,
                "job_id": r.job_id,
                "run_dir": r.run_dir,
                "created": r.created,
                **st.to_dict(),
                "last_step": last,
                "total_steps": (last or {}).get("steps") or planned_steps(r.run_dir),
            }
        )
    return rows


def records_dir(rec) -> str | None:
    """Where a recorded job's training records are (metrics.jsonl, status/), None before it has any:
    Backend.records_dir."""
    from ..targets import backend

    try:
        return backend(rec.target).records_dir(rec)
    except (DtlaunchError, KeyError):  # a target this dtlaunch does not know: its run directory as recorded
        return rec.run_dir


def not_started(rec) -> str:
    return f"{rec.name} ({rec.target}:{rec.job_id}) has no training records yet: it has not started training"


def job_states(recs) -> list:
    """Each job's JobStatus, from one backend per target: the local one scans the process table once for all."""
    from ..targets import JobStatus, backend

    backends, out = {}, []
    for r in recs:
        try:
            if r.target not in backends:
                backends[r.target] = backend(r.target)
            out.append(backends[r.target].status(r))
        except DtlaunchError as e:
            out.append(JobStatus("UNKNOWN", detail=str(e)))
    return out


def live_jobs(recs) -> list:
    return [r for r, st in zip(recs, job_states(recs), strict=True) if st.state in LIVE]


def planned_steps(run_dir: str | None) -> int | None:
    """The run's length as its rendered plan says (run_dir/plan.json), for progress and the ETA."""
    try:
        plan = json.loads((Path(run_dir) / "plan.json").read_text()).get("plan", {})  # type: ignore[arg-type]
        steps = plan.get("steps")
        return int(steps) if isinstance(steps, int) and steps > 0 else None
    except (OSError, TypeError, ValueError, AttributeError):
        return None


def progress(row: dict, now: float) -> dict:
    """What the table shows of a row: step/total, loss, tok/s, MFU, ETA, age, duration, where."""
    last, total = row.get("last_step") or {}, row.get("total_steps")
    step = last.get("step")
    live = row["state"] in LIVE
    eta = None
    if live and step is not None and total and last.get("step_time_s"):
        eta = max(0, total - step) * float(last["step_time_s"])
    end = now if live else (last.get("time") or now)
    tps = last.get("tokens_per_s")
    where = row["run_dir"] or "-"
    try:
        where = str(Path(where).relative_to(Path.cwd()))
    except ValueError:
        pass
    state = row["state"] + (f" exit={row['exit_code']}" if row.get("exit_code") is not None else "")
    slow = [s for s in last.get("stragglers") or [] if isinstance(s, dict)]  # runtime/stragglers.py
    if slow:
        state += " straggler: " + ", ".join(
            f"rank {s.get('rank')} on {s.get('node')} {s.get('slower')}x"
            + (f", others wait {w:.2g} s/step" if isinstance(w := s.get("peers_waited_s"), (int, float)) else "")
            for s in slow
        )
    excluded = row.get("excluded") or []  # a SLURM job's left-out nodes (jobenv.Excluded.ledger), the newest
    if excluded:
        e = excluded[-1]
        state += f" excluded: {e['nodes']} (attempt {e['attempt']}" + (f": {e['why']})" if e.get("why") else ")")
    return {
        "name": row["name"],
        "target": f"{row['target']}:{row['job_id']}",
        "state": state + (f" ({row['detail']})" if row.get("detail") else ""),
        "step": "-" if step is None else (f"{step:,}/{total:,}" if total else f"{step:,}"),
        "loss": f"{last['loss']:.4f}" if isinstance(last.get("loss"), (int, float)) else "-",
        "tok/s": "-" if not tps else (f"{tps / 1e3:.1f}k" if tps >= 1e3 else f"{tps:.0f}"),
        "MFU": f"{last['mfu']:.1%}" if isinstance(last.get("mfu"), (int, float)) else "-",
        "ETA": span(eta) if eta is not None else "-",
        "age": span(now - row["created"]),
        "duration": span(end - row["created"]) if row.get("created") else "-",
        "where": where,
    }


COLUMNS = ("name", "target", "state", "step", "loss", "tok/s", "MFU", "ETA", "age", "duration", "where")


def status_table(rows: list[dict]):
    """The registry as a rich table with a header (colours only on a terminal)."""
    import time

    from rich.table import Table

    colour = {"RUNNING": "green", "COMPLETED": "cyan", "FAILED": "red", "LOST": "red", "PREEMPTED": "yellow"}
    table = Table(*COLUMNS, box=None, header_style="bold", pad_edge=False)
    now = time.time()
    for row in rows:
        cells = progress(row, now)
        table.add_row(*(cells[c] for c in COLUMNS), style=colour.get(row["state"]))
    return table


def _console():
    import shutil

    from rich.console import Console

    # Not a terminal (a pipe, a log, a test): wide enough that a row never wraps, and no colour codes.
    return Console(width=None if sys.stdout.isatty() else max(200, shutil.get_terminal_size().columns))


@click.command("status")
@click.argument("job", required=False)
@click.option("--json", "as_json", is_flag=True, help="The rows as JSON (a stable contract).")
@click.option("--watch", is_flag=True, help="Refresh the table until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(0.2), help="Seconds per refresh.")
@click.option(
    "--goodput",
    is_flag=True,
    help="Where JOB's time went, by cause (queue, preflight, start-up, useful training, lost work, checkpoint "
    "stalls, recovery), with the cost of each at the plan's prices, and its goodput.",
)
def status_cmd(job, as_json, watch, interval, goodput):
    """The recorded jobs as a table (or one job): state, progress, loss, throughput, ETA, age and where."""
    from ..targets.registry import Registry

    reg = Registry()
    if goodput:
        if not job:
            raise click.UsageError("--goodput needs a job: dtlaunch status NAME --goodput")
        from ..runtime.goodput import report

        rec = resolve(reg, job)
        mine = records_dir(rec)
        for line in [not_started(rec)] if mine is None else report(Path(mine), rec.created, Path(rec.run_dir)):
            click.echo(line)
        return

    def rows():
        everyone = reg.all()
        return status_rows([resolve(reg, job)], everyone) if job else status_rows(everyone)

    if as_json:
        click.echo(json.dumps(rows(), indent=2))
        return
    console = _console()
    if not watch:
        current = rows()
        if not current:
            click.echo("no jobs recorded yet (dtlaunch up RECIPE)")
            return
        console.print(status_table(current))
        return
    import time

    from rich.live import Live

    try:
        if not console.is_terminal:  # a log or a pipe: a new table each time, under the time it was taken
            while True:
                console.print(f"-- {time.strftime('%H:%M:%S')}")
                console.print(status_table(rows()))
                sys.stdout.flush()
                time.sleep(interval)
        with Live(status_table(rows()), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(status_table(rows()), refresh=True)
    except KeyboardInterrupt:
        pass


def resolve(reg, key: str, rows: list | None = None):
    """The one job `key` names: a job id, a name, or a run directory. A name used in several run directories
    (two checkouts, or one recipe run with different -o) is ambiguous: the command asks which, by id or by
    directory, rather than silently taking the newest."""
    return in_one_dir(reg.matching(key), key)[-1]


def in_one_dir(hits: list, key: str) -> list:
    """The jobs `key` names, when they are all of one run directory; else the error that asks which."""
    dirs = {r.run_dir for r in hits}
    if len(dirs) <= 1:
        return hits
    listing = "; ".join(f"{r.target}:{r.job_id} in {r.run_dir}" for r in {r.run_dir: r for r in hits}.values())
    raise DtlaunchError(
        f"{key!r} names jobs in {len(dirs)} run directories: {listing}",
        fix=f"name one by its id (e.g. `{hits[-1].target}:{hits[-1].job_id}`) or by its run directory",
    )


def as_lines(chunks):
    """Whole lines, each with its newline (the last perhaps without), from a log read in pieces of any size: a
    SLURM job's log comes as what was written since the last read, so --tail and the rank filter count lines."""
    pending: list[str] = []
    for chunk in chunks:
        *ends, rest = chunk.split("\n")
        for end in ends:
            yield "".join(pending) + end + "\n"
            pending.clear()
        if rest:
            pending.append(rest)
    if pending:
        yield "".join(pending)


def of_ranks(lines, node: str | None, rank: int | None):
    """The lines a node's or a rank's processes wrote, by the label every line of a job's ranks carries
    (jobenv.LOG_LINE); unlabelled lines (the job script's, torchrun's own) are left out."""
    from ..jobenv import LOG_LINE

    for line in lines:
        m = LOG_LINE.match(line)
        if m and (node is None or m["node"] == node) and (rank is None or int(m["rank"]) == rank):
            yield line


@click.command("logs")
@click.argument("job")
@click.option("-f", "--follow", is_flag=True, help="Keep streaming until the job ends.")
@click.option("-n", "--tail", "tail", type=click.IntRange(1), default=None, help="Only the last N lines.")
@click.option(
    "--diagnose",
    is_flag=True,
    help="What happened, in a few lines, from the run's records: how each rank ended, on which node, at which "
    "step; a hang's likely culprit; the nodes excluded. JOB may also be a directory of records (a SkyPilot "
    "run's, copied from its checkpoint storage).",
)
@click.option("--node", default=None, help="Only the lines of this node's ranks (SLURM jobs label every line).")
@click.option("--rank", type=click.IntRange(0), default=None, help="Only the lines of this rank.")
def logs_cmd(job, follow, tail, diagnose, node, rank):
    """Print a job's output."""
    from collections import deque

    from ..targets import backend
    from ..targets.registry import Registry

    if follow and tail:
        raise click.UsageError("--tail prints what is written so far; --follow streams it all: use one")
    if diagnose:
        from .diagnose import diagnose as explain

        try:
            rec = resolve(Registry(), job)
            mine = records_dir(rec)
            if mine is None:
                click.echo(not_started(rec))
                return
            where = Path(mine)
        except DtlaunchError:
            # or a directory no recorded job ran in: a copy of a SkyPilot run's records from its checkpoint
            # storage (the nodes that wrote them may be gone), another machine's run directory
            if not Path(job).is_dir():
                raise
            where = Path(job)
        for line in explain(where):
            click.echo(line)
        return
    rec = resolve(Registry(), job)
    try:
        lines = backend(rec.target).logs(rec, follow=follow)
        if tail or node is not None or rank is not None:  # plain output streams as written, a partial line too
            lines = as_lines(lines)
        if node is not None or rank is not None:
            lines = of_ranks(lines, node, rank)
        shown = 0
        for line in deque(lines, maxlen=tail) if tail else lines:
            click.echo(line, nl=False)
            shown += 1
        if not shown and (node is not None or rank is not None):
            who = " ".join(f for f in (f"node {node}" if node else "", f"rank {rank}" if rank is not None else "") if f)
            click.echo(
                f"no line of {who} in the job's log: lines carry [NODE rank R] on SLURM jobs (`logs --diagnose` "
                "names the nodes and ranks)",
                err=True,
            )
    except KeyboardInterrupt:
        pass


@click.command("down")
@click.argument("job", required=False)
@click.option("--all", "every", is_flag=True, help="Stop every running job this registry records.")
@click.option("-y", "--yes", is_flag=True, help="With --all: do not ask first.")
def down_cmd(job, every, yes):
    """Stop a job: SIGTERM first, so it checkpoints; what does not stop in time is killed."""
    from ..targets import backend
    from ..targets.registry import Registry

    if every == bool(job):
        raise click.UsageError("name one job, or pass --all")
    reg = Registry()
    if not every:
        rec = running_one(reg.matching(job), job)
        click.echo(backend(rec.target).cancel(rec))
        return
    live = live_jobs(reg.all())
    if not live:
        click.echo("no running jobs")
        return
    names = ", ".join(f"{r.name} ({r.target}:{r.job_id})" for r in live)
    if not yes and not click.confirm(f"stop {len(live)} job(s): {names}?", default=False):
        click.echo("nothing stopped")
        return
    for r in live:
        click.echo(backend(r.target).cancel(r))


@click.command("forget")
@click.argument("jobs", nargs=-1, required=True)
def forget_cmd(jobs):
    """Remove finished jobs from the registry (by name, id or run directory). Their files stay where they are."""
    from ..targets.registry import Registry

    reg = Registry()
    recs = [r for key in jobs for r in in_one_dir(reg.matching(key), key)]
    running = live_jobs(recs)
    if running:
        raise DtlaunchError(
            f"{', '.join(f'{r.name} ({r.target}:{r.job_id})' for r in running)} still running",
            fix="stop it first (dtlaunch down NAME), then forget it",
        )
    click.echo(f"forgot {reg.remove(recs)} job record(s); their run directories are untouched")


@click.command("prune")
@click.option("--older-than", "days", type=click.FloatRange(0), default=0.0, help="Only jobs older than DAYS.")
def prune_cmd(days):
    """Remove every finished job (and every job whose run directory is gone) from the registry; files stay."""
    import time

    from ..targets.registry import Registry

    reg = Registry()
    cutoff = time.time() - days * 86400
    recs = [r for r in reg.all() if r.created <= cutoff]
    live = {id(r) for r in live_jobs(recs)}
    old = [r for r in recs if id(r) not in live]
    click.echo(f"pruned {reg.remove(old)} finished job record(s); their run directories are untouched")


def running_one(hits: list, key: str):
    """Of the jobs `key` names (oldest first), the one still running; the newest if none is. A name used again
    (a loser of two racing `up`, an older run elsewhere) must not hide the live job behind a newer dead one."""
    if len(hits) == 1:
        return hits[0]
    live = live_jobs(hits)
    if len(live) > 1:
        ids = ", ".join(f"{r.target}:{r.job_id} ({r.run_dir})" for r in live)
        raise DtlaunchError(
            f"{len(live)} jobs named {key!r} are running: {ids}",
            fix=f"name one by its id, e.g. `dtlaunch down {live[-1].job_id}`",
        )
    return live[0] if live else hits[-1]


@click.command("plot")
@click.argument("run")
@click.option("-o", "--out", "out_png", default=None, help="PNG path (default: RUN/loss.png, RUN/goodput.png).")
@click.option("--goodput", is_flag=True, help="Draw where the run's time went, by cause (status --goodput).")
def plot_cmd(run, out_png, goodput):
    """Draw the loss curve of a run directory (or its metrics.jsonl) as a PNG."""
    run_path = Path(run)
    if run_path.is_dir():  # a SLURM job's directory holds its runs: the newest (logs --diagnose reads the same)
        from .diagnose import run_dirs

        run_path = (run_dirs(run_path) or [run_path])[-1]
    elif not run_path.exists():
        if "/" in run:
            raise DtlaunchError(f"{run}: no such run directory or file", fix="`dtlaunch status` lists each job's")
        from ..targets.registry import Registry

        rec = resolve(Registry(), run)
        mine = records_dir(rec)
        if mine is None:
            raise DtlaunchError(not_started(rec), fix="plot it once it has logged a step")
        run_path = Path(mine)
    try:
        from .plot import plot_goodput, plot_metrics
    except ImportError as e:
        raise DtlaunchError(f"plotting needs matplotlib ({e})", fix="pip install 'dtlaunch[train]'") from None
    name = "goodput.png" if goodput else "loss.png"
    out = out_png or str((run_path if run_path.is_dir() else run_path.parent) / name)
    try:
        (plot_goodput if goodput else plot_metrics)(str(run_path), out)
    except OSError as e:
        raise DtlaunchError(f"cannot write {out}: {e.strerror}", fix="pass -o with a writable path") from None
    click.echo(f"wrote {out}")


def register(cli: click.Group) -> None:
    for cmd in (status_cmd, logs_cmd, down_cmd, forget_cmd, prune_cmd, plot_cmd):
        cli.add_command(cmd)
