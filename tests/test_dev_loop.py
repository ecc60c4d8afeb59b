"""The developer loop's own tool: a few test files named on one pytest command line, in any order, get their
directories' conftest fixtures (pytest 9.1.0-9.1.1 lost them when the files interleaved directories, so `pytest`
on the files a change touched failed with "fixture 'run_dir' not found"; constraints.txt pins a pytest without
that)."""

from __future__ import annotations

import subprocess
import sys


def test_files_named_in_any_order_get_their_directorys_fixtures(tmp_path):
    (tmp_path / "conftest.py").write_text("")
    sub = tmp_path / "runtime"
    sub.mkdir()
    (sub / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.fixture\ndef run_dir(tmp_path):\n    return tmp_path\n"
    )
    (tmp_path / "test_top.py").write_text("def test_top():\n    pass\n")
    for name in ("a", "b"):
        (sub / f"test_{name}.py").write_text(f"def test_{name}(run_dir):\n    assert run_dir.is_dir()\n")
    order = ["runtime/test_a.py", "test_top.py", "runtime/test_b.py"]
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *order],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and "3 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
