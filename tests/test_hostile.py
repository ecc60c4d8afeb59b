"""At least 1,000 generated hostile recipes and overrides (alias bombs, deep nesting, huge and non-finite
numbers, duplicate keys, special files, unicode names, shell metacharacters) through validate, plan and every
render, in a process with a 3 GiB memory limit and a 20 s limit per command: no traceback, no internal
error, no hang, and every error names the recipe file or the --set item."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

N = 1000


@pytest.mark.slow
def test_hostile_inputs_never_traceback_hang_or_go_unlocated(tmp_path):
    out = tmp_path / "results.json"
    worker = Path(__file__).with_name("hostile_worker.py")
    p = subprocess.run(
        [sys.executable, str(worker), str(N), "20261123", str(out)], capture_output=True, text=True, timeout=1200
    )
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(out.read_text())
    cases = {r["case"] for r in results}
    assert len(cases) >= N
    bad = [r for r in results if r["code"] not in (0, 1, 2, 3) or r["traceback"] or r["internal"] or not r["located"]]
    assert not bad, json.dumps(bad[:10], indent=1)
    slowest = max(results, key=lambda r: r["seconds"])
    codes = collections.Counter(r["code"] for r in results)
    print(
        f"\n{len(cases)} hostile cases, {len(results)} commands: exit codes {dict(codes)}; slowest "
        f"{slowest['seconds']:.2f}s ({slowest['case']}, {slowest['command']})"
    )
    assert codes[2] > N // 2  # most of them are refused, with a located error
