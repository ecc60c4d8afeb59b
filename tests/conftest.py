import gc
import sys

import pytest

# The fast tier (`make check`, `pytest -m fast`): every test not marked slow or gpu, outside tests/slurm and
# tests/gpu, except these, which run in the full suite only (`make test`). Each took this long in one process on
# a 2-core machine, and each checks something no cheaper test does, so it stays out of the fast tier rather
# than being marked slow. A key is a test file, a test (every parametrization) or one parametrization.
FULL_SUITE_ONLY = {
    # The planner against PyTorch's memory tracker: the tiny preset's full trace stays in the fast tier
    # (test_tiny_preset_traced_in_full_matches_the_planner_term_by_term, ~8 s), with the CLI and refusal tests.
    "tests/test_trace.py::test_tiny_variants_match_the_planner": "9 variants, 7-24 s each: one formula each",
    "tests/test_trace.py::test_two_depths_extrapolate_to_the_full_trace": "71 s: the extrapolation claim",
    "tests/test_trace.py::test_8b_shape_extrapolated_from_3_and_5_layers_matches_the_planner": "43 s",
    "tests/test_trace.py::test_small_vocabulary_shape_peaks_at_the_second_layers_backward": "42 s",
    "tests/test_trace.py::test_ddp_on_real_tensors_matches_the_planner": "3 x 20 s: DDP on real tensors",
    # A real torch elastic agent given a signal, waiting out its shutdown timeout (the rendered grace's
    # arithmetic stays: test_the_rendered_grace_covers_a_step_a_save_and_the_exit).
    "tests/runtime/test_elastic_shutdown.py::test_a_worker_within_the_grace_commits_and_one_beyond_it_is_killed": "12 s",
    # ... and one restarting its workers after a failure, waiting out the restart grace (jobenv.RESTART_GRACE_S).
    "tests/runtime/test_elastic_shutdown.py::test_a_restart_kills_a_rank_that_ignores_sigterm_after_the_restart_grace": (
        "13 s"
    ),
    # DeepSpeed's engine started in a process of its own (the config half is quick, the engine is not).
    "tests/runtime/test_gpu_paths.py::test_8_zero_offload_accepts_a_torch_optimizer_on_a_gpu_config": "11 s",
    # The 70B step traced at 64 fake ranks, twice.
    "tests/runtime/test_gpu_paths.py::test_collectives_per_step_of_the_70b_recipe_at_64_ranks": "16 s",
    # Every string field times every payload, target and launcher, each rendered job run against stubs (the
    # three other tests of the file stay: every configuration against the stubs, the head-only launch).
    "tests/test_shell_payloads.py::test_shell_payloads_in_every_string_field_are_refused_located_or_stay_data": "21 s",
    # The generated hostile inputs, each in-process category in full (tests/test_hostile.py: ~1,000 cases through
    # validate, plan and render on every target); test_hostile_sample, a few of each category, stays.
    "tests/test_hostile.py::test_hostile_input": "15 categories, 0.1-15 s each: ~35 s",
}


# The repeat tier (`make test-repeats`, which CI runs after `make test`): tests whose behaviour a cheaper or
# kept test in `make test` already proves through the same product code, each mapped to that test (a key is a
# test, every parametrization, or one parametrization; tests/test_dev_loop.py checks that both exist). What the
# repeat still adds is said beside it; it is not what a change is likely to break unseen.
REPEATS = {
    # The same exclusion path (bad_nodes_after: rc 44 under the job -> ExcNodeList, node1 -> node2, weights,
    # diagnose, status) through the same helper; the runtime's GPU-fault code is test_rt_failures's. Adds: a
    # one-rank variant.
    "tests/slurm/test_bad_nodes.py::test_a_gpu_that_fails_under_the_job_takes_its_node_out_and_the_run_resumes_elsewhere": (
        "tests/slurm/test_bad_nodes.py::test_a_slow_nodes_straggler_is_named_excluded_and_the_run_resumes_elsewhere"
    ),
    # The missing setup fails once with exit 2 and the fix, through the batch part submitit's preamble shares
    # with job.sbatch (test_the_preamble_is_job_sbatchs_batch_part_from_one_template); a bare PATH made whole by
    # setup is test_resubmitting_a_run_by_id_resumes_its_checkpoints's. Adds: the same on job.sbatch itself.
    "tests/slurm/test_operator.py::test_the_environment_comes_from_setup_not_from_the_rendering_machine": (
        "tests/slurm/test_submitit.py::test_without_setup_the_job_fails_once_and_result_says_what_to_do"
    ),
    # USR2 to the batch shell -> checkpoint, 42, requeue, resume with the reference's losses, on job.sbatch: the
    # example's user script goes through the same job.sbatch. Adds: the built-in trainer instead of user code.
    "tests/slurm/test_job_lifecycle.py::test_usr2_to_batch_shell_checkpoints_requeues_and_resumes": (
        "tests/slurm/test_example_slurm.py::test_user_script_survives_a_preemption_on_slurm"
    ),
    # scontrol requeue mid-run -> resume from the checkpoint, the same losses, the goodput ledger's queue time:
    # all asserted by the earlier-job-id test, which requeues the same way. Adds: a run without an earlier job.
    "tests/slurm/test_job_lifecycle.py::test_scontrol_requeue_resumes_from_checkpoint": (
        "tests/slurm/test_job_lifecycle.py::test_a_new_job_with_an_earlier_jobs_id_trains_its_own_run_and_keeps_the_earlier_one"
    ),
    # A truncated newest checkpoint: once found (disk.size_problems, test_rt_units), the path is [same-size]'s;
    # a truncated file ending a job is r01's. Adds: the two together in one world.
    "tests/runtime/test_rt_integrity.py::test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one[truncated]": (
        "tests/runtime/test_rt_hardening.py::test_r01_no_usable_checkpoint_ends_the_job_despite_torchruns_restarts"
    ),
    # No usable checkpoint ends the job with CONFIG and the fix: r01 asserts the same message and codes.
    "tests/runtime/test_rt_integrity.py::test_no_usable_checkpoint_stops_instead_of_starting_over": (
        "tests/runtime/test_rt_hardening.py::test_r01_no_usable_checkpoint_ends_the_job_despite_torchruns_restarts"
    ),
}

README_IN_ORDER = "test_the_readme_in_order_in_one_workspace"  # tests/test_readme.py


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    """Each test gets its own job registry, so tests never see each other's (or the user's) jobs."""
    monkeypatch.setenv("DTLAUNCH_HOME", str(tmp_path / "state"))


@pytest.fixture
def run_cli(capsys):
    """Run the real `dtlaunch` entry point in-process; returns (exit_code, stdout, stderr)."""
    from launcher.cli import main

    def run(*args):
        old = sys.argv
        sys.argv = ["dtlaunch", *map(str, args)]
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = old
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collection imports torch, transformers and hypothesis; with the cyclic garbage collector on, their
    allocations set off full collections over an ever larger heap (~3 s of ~11 s). Off while collecting; then
    what collection built is frozen (it lives to the end anyway), so that the collections during the tests do
    not walk it again (~0.4 s each)."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.enable()
        gc.freeze()


def _full_suite_only(nodeid: str) -> bool:
    return any(nodeid == k or nodeid.startswith((k + "::", k + "[")) for k in FULL_SUITE_ONLY)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The fast tier: each test in it gets the `fast` marker (FULL_SUITE_ONLY above).

    With `-n 2 --dist loadgroup` (make test), each test file runs whole on one worker, so its module-scoped
    worlds are set up once; the SLURM tests run on one worker, against the one local cluster its session
    fixture starts, and the SkyPilot node tests on one worker too."""
    for item in items:
        path = item.path.as_posix()
        # The README's cluster (its slurm-local block, run alone or in order with the others) uses the same
        # node addresses, so its jobs could collide with the tests' jobs on a port.
        if "/tests/slurm/" in path or "slurm-local" in item.nodeid or item.name == README_IN_ORDER:
            group = "slurm"
        elif "/tests/sky/" in path:
            group = "sky"  # simulated VMs on loopback addresses: two node sets at once would share ports
        else:
            group = path
        item.add_marker(pytest.mark.xdist_group(group))
        if item.nodeid in REPEATS or item.nodeid.split("[")[0] in REPEATS:
            item.add_marker(pytest.mark.repeat)
        if not (
            item.get_closest_marker("slow")
            or item.get_closest_marker("gpu")
            or "/tests/gpu/" in path
            or "/tests/slurm/" in path
            or _full_suite_only(item.nodeid)
        ):
            item.add_marker(pytest.mark.fast)


UNGROUPED = pytest.StashKey[str]()


def pytest_collection_finish(session):
    """Notice when xdist's loadgroup did not group (it did not with pytest 9.2, which stopped reading the
    `_nodeid` xdist rewrites): the SLURM tests would then run on two workers, each starting a cluster on the
    same ports and stopping the other's, and fail in confusing ways minutes later."""
    if not getattr(session.config.option, "loadgroup", False):  # only set in an xdist worker under loadgroup
        return
    ungrouped = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if ungrouped:
        session.config.stash[UNGROUPED] = (
            f"pytest-xdist's --dist loadgroup did not group {len(ungrouped)} tests: this pytest and pytest-xdist do "
            "not work together. Use the versions in constraints.txt (make install), or run without -n."
        )


def pytest_runtest_setup(item):
    """Each test fails at once, with the reason, rather than minutes later with a confusing one."""
    msg = item.config.stash.get(UNGROUPED, None)
    if msg:
        pytest.fail(msg, pytrace=False)
