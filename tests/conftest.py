import sys

import pytest


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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """With `-n 2 --dist loadgroup` (make test), each test file runs whole on one worker, so its module-scoped
    worlds are set up once; the SLURM tests run on one worker, against the one local cluster its session
    fixture starts, and the SkyPilot node tests on one worker too."""
    for item in items:
        path = item.path.as_posix()
        if "/tests/slurm/" in path or "slurm-local" in item.nodeid:  # the README's cluster uses the same
            group = "slurm"  # node addresses, so its jobs could collide with the tests' jobs on a port
        elif "/tests/sky/" in path:
            group = "sky"  # simulated VMs on loopback addresses: two node sets at once would share ports
        else:
            group = path
        item.add_marker(pytest.mark.xdist_group(group))


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
            "not work together. Use the versions in constraints.txt (make install), or run without -n.")


def pytest_runtest_setup(item):
    """Each test fails at once, with the reason, rather than minutes later with a confusing one."""
    msg = item.config.stash.get(UNGROUPED, None)
    if msg:
        pytest.fail(msg, pytrace=False)
