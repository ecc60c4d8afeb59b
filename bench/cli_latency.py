"""CLI latency: `dtlaunch --help`, `plan`, `validate` and `render --target slurm` against `python -c "import yaml"`.

Target: each <= 5x the bare interpreter + yaml import (the floor any Python CLI that reads YAML pays).

The CLI runs as `sys.executable -m launcher.cli` from the repository: the interpreter that runs the benchmark
and this checkout's code, whatever is (or is not) on PATH. `-m` costs the CLI an import of runpy that the
`dtlaunch` console script does not pay, so the figures err on the slow side.

The package's bytecode is compiled first, as `pip install` of the wheel does: from an editable install
under PYTHONDONTWRITEBYTECODE (as on the benchmark machine) every run would otherwise compile dtlaunch's
modules from source again (~15 ms), which no installed copy does.
"""

from __future__ import annotations

import compileall
import os

from common import PY, ROOT, bootstrap_band, interleaved, result, scratch, stats, time_command

TARGET = 5.0
CLI = [PY, "-m", "launcher.cli"]


def _ratio(pairs: list) -> float:
    """Median command time over median baseline time, of the rounds given."""
    return stats([c for c, _ in pairs])["median"] / stats([b for _, b in pairs])["median"]


def run(quick: bool = False) -> dict:
    repeat = 3 if quick else 15
    compileall.compile_dir(str(ROOT / "launcher"), quiet=1)
    out = str(scratch("bench-cli-"))
    cmds = {
        "baseline": [PY, "-c", "import yaml"],
        "help": [*CLI, "--help"],
        "plan": [*CLI, "plan", "recipes/llama70b.yaml"],
        "validate": [*CLI, "validate", "recipes/llama70b.yaml"],
        "render_slurm": [*CLI, "render", "recipes/llama70b.yaml", "--target", "slurm", "-o", out, "--force"],
    }
    env = dict(os.environ)
    times = interleaved({k: (lambda c=c: time_command(c, 1, env)[0]) for k, c in cmds.items()}, repeat)
    base = stats(times["baseline"])["median"]
    detail = {k: stats(v) for k, v in times.items()}
    ratios, bands = {}, {}
    for k, v in times.items():
        if k == "baseline":
            continue
        pairs = list(zip(v, times["baseline"], strict=True))  # each command with the baseline run in the same round
        ratios[k] = _ratio(pairs)
        bands[k] = bootstrap_band(pairs, _ratio)
    worst = max(ratios, key=ratios.get)
    print(
        f"cli_latency: baseline {base * 1000:.0f} ms; "
        + ", ".join(f"{k} {r:.2f}x ({bands[k][0]:.2f}-{bands[k][1]:.2f})" for k, r in ratios.items())
        + f" (target <= {TARGET}x)"
    )
    return result(
        ratios[worst],
        TARGET,
        ratios[worst] <= TARGET,
        band=list(bands[worst]),
        worst=worst,
        ratios=ratios,
        bands={k: list(b) for k, b in bands.items()},
        seconds=detail,
        rounds=repeat,
    )
