"""`make bench`: run every benchmark, write bench/results.json, bench/results.md and PNG plots.

`--quick` is the smoke version CI runs so the benchmarks keep working; it never fails for slowness,
only for a benchmark that crashes. `--only NAME... --update` measures those benchmarks again and replaces their
rows in the existing results (and the README's table), each such row naming the commit it was measured at.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import machine, save  # noqa: E402

# name -> module; each module has run(quick) -> {"ratio", "target", "meets", "detail"}
BENCHMARKS = [
    "trainer_overhead",
    "peak_memory",
    "checkpoint_stall",
    "recovery",
    "cli_latency",
    "planner_scale",
    "goodput",
    "chaos",
    "chaos_slurm",
    "chaos_sky",
]
# The quick smoke run (CI) drives the chaos faults once, through the SLURM job script and torchrun's restarts
# (chaos_slurm); chaos, the same faults under a supervisor that relaunches local torchrun, and chaos_sky, on the
# simulated SkyPilot VMs that tests/sky exercises, run in full only (CI's time is short).
SMOKE = [b for b in BENCHMARKS if b not in ("chaos", "chaos_sky")]


def markdown(results: dict) -> str:
    rows = ["| benchmark | ratio | noise band | target | meets |", "|---|---|---|---|---|"]
    order = sorted(results["benchmarks"], key=lambda n: BENCHMARKS.index(n) if n in BENCHMARKS else len(BENCHMARKS))
    for name in order:  # results.json keeps its keys sorted; the table keeps the order benchmarks run in
        r = results["benchmarks"][name]
        if "error" in r:
            rows.append(f"| {name} | error | | | no |")
            continue
        band = f"{r['band'][0]:.3f}-{r['band'][1]:.3f}" if "band" in r else "-"
        rows.append(f"| {name} | {r['ratio']:.3f} | {band} | {r['target']} | {'yes' if r['meets'] else 'no'} |")
    m = results["machine"]
    rows.append(f"\nMeasured on {m['cpus']} CPUs, Python {m['python']}, commit {m['commit']}, {m['date']}.")
    for name in order:
        again = results["benchmarks"][name].get("measured_again")
        if again:
            rows.append(f"{name} measured again at commit {again['commit']}, {again['date']}.")
    return "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer repeats, smaller sizes")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--update", action="store_true", help="with --only: replace those rows of OUT/results.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.update and (args.quick or not args.only):
        ap.error("--update re-measures the benchmarks named by --only, in full (not --quick)")
    if (args.quick or (args.only and not args.update)) and out.resolve() == HERE.resolve():
        # bench/results.* hold the full run's figures (the README's table): a partial run must not replace them
        ap.error("a --quick run, or --only without --update, writes only its own figures: give it --out DIR")
    if args.update:
        results = json.loads((out / "results.json").read_text())
    else:
        results = {"machine": machine(), "quick": args.quick, "benchmarks": {}}
    failed = False
    for name in args.only or (SMOKE if args.quick else BENCHMARKS):
        if not (HERE / f"{name}.py").exists():
            continue
        mod = importlib.import_module(name)
        try:
            kwargs = {"quick": args.quick}
            if "plot_path" in mod.run.__code__.co_varnames:
                kwargs["plot_path"] = str(out / f"{name}.png")
            if name == "goodput" and "checkpoint_stall" in results["benchmarks"]:
                sync = results["benchmarks"]["checkpoint_stall"].get("detail", {}).get("write_seconds_at_scale")
                if sync:
                    kwargs["write_s"] = sync
            results["benchmarks"][name] = mod.run(**kwargs)
            if args.update:
                m = machine()
                results["benchmarks"][name]["measured_again"] = {"commit": m["commit"], "date": m["date"]}
        except Exception as e:  # one broken benchmark must not hide the others' figures
            traceback.print_exc()
            results["benchmarks"][name] = {"error": f"{type(e).__name__}: {e}"}
            failed = True
    save(results, out / "results.json")
    (out / "results.md").write_text(markdown(results))
    if not args.quick and (not args.only or args.update) and out == HERE:
        from readme_table import update  # a full run in place: its table becomes the README's

        update(HERE.parent / "README.md", markdown(results))
    print(markdown(results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
