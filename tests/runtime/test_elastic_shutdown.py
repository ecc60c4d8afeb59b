"""torch elastic's real shutdown path, the one `--shutdown-timeout` governs (C05).

A signal to the agent (`python -m launcher.runtime.elastic`, torchrun's own code) is passed to the workers; the agent
then waits `--shutdown-timeout` seconds and SIGKILLs whatever is still running. A worker acts on the signal at
its next step boundary and then saves, so the grace must cover a step and a save: a worker that needs longer
is killed before it commits and writes no exit record. The rendered grace is made of exactly those terms.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.plan import make_plan
from launcher.recipe import load
from launcher.render.torchrun import MIN_GRACE_SECONDS, STEP_TIME_MARGIN, grace_seconds
from rt_harness import free_port
from testpaths import RECIPES

# A worker that, once signalled, finishes a "step and a save" of NEED seconds, then writes its exit record.
WORKER = """import os, signal, sys, time
out, need = sys.argv[1], float(sys.argv[2])
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
open(out + ".started", "w").close()
while not stop:
    time.sleep(0.05)
time.sleep(need)
open(out, "w").write("committed")
sys.exit(42)
"""


def _stop_after(tmp_path: Path, grace: int, need: float) -> tuple[int, bool, float]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    record = tmp_path / f"record-{grace}-{need}"
    cmd = [
        sys.executable,
        "-m",
        "launcher.runtime.elastic",
        "--nnodes=1",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--max-restarts=0",
        "--signals-to-handle=SIGTERM,SIGUSR2",
        f"--shutdown-timeout={grace}",
        str(script),
        str(record),
        str(need),
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while not Path(str(record) + ".started").exists():
        assert time.time() < deadline and p.poll() is None, p.communicate()[0]
        time.sleep(0.1)
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    return p.returncode, record.exists(), time.time() - t0


def test_a_worker_within_the_grace_commits_and_one_beyond_it_is_killed(tmp_path):
    rc, committed, took = _stop_after(tmp_path, grace=8, need=2)
    assert committed and took < 8, (rc, took)
    rc, committed, took = _stop_after(tmp_path, grace=2, need=6)
    assert not committed and took < 6, (rc, took)  # SIGKILLed at the grace: no exit record


@pytest.mark.parametrize("name", ["llama2-13b-zero3", "llama70b", "llama3-405b"])
def test_the_rendered_grace_covers_a_step_a_save_and_the_exit(name):
    """On the shipped recipes: the worst case is a signal just after a step began (the whole step, with the
    margin on the plan's estimate), then the save; llama2-13b-zero3 rendered 148 s for a 123 s step plus a
    39 s save."""
    r = load(RECIPES / f"{name}.yaml")
    p = make_plan(r)
    g = grace_seconds(r, p)
    assert g >= max(MIN_GRACE_SECONDS, math.ceil(STEP_TIME_MARGIN * p.step_seconds + p.checkpoint_write_seconds + 30))
    assert g >= p.step_seconds + p.checkpoint_write_seconds + 30
    assert r.targets.slurm.signal_seconds >= g, (r.targets.slurm.signal_seconds, g)  # USR2 early enough to stop


# Two workers: on the first attempt rank 1 fails and rank 0 cannot act on SIGTERM (as a rank hung in a
# collective or a kernel); on the restart both record when they started.
RESTARTED = """import os, signal, sys, time
out, rank = sys.argv[1], int(os.environ["RANK"])
if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
    open(f"{out}.restarted-{rank}", "w").write(repr(time.time()))
    sys.exit(0)
if rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(out + ".hung", "w").close()
    time.sleep(600)
while not os.path.exists(out + ".hung"):
    time.sleep(0.05)
open(out + ".failed", "w").write(repr(time.time()))
sys.exit(1)
"""


def test_a_restart_kills_a_rank_that_ignores_sigterm_after_the_restart_grace(tmp_path):
    """A worker failed and torchrun restarts the group: the survivor that cannot act on SIGTERM is SIGKILLed
    after jobenv.RESTART_GRACE_S, not after torchrun's 30 s; the preemption path keeps --shutdown-timeout."""
    from launcher.jobenv import RESTART_GRACE_S

    script, out = tmp_path / "worker.py", tmp_path / "w"
    script.write_text(RESTARTED)
    cmd = [
        sys.executable,
        "-m",
        "launcher.runtime.elastic",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--max-restarts=1",
        "--monitor-interval=0.2",
        "--shutdown-timeout=120",
        str(script),
        str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    failed = float((tmp_path / "w.failed").read_text())
    restarted = min(float((tmp_path / f"w.restarted-{r}").read_text()) for r in (0, 1))
    assert RESTART_GRACE_S <= restarted - failed < 30 - 5, restarted - failed
