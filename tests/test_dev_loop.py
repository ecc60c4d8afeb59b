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


def test_each_repeat_and_the_test_that_proves_the_same_exist():
    """tests/conftest.py's REPEATS: a key that no longer names a test would leave a renamed repeat in `make test`
    unnoticed, and a value that names no test (or a repeat) would leave the behaviour in no test `make test` runs."""
    import importlib.util

    from testpaths import ROOT

    # by its path: "conftest" on sys.path may be another directory's
    spec = importlib.util.spec_from_file_location("tests_conftest", ROOT / "tests" / "conftest.py")
    assert spec and spec.loader
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    REPEATS = conftest.REPEATS

    def exists(nodeid: str) -> bool:
        path, _, name = nodeid.partition("::")
        func, _, param = name.partition("[")
        src = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
        return f"def {func}(" in src and (not param or f'"{param.rstrip("]")}"' in src)

    assert REPEATS
    for repeat, proof in REPEATS.items():
        assert exists(repeat), f"REPEATS names {repeat}, which is not a test"
        assert exists(proof), f"REPEATS: {repeat} is proved by {proof}, which is not a test"
        assert proof not in REPEATS and proof.split("[")[0] not in REPEATS, f"{proof} is a repeat itself"
