"""`dtlaunch logs NAME --diagnose`: what happened to a run, in a few lines, from the records it left: each rank's
status record (status/rank-N.json: how it ended, at which step, on which node), the run's events (metrics.jsonl:
resumes, checkpoints, stragglers, the end) and, for a SLURM job, the job script's ledgers (jobs/ID/: attempts, exclusions).

A hang names its likely culprit: from the ranks' flight-recorder dumps when they show which rank never entered
the collective the others waited in (runtime/hangs.py); else from the records: the ranks that timed out wrote
HANG; a rank that never reached the collective (stopped, or stuck in its own work) wrote nothing of its own in
that attempt before torchrun stopped it, so the ranks of the last attempt without a record of it are the ones
the others waited for, on the node their neighbours (the same torchrun, LOCAL_WORLD_SIZE ranks to a node) ran on.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..jobenv import Excluded, ExitCode, read_metrics
from ..runtime import hangs
from ..runtime.status import TIMED_OUT, UNREPORTED, check_records


def run_dirs(where: Path) -> list[Path]:
    """The run directories under a job's directory: itself (local), or runs/<run id>/ (SLURM), newest last."""
    if (where / "status").is_dir() or (where / "metrics.jsonl").exists():
        return [where]
    found = [d for d in (where / "runs").glob("*") if (d / "status").is_dir() or (d / "metrics.jsonl").exists()]
    return sorted(found, key=lambda d: d.stat().st_mtime)


def _records(run: Path) -> list[dict]:
    out = []
    for p in sorted((run / "status").glob("rank-*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def diagnose(where: Path) -> list[str]:
    """A few lines on the newest run under `where` (a run directory, or a job's directory holding runs/)."""
    runs = run_dirs(where)
    if not runs:
        return [f"{where}: no run records (status/, metrics.jsonl) yet: the job has not started training"]
    run = runs[-1]
    lines = [f"run {run.name} ({run})"]
    events = read_metrics(run) if (run / "metrics.jsonl").exists() else []
    steps = [r["step"] for r in events if "event" not in r and "loss" in r]
    ends = [r for r in events if r.get("event") == "end"]
    resumes = [r.get("step") for r in events if r.get("event") == "resume"]
    saved = [r.get("step") for r in events if r.get("event") == "checkpoint"]
    if ends:
        lines.append(f"finished at step {ends[-1].get('step')}")
    else:
        lines.append(f"not finished: last logged step {max(steps) if steps else '-'}")
    if resumes:
        lines.append(f"resumed {len(resumes)} time(s), at step(s) {', '.join(map(str, resumes))}")
    if saved:
        lines.append(f"newest committed checkpoint: step {saved[-1]}")
    for e in (r for r in events if r.get("event") == "straggler"):  # training.on_straggler: exit ended an attempt
        lines.append(f"straggler ended the attempt at step {e.get('step')}: {_slow(e.get('stragglers'))}")
    logged = [r for r in events if "event" not in r and "loss" in r]
    if logged and logged[-1].get("stragglers") and not ends:
        lines.append(f"straggling at step {logged[-1]['step']}: {_slow(logged[-1]['stragglers'])}")
    lines += _checks(run)
    lines += _last_attempt(run, _records(run))
    lines += _ledgers(where)
    return lines


def _checks(run: Path) -> list[str]:
    """The nodes that failed the check before training, in any attempt (no rank of theirs left a record)."""
    found = [r for d in (run / "status").glob("*/") for r in check_records(d)]
    return [
        f"node {r.get('node')} failed the check before training (attempt {r.get('attempt')}): "
        f"{ExitCode.name_of(int(r.get('code', 0)))} ({r.get('code')}): {str(r.get('message', '')).splitlines()[0]}"
        for r in sorted(found, key=lambda r: float(r.get("time") or 0))
        if r.get("code") and str(r.get("message", "")).strip()
    ]


def _slow(stragglers) -> str:
    """runtime/stragglers.py's records, for one line."""
    return "; ".join(
        f"rank {s.get('rank')} on {s.get('node')} ({s.get('slower')}x the median rank's forward time"
        + (
            f"; the others waited {w:.3g} s per step for it in collectives)"
            if isinstance(w := s.get("peers_waited_s"), (int, float))
            else ")"
        )
        for s in stragglers or []
        if isinstance(s, dict)
    )


def _newest_attempt(records: list[dict]) -> tuple[str | None, list[dict]]:
    """The newest attempt (the newest record's) and its ranks' records."""
    attempt = max(records, key=lambda r: r.get("time", 0)).get("attempt")
    return attempt, [r for r in records if r.get("attempt") == attempt]


def _dumps(run: Path, attempt: str | None) -> dict[int, dict]:
    """The flight-recorder dumps of one attempt (the job scripts point them at status/ATTEMPT/)."""
    return hangs.read_dumps(run / "status" / attempt) if attempt else {}


def _attempt_checks(run: Path, attempt: str | None) -> list[dict]:
    """The nodes' checks before training of one attempt (each with its place in the job, node_rank)."""
    return check_records(run / "status" / attempt) if attempt else []


def _last_attempt(run: Path, records: list[dict]) -> list[str]:
    if not records:
        return []
    attempt, mine = _newest_attempt(records)
    out = [f"attempt {attempt}:"]
    by_code: dict[int, list[dict]] = {}
    for r in mine:
        if UNREPORTED in str(r.get("message", "")):
            out.append(f"  {_ranks([r['rank']])} ({r.get('node', '?')}) {r['message']}")
        else:
            by_code.setdefault(int(r["code"]), []).append(r)
    for code, rs in sorted(by_code.items()):
        nodes = sorted({str(r.get("node")) for r in rs if r.get("node")})
        at = sorted({int(r["step"]) for r in rs if r.get("step") is not None})
        out.append(
            f"  {ExitCode.name_of(code)} ({code}) on {_ranks([r['rank'] for r in rs])}"
            + (f" ({', '.join(nodes)})" if nodes else "")
            + (f" at step {', '.join(map(str, at))}" if at else "")
            + f": {rs[0].get('message', '')}"
        )
    if ExitCode.HANG in by_code:
        out += _culprits(mine, _dumps(run, attempt), _attempt_checks(run, attempt))
        out += _stacks(run, attempt)
    if ExitCode.PREFLIGHT in by_code:
        nodes = sorted({str(r.get("node")) for r in by_code[ExitCode.PREFLIGHT] if r.get("node")})
        if nodes:
            out.append(f"  the node(s) to exclude: {', '.join(nodes)} (a GPU or the node's environment failed there)")
    return out


def hang_culprits(
    mine: list[dict], dumps: dict[int, dict] | None = None, checks: list[dict] | None = None
) -> tuple[list[int], list[str], str] | None:
    """(ranks, their nodes, why) the hung ranks waited for: from the flight-recorder dumps when they tell (the
    ranks that never entered the collective the others waited in), else those that left no record of their own
    in this attempt (none at all, or only torchrun's report of their exit: stopped, or ended by the no-progress
    watchdog), else the HANG ranks that had got least far (the others timed out waiting in a later step).
    None: no telling."""
    world = max((int(r.get("world_size") or 0) for r in mine), default=0) or 1 + max(r["rank"] for r in mine)
    have = {r["rank"]: r for r in mine if UNREPORTED not in str(r.get("message", ""))}
    # when the first rank's collective timed out (not a HANG of ranks that disagreed, which is reported at once)
    timed_out = [r for r in have.values() if r["code"] == ExitCode.HANG and TIMED_OUT in str(r.get("message"))]
    gave_up = min((float(r["time"]) for r in timed_out if r.get("time")), default=None)
    fr = hangs.verdict(dumps or {}, world, gave_up)
    if fr is not None:
        culprits, why = fr
    else:
        culprits = [k for k in range(world) if k not in have]
        why = "no record of its own in this attempt: it never reached the collective the others timed out in"
    if not culprits:
        hung = [r for r in have.values() if r["code"] == ExitCode.HANG and r.get("step") is not None]
        least = min((r["step"] for r in hung), default=None)
        culprits = sorted(r["rank"] for r in hung if r["step"] == least)
        if least is None or len(culprits) == len(hung):
            return None
        why = f"it got only to step {least}; the others timed out waiting for it in a later step"
    # a culprit's node: its own record's (torchrun's report carries the node), else its torchrun's neighbours', else
    # the node whose check before training (`checks`, the attempt's) says it holds that place in the job
    per_node = max((int(r.get("local_world_size") or 0) for r in mine), default=0)
    node_of = {c["node_rank"]: c.get("node") for c in checks or () if isinstance(c.get("node_rank"), int)}
    node_of.update({r["rank"] // per_node: r.get("node") for r in mine if per_node and r.get("node")})
    named = {r["rank"]: r.get("node") for r in mine if r.get("node")}
    nodes = {named.get(k) or (node_of.get(k // per_node) if per_node else None) for k in culprits}
    return culprits, sorted(str(n) for n in nodes if n), why


def _culprits(mine: list[dict], dumps: dict[int, dict], checks: list[dict]) -> list[str]:
    found = hang_culprits(mine, dumps, checks)
    if found is None:
        return [
            "  no culprit can be told: every rank reported the hang at the same step, and no flight-recorder "
            f"dump (status/ATTEMPT/{hangs.DUMP_PREFIX}R) shows one rank behind the others"
        ]
    ranks, nodes, why = found
    return [f"  likely culprit: {_ranks(ranks)}" + (f" on {', '.join(nodes)}" if nodes else "") + f": {why}"]


def _stacks(run: Path, attempt: str | None) -> list[str]:
    """Where each rank's main thread was when its node's first hung rank took the stacks (py-spy's dump: a
    "=== rank R" header of ours, then py-spy's "Thread ... "MainThread"" and its innermost frame first)."""
    out = []
    for f in sorted((run / "status" / attempt).glob(f"{hangs.STACKS_PREFIX}*.txt")) if attempt else []:
        out.append(f"  stacks: {f}")
        rank, main = None, False
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith("=== rank "):
                rank, main = line[4:].split(" (")[0], False
            elif line.startswith("Thread ") and '"MainThread"' in line:
                main = True
            elif main and line.startswith("    ") and rank:
                out.append(f"    {rank}: in {line.strip()}")
                rank, main = None, False
    return out


def culprit_nodes(run: Path) -> list[str]:
    """The nodes of a hang's likely culprits in the run's newest attempt (none when it did not hang or no rank
    can be told from the rest): what the SLURM job script excludes before requeueing a hung job."""
    records = _records(run)
    if not records:
        return []
    attempt, mine = _newest_attempt(records)
    if not any(int(r["code"]) == ExitCode.HANG for r in mine):
        return []
    found = hang_culprits(mine, _dumps(run, attempt), _attempt_checks(run, attempt))
    return found[1] if found else []


def _ledgers(where: Path) -> list[str]:
    """A SLURM job's exclusions (jobs/ID/excluded, jobenv.Excluded) and why."""
    out = []
    for f in sorted(where.glob("jobs/*/excluded")):
        for e in Excluded.ledger(f.read_text()):
            why = f": {e['why']}" if e["why"] else ""
            out.append(f"job {f.parent.name}: excluded {e['nodes']} after attempt {e['attempt']} and requeued{why}")
    return out


if __name__ == "__main__":  # the SLURM job script: `python -m launcher.cli.diagnose RUN_DIR`, one culprit node a line
    import sys

    for node in culprit_nodes(Path(sys.argv[1])):
        print(node)
