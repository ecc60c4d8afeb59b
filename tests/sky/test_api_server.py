"""SkyPilot's local API server: `up -t sky` (and status, logs, down) says before it starts one, and stops only
the one it started, when the command ends.

The fast tests stand in for the server with `FakeServer` at the backend's seam (`_Sdk(server=...)`,
`_ServerGuard`): starting SkyPilot's real server takes 20-30 s here, too slow for the fast tier, and no cloud
account exists to make the server do anything. What the fake replaces is only the four questions the guard asks
(would the SDK start one, start it, does it run job controllers, stop it); the guard's decisions are the real
code. The probe itself (`_ApiServer.would_start`) runs against SkyPilot's real functions on a port where nothing
listens, and the slow test at the end starts and stops SkyPilot's real server in a private HOME on a free port.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launcher.targets.sky.backend import STARTING, _ApiServer, _Sdk, _ServerGuard

ROOT = Path(__file__).resolve().parents[2]


class FakeServer:
    """SkyPilot's local API server as the guard sees it; records what was asked, and what stderr held when the
    server was started (the line must come before)."""

    def __init__(self, capsys, *, running=False, wins_race=True, controllers=False, stop_fails=False):
        self.capsys, self.running, self.wins_race = capsys, running, wins_race
        self.controllers, self.stop_fails = controllers, stop_fails
        self.calls: list[str] = []
        self.stderr_at_start = ""

    def would_start(self):
        self.calls.append("probe")
        return not self.running

    def check_allowed(self):
        self.calls.append("check_allowed")

    def start(self):
        self.calls.append("start")
        self.stderr_at_start = self.capsys.readouterr().err
        self.running = True
        return self.wins_race  # False: another process started it first, under SkyPilot's creation lock

    def runs_job_controllers(self):
        return self.controllers

    def stop(self):
        self.calls.append("stop")
        if self.stop_fails:
            raise RuntimeError("permission denied")
        self.running = False


@pytest.fixture
def exit_hooks(monkeypatch):
    """atexit's registrations, recorded instead of made (a hook left in pytest's own exit would stop nothing)."""
    hooks: list = []
    monkeypatch.setattr(atexit, "register", hooks.append)
    monkeypatch.setattr(atexit, "unregister", lambda f: hooks.remove(f) if f in hooks else None)
    return hooks


def test_no_server_running_says_so_first_then_stops_the_one_it_started_at_exit(capsys, exit_hooks):
    server = FakeServer(capsys)
    guard = _ServerGuard(server)
    guard.open()
    assert server.stderr_at_start.strip() == STARTING  # said before the start, on stderr, in one line
    assert "stops it when the command ends" in STARTING
    assert server.running and guard.started and exit_hooks == [guard.close]
    for hook in list(exit_hooks):  # the process ends
        hook()
    assert not server.running and server.calls == ["probe", "check_allowed", "start", "stop"]
    assert exit_hooks == [] and capsys.readouterr().out == ""
    guard.close()  # twice: nothing more
    assert server.calls.count("stop") == 1


def test_a_server_already_running_is_neither_announced_nor_stopped(capsys, exit_hooks):
    server = FakeServer(capsys, running=True)
    guard = _ServerGuard(server)
    guard.open()
    guard.close()
    assert server.running and server.calls == ["probe"] and exit_hooks == []
    assert capsys.readouterr().err == ""


def test_a_server_another_process_started_first_is_not_stopped(capsys, exit_hooks):
    """Two dtlaunch commands at once: both saw no server, SkyPilot's lock let one start it; the other must not
    stop it under the first one's feet."""
    server = FakeServer(capsys, wins_race=False)
    guard = _ServerGuard(server)
    guard.open()
    guard.close()
    assert server.running and "stop" not in server.calls and exit_hooks == []


def test_a_server_running_managed_job_controllers_is_left_running_and_the_line_says_so(capsys, exit_hooks):
    server = FakeServer(capsys, controllers=True)
    guard = _ServerGuard(server)
    guard.open()
    capsys.readouterr()
    exit_hooks[0]()
    assert server.running and "stop" not in server.calls
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "left SkyPilot's API server running" in err and "sky api stop" in err


def test_a_failed_stop_is_one_line_not_a_traceback(capsys, exit_hooks):
    server = FakeServer(capsys, stop_fails=True)
    guard = _ServerGuard(server)
    guard.open()
    capsys.readouterr()
    guard.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not stop" in err and "permission denied" in err and "sky api stop" in err


def test_the_sdk_seam_guards_the_server_before_its_first_call(capsys, exit_hooks, sky_lib):
    """`_Sdk` (what SkyBackend builds for submit, status, logs and cancel) opens the guard in its constructor,
    before any SDK call could start a server on its own; close() (or the exit hook) stops it."""
    server = FakeServer(capsys)
    sdk = _Sdk(server=server)
    assert server.stderr_at_start.strip() == STARTING and exit_hooks == [sdk.server.close]
    sdk.close()
    assert server.calls[-1] == "stop" and not server.running and exit_hooks == []

    quiet = FakeServer(capsys, running=True)
    _Sdk(server=quiet).close()
    assert quiet.calls == ["probe"] and capsys.readouterr().err == ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _endpoint(monkeypatch, url: str, port: int):
    """Point SkyPilot's client at an endpoint; its URL and health answers are cached process-wide: cleared."""
    from sky.server import common

    def clear():
        common.get_server_url.cache_clear()
        common.is_api_server_local.cache_clear()
        common.get_api_server_status_response.cache_clear()

    try:
        with monkeypatch.context() as m:
            m.setenv("SKYPILOT_API_SERVER_LOCAL_PORT", str(port))
            m.setenv("SKYPILOT_API_SERVER_ENDPOINT", url)
            clear()
            yield
    finally:
        clear()  # with the environment restored


def test_the_probe_uses_skypilots_own_answers(monkeypatch, sky_lib):
    """The real probe, no server: a local endpoint where nothing listens is one the SDK would start a server
    for; a remote endpoint never is (nothing is sent to it: SkyPilot decides from the URL alone)."""
    port = _free_port()
    with _endpoint(monkeypatch, f"http://127.0.0.1:{port}", port):
        assert _ApiServer().would_start() is True
    with _endpoint(monkeypatch, "http://skypilot.example.invalid:46580", port):
        assert _ApiServer().would_start() is False


def test_the_cli_still_never_imports_sky():
    code = "import sys; import launcher.cli, launcher.targets.sky.backend; print('sky' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _server_processes(port: int) -> list[int]:
    import psutil

    pids = []
    for p in psutil.process_iter(attrs=["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "sky.server.server" in cmd and f"--port={port}" in cmd:
            pids.append(p.info["pid"])
    return pids


def _python(env, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow
def test_real_local_server_started_by_dtlaunch_is_stopped_and_one_already_running_is_not(tmp_path):
    """SkyPilot's real API server (20-30 s to start here), in a private HOME on a free port. A process that
    builds the backend's `_Sdk` with no server running prints the line and, on exiting, stops the server it
    started; with a server already running (`sdk.api_start()` from another process), it prints nothing and
    leaves it running."""
    port = _free_port()
    env = {**os.environ, "HOME": str(tmp_path), "SKYPILOT_API_SERVER_LOCAL_PORT": str(port)}
    env.pop("SKYPILOT_API_SERVER_ENDPOINT", None)
    dtlaunch = "from launcher.targets.sky.backend import _Sdk; print('started', _Sdk().server.started)"
    try:
        first = _python(env, dtlaunch)
        assert first.returncode == 0, first.stderr
        assert "started True" in first.stdout and first.stderr.count(STARTING) == 1
        deadline = time.time() + 30
        while _server_processes(port) and time.time() < deadline:
            time.sleep(0.5)
        assert _server_processes(port) == []  # stopped at the process's exit

        started = _python(env, "from sky.client import sdk; sdk.api_start()")
        assert started.returncode == 0 and _server_processes(port), started.stdout + started.stderr
        second = _python(env, dtlaunch)
        assert second.returncode == 0, second.stderr
        assert "started False" in second.stdout and STARTING not in second.stderr
        assert _server_processes(port)  # not ours: still running
    finally:
        if _server_processes(port):
            _python(env, "from sky.client import sdk; sdk.api_stop()")
        assert _server_processes(port) == []
