"""Hardening, round 2, with real 2-rank runs of the deterministic 12-step recipe: a run never silently starts
over (a directory with only unusable checkpoints stops every attempt, and torchrun's own restarts do not
retry a final code), damage is proven and not guessed (a read error is retried, never marked), a linked step
directory is never followed, meta.json is checked like every other file, and a full disk says so.

Read errors are injected with strace into one rank (its first open of one checkpoint file fails with EIO, or
every open does); the full disk is a 16 MB tmpfs in a private mount namespace (unshare), as root."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import pytest

from launcher.jobenv import ExitCode
from launcher.runtime.checkpoint import disk
from rt_harness import DET_EVERY, DET_STEPS, det_recipe, load_safetensors, run_torchrun, write_plan

pytestmark = pytest.mark.slow


def same_weights(a, b) -> bool:
    import torch

    wa, wb = load_safetensors(a), load_safetensors(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def trained_steps(res) -> list[int]:
    return sorted({m["step"] for m in res.metrics() if "loss" in m})


def truncate(f) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


# ----------------------------------------------------------------------------- R01


def test_r01_no_usable_checkpoint_ends_the_job_despite_torchruns_restarts(run_dir, trained):
    """The reviewer's case with the local target's default max_restarts (3): attempt 0 stops CONFIG, and the
    agent must not restart it (a restart found the step marked CORRUPT, trained from step 0 and ended 0)."""
    plan = trained(keep=(DET_STEPS,))  # a finished run that kept one checkpoint
    root = run_dir / "checkpoints"
    (only,) = disk.complete_steps(root)
    truncate(disk.step_path(root, only) / "__1_0.distcp")
    res = run_torchrun(plan, run_dir, elastic=True, max_restarts=3)
    assert res.rc != 0 and set(res.worker_codes) == {ExitCode.CONFIG}, res.output[-3000:]
    assert "no checkpoint in" in res.stderr and "can be used" in res.stderr and "move the directory aside" in res.stderr
    assert "never retried: not restarting the workers" in res.stderr
    assert len(res.events("start")) == 1, "the agent restarted the workers"
    assert trained_steps(res) == [] and "starting from step 0" not in res.stdout
    assert disk.is_corrupt(disk.step_path(root, only))  # kept in place for a person, never moved aside
    assert not list(root.glob("*.corrupt-*"))
    # Every later attempt (a resubmission, or an agent on another node that restarts anyway) stops too, naming it.
    again = run_torchrun(plan, run_dir, max_restarts=0)
    assert set(again.worker_codes) == {ExitCode.CONFIG}, again.output[-3000:]
    assert f"step {only}: marked CORRUPT earlier" in again.stderr and trained_steps(again) == []


# ----------------------------------------------------------------------------- R02


def strace_rank(rank: int, path, when: str) -> list[str]:
    """A worker wrapper: rank `rank` runs under strace, its openat of `path` failing with EIO (`when`: "1" the
    first time only, "1+" every time); the other ranks run as they are."""
    script = (
        f'if [ "$RANK" = {rank} ]; then exec strace -f -qq -o /dev/null -P "$0" -e trace=openat '
        f'-e inject=openat:error=EIO:when={when} "$@"; else exec "$@"; fi'
    )
    return ["bash", "-c", script, str(path)]


def verified_by_rank(path, rank: int, world: int) -> str:
    """A data file that `rank` checksums at resume (ranks take the sorted names in turn)."""
    names = sorted(disk.expected_files(path)[0])
    return next(n for n in names[rank::world] if n.endswith(".distcp"))


@pytest.fixture
def finished(run_dir, trained):
    return trained(), run_dir / "checkpoints"


def test_r02_a_transient_read_error_is_retried_and_marks_nothing(reference, run_dir, finished):
    plan, root = finished
    newest = disk.step_path(root, DET_STEPS)
    victim = newest / verified_by_rank(newest, 1, 2)
    res = run_torchrun(plan, run_dir, elastic=True, max_restarts=2, worker=strace_rank(1, victim, "1"))
    assert res.rc == 0, res.output[-3000:]
    assert f"resumed from step {DET_STEPS}" in res.stdout and "cannot be used" not in res.stdout
    assert disk.corrupt_steps(root) == [] and disk.complete_steps(root)[-1] == DET_STEPS
    assert same_weights(reference("ddp").run_dir / "model.safetensors", run_dir / "model.safetensors")


def test_r02_a_read_error_that_persists_fails_the_attempt_without_marking(run_dir, finished):
    plan, root = finished
    newest = disk.step_path(root, DET_STEPS)
    victim = newest / verified_by_rank(newest, 1, 2)
    before = sorted(p.name for p in newest.iterdir())
    res = run_torchrun(plan, run_dir, elastic=True, max_restarts=2, worker=strace_rank(1, victim, "1+"))
    assert set(res.worker_codes) == {ExitCode.STORAGE}, res.output[-3000:]
    assert f"cannot read the checkpoint file {victim} (Input/output error)" in res.stderr
    assert len(res.events("start")) == 1  # a storage error is not restarted by the agent
    assert disk.corrupt_steps(root) == [] and sorted(p.name for p in newest.iterdir()) == before
    # no rank traceback: torchrun reports the failure itself (the agent's own re-raise names runtime/elastic.py)
    assert not re.search(r"launcher/runtime/(?!elastic\.py)", res.stderr), res.stderr[-3000:]


def test_r02_a_read_error_inside_dcp_load_is_a_storage_error(run_dir, finished):
    """DCP's CheckpointException is a BaseException: it ended the rank with a traceback and torchrun retried.
    Here the checksums pass (the first three opens succeed) and DCP's own open fails."""
    plan, root = finished
    newest = disk.step_path(root, DET_STEPS)
    victim = newest / verified_by_rank(newest, 1, 2)
    res = run_torchrun(plan, run_dir, elastic=True, max_restarts=2, worker=strace_rank(1, victim, "2+"))
    assert set(res.worker_codes) == {ExitCode.STORAGE}, res.output[-3000:]
    assert f"reading checkpoint {newest} failed" in res.stderr and disk.corrupt_steps(root) == []


# ----------------------------------------------------------------------------- R03


def test_r03_a_linked_step_directory_is_refused_and_the_other_run_untouched(run_dir, tmp_path, trained):
    """Run B seeded with a link to run A's newest checkpoint used to resume from it, prune through the link
    (unlinking A's COMPLETE) and log "pruned"; A then lost that checkpoint."""
    a = tmp_path / "a"
    trained(a)
    a_root, a_newest = a / "checkpoints", disk.step_path(a / "checkpoints", DET_STEPS)
    before = {p.name: p.stat().st_size for p in a_newest.iterdir()}
    b_root = run_dir / "checkpoints"
    b_root.mkdir()
    (b_root / a_newest.name).symlink_to(a_newest)
    plan = write_plan(run_dir, det_recipe("ddp", training={"steps": 20}, checkpoint={"keep": 2}))
    res = run_torchrun(plan, run_dir, elastic=True, max_restarts=2)
    assert set(res.worker_codes) == {ExitCode.CONFIG}, res.output[-3000:]
    assert f"{a_newest.name} -> {a_newest}" in res.stderr and "never follows" in res.stderr
    assert trained_steps(res) == [] and "pruned" not in res.stdout
    assert {p.name: p.stat().st_size for p in a_newest.iterdir()} == before
    assert disk.complete_steps(a_root)[-1] == DET_STEPS


def test_r03_prune_and_cleanup_never_follow_links_and_say_what_they_did(tmp_path):
    other = tmp_path / "other" / "step-00000002"
    other.mkdir(parents=True)
    (other / disk.MARKER).write_text("{}")
    root = tmp_path / "ck"
    root.mkdir()
    (root / "step-00000002").symlink_to(other)
    (root / "step-00000009").symlink_to(tmp_path / "other")  # an uncommitted-looking link
    problems: list[str] = []
    assert disk.prune(root, keep=1, problems=problems) == []
    assert disk.clean_partials(root, problems) == []
    assert (other / disk.MARKER).is_file() and (root / "step-00000002").is_symlink()
    assert any("left step-00000002 alone: it is a symbolic link" in p for p in problems)
    # A directory that could not be removed is reported, not counted as removed (rmtree failing silently
    # under ignore_errors used to be logged as "pruned").
    stuck = root / "step-00000001"
    stuck.mkdir()
    problems.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(disk.shutil, "rmtree", lambda p, **kw: None)
        assert disk.clean_partials(root, problems) == []
    assert problems == ["could not remove step-00000001: still there"]


# ----------------------------------------------------------------------------- R10


def test_r10_an_edited_meta_json_is_damage_and_the_result_stays_exact(reference, run_dir, finished):
    """step-12/meta.json edited to say step 8 (with step 8's data position): the run resumed "from step 8" on
    step-12 weights, retrained 9-12 on top and skipped the saves as already committed: wrong weights."""
    plan, root = finished
    newest = disk.step_path(root, DET_STEPS)
    prev = DET_STEPS - DET_EVERY
    meta = disk.read_meta(newest)
    meta.update(step=prev, data=disk.read_meta(disk.step_path(root, prev))["data"])
    (newest / disk.META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    res = run_torchrun(plan, run_dir, elastic=True, max_restarts=2)
    assert res.rc == 0, res.output[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if f"checkpoint step {DET_STEPS} cannot be used" in ln)
    assert "meta.json has changed since it was committed" in line and f"meta.json says step {prev}" in line
    assert f"resumed from step {prev}" in res.stdout
    assert same_weights(reference("ddp").run_dir / "model.safetensors", run_dir / "model.safetensors")


# ----------------------------------------------------------------------------- R08


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="a private tmpfs needs root and unshare (util-linux)"
)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # a synchronous save, and DCP's async one
def test_r08_a_full_disk_says_so_and_is_not_retried(run_dir, tmp_path, strategy):
    """A 16 MB tmpfs holds one 11 MB checkpoint: the second save fails. The failure used to read "unexpected
    pos 704 vs 598" (async) or be retried by torchrun four times (sync), ending FAILED."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    rec = det_recipe(strategy, checkpoint={"dir": str(mnt / "ck")})
    plan = write_plan(run_dir, rec)
    prefix = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "bash",
        "-c",
        'mount -t tmpfs -o size=16m tmpfs "$0" && exec "$@"',
        str(mnt),
    ]
    res = run_torchrun(plan, run_dir, elastic=True, max_restarts=3, prefix=prefix)
    codes = set(res.worker_codes)
    assert codes == {ExitCode.STORAGE}, res.output[-3000:]
    assert len(res.events("start")) == 1, "torchrun retried a full disk"
    assert f"checkpoint step {2 * DET_EVERY} could not be written to {mnt / 'ck'}" in res.stderr
    assert "no space left" in res.stderr and "GB free" in res.stderr and "a checkpoint needs ~0.011 GB" in res.stderr
    assert "resumes from step 4" in res.stderr
    assert not list(mnt.glob("**/.dtlaunch-probe-*"))


def test_r08_leftovers_count_as_room_and_the_probe_never_stays(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from launcher.runtime import nodecheck, preflight

    root = tmp_path / "ck"
    partial = disk.step_path(root, 8)
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"x" * 4096)
    free = disk.free_bytes(root)
    rep = preflight.Report()
    world = SimpleNamespace(rank=0)
    preflight.check_checkpoint_space(world, root, free + 2048, keep=1, rep=rep)
    assert not rep.failures and "uncommitted leftovers that start-up removes" in rep.lines[0]
    preflight.check_checkpoint_space(world, root, free + (1 << 40), keep=1, rep=rep)
    assert rep.storage and "not enough room" in rep.failures[0]

    # The pre-start check's probe file: removed even when writing it fails (a full disk).
    def full(self, data):
        open(self, "wb").close()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nodecheck.Path, "write_bytes", full)
    monkeypatch.setenv("DTLAUNCH_CHECKPOINT_DIR", str(root))
    from launcher.runtime.failures import StorageError

    with pytest.raises(StorageError, match="No space left on device .* GB free"):
        nodecheck.check_checkpoint_dir(SimpleNamespace(checkpoint=SimpleNamespace(dir=None)), tmp_path)
    monkeypatch.undo()
    assert not list(root.glob(".dtlaunch-probe-*"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
