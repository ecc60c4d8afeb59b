"""A job whose pre-start check fails (the checkpoint directory cannot be written) ends with the check's own
exit code recorded for `status`, and with the check's own advice: it used to end LOST (exit code 1, none
recorded) with advice to set DTLAUNCH_PYTHON, which is about a broken environment, not storage."""

from __future__ import annotations

import json

import pytest

from testpaths import RECIPES

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("where", ["proc", "dangling-link"])
def test_a_failed_prestart_check_records_its_code_and_names_its_check(run_cli, tmp_path, where):
    if where == "proc":
        ck, says = "/proc/ck", "cannot write checkpoints to /proc/ck: No such file or directory"
    else:
        (tmp_path / "ck").symlink_to(tmp_path / "gone")
        ck, says = str(tmp_path / "ck"), f"is a symbolic link to {tmp_path / 'gone'}, which does not exist"
    run_dir = tmp_path / "run"
    code, out, err = run_cli("up", RECIPES / "tiny.yaml", "-o", run_dir, "--set", f"checkpoint.dir={ck}")
    text = out + err
    assert code == 2, text
    assert says in text and "the pre-start check failed" in text
    assert "DTLAUNCH_PYTHON" not in text and "LOST" not in text
    (attempt,) = (run_dir / "status").iterdir()
    assert (attempt / "exit_code").read_text().strip() == "2"
    code, out, _ = run_cli("status", "--json")
    (row,) = json.loads(out)
    assert row["exit_code"] == 2 and row["state"].startswith("FAILED")
