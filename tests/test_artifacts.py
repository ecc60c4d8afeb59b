"""Writing rendered artifacts: each file lands whole, and a failed write leaves the old set and no scratch
behind."""

from __future__ import annotations

import os

import pytest

from launcher.errors import DtlaunchError
from launcher.render.artifacts import Artifacts
from launcher.targets.local.request import LocalRequest


def _artifacts(files: dict) -> Artifacts:
    return Artifacts(
        target="local", job_name="j", files=files, request=LocalRequest("launch.sh"), executable={"launch.sh"}
    )


def _siblings(out):
    return sorted(p.name for p in out.parent.iterdir() if p != out)


def test_a_write_leaves_exactly_its_files_and_no_scratch_directory(tmp_path):
    out = tmp_path / "out"
    _artifacts({"launch.sh": "echo 1\n", "sub/dir/plan.json": "{}", "w.whl": b"\x00\x01"}).write(out)
    _artifacts({"launch.sh": "echo 2\n", "sub/other.txt": "x"}).write(out)
    assert _siblings(out) == []
    assert (out / "launch.sh").read_text() == "echo 2\n" and os.access(out / "launch.sh", os.X_OK)
    assert not (out / "sub/dir").exists() and not (out / "w.whl").exists() and (out / "sub/other.txt").is_file()


def test_a_failed_write_keeps_the_previous_files_and_removes_its_scratch(tmp_path):
    out = tmp_path / "out"
    _artifacts({"launch.sh": "echo 1\n"}).write(out)
    # "a" is a file, so "a/b" cannot be written: the write fails half way through its scratch directory.
    with pytest.raises(DtlaunchError, match="cannot write into"):
        _artifacts({"launch.sh": "echo 2\n", "a": "x", "a/b": "y"}).write(out)
    assert (out / "launch.sh").read_text() == "echo 1\n"
    assert _siblings(out) == []


def test_the_scratch_directory_is_private_and_a_link_in_it_is_not_followed(tmp_path, monkeypatch):
    from launcher.render import artifacts

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("k")
    seen = {}
    real = artifacts._scratch_dir

    def scratch(out):
        d = real(out)
        seen["mode"] = d.stat().st_mode & 0o777
        (d / "link").symlink_to(outside)  # a link to a directory, left in the scratch directory
        return d

    monkeypatch.setattr(artifacts, "_scratch_dir", scratch)
    out = tmp_path / "out"
    _artifacts({"launch.sh": "echo\n"}).write(out)
    assert seen["mode"] == 0o700
    assert (outside / "keep").read_text() == "k" and _siblings(out) == ["outside"]
