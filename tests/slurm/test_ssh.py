"""Submission over SSH to a real sshd on loopback (own host key, config, client key), and host-key refusal."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from launcher.errors import BackendError
from launcher.targets.slurm.backend import SlurmBackend
from slurmkit import render_to, wait_for, wait_gone


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(scope="module")
def sshd(tmp_path_factory, slurm):
    """A private sshd on 127.0.0.1:<free port>: key auth only, its SLURM_CONF set for sessions."""
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host", "client", "other"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "client.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    port = _free_port()
    (d / "sshd_config").write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {d / "host"}
PidFile {d / "sshd.pid"}
AuthorizedKeysFile {d / "authorized_keys"}
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
Subsystem sftp internal-sftp
SetEnv SLURM_CONF={os.environ["SLURM_CONF"]}
""")
    host_pub = (d / "host.pub").read_text().split()
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    other_pub = (d / "other.pub").read_text().split()
    (d / "wrong_known_hosts").write_text(f"[127.0.0.1]:{port} {other_pub[0]} {other_pub[1]}\n")
    (d / "empty_known_hosts").write_text("")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    proc = subprocess.Popen(
        ["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")],
        stdout=subprocess.DEVNULL,
        stderr=open(d / "sshd.log", "w"),
    )

    def up():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            assert proc.poll() is None, (d / "sshd.log").read_text()
            return False

    wait_for(up, 15, "sshd to listen")
    yield {"dir": d, "port": port}
    proc.terminate()
    proc.wait(10)


def _ssh_overrides(sshd, partition, known_hosts="known_hosts", remote_dir=None):
    d = sshd["dir"]
    spec = (
        f"{{host: 127.0.0.1, port: {sshd['port']}, user: root, key_file: '{d / 'client'}', "
        f"known_hosts: '{d / known_hosts}', remote_dir: '{remote_dir or d / 'remote'}'}}"
    )
    return [
        f"targets.slurm.partition={partition}",
        f"targets.slurm.ssh={spec}",
        "targets.slurm.extra_sbatch=['--hold']",
    ]


def test_submit_status_cancel_over_ssh(sshd, partition, tmp_path):
    _, art = render_to(tmp_path / "local", "tiny", _ssh_overrides(sshd, partition))
    be = SlurmBackend(poll_seconds=0.5)
    t0 = time.time()
    rec = be.submit(art, str(tmp_path / "local"))
    submit_s = time.time() - t0
    remote = Path(rec.run_dir)
    assert remote.parent == sshd["dir"] / "remote" and remote.name.startswith("tiny-")
    assert (remote / "job.sbatch").read_text() == art.files["job.sbatch"]
    assert os.access(remote / "job.sbatch", os.X_OK) and (remote / "plan.json").exists()
    assert rec.handle.ssh["host"] == "127.0.0.1"
    st = be.status(rec).to_dict()
    assert st["state"] == "PENDING" and st["source"] == "squeue", st
    be.cancel(rec)
    wait_gone(rec.job_id, 30)
    st = wait_for(lambda: (s := be.status(rec).to_dict())["state"] == "CANCELLED" and s, 30, "sacct over ssh")
    assert st["source"] == "sacct"
    print(f"ssh submit (connect + sftp + sbatch): {submit_s:.2f}s")


@pytest.mark.parametrize("known_hosts", ["wrong_known_hosts", "empty_known_hosts"])
def test_unknown_or_changed_host_key_is_refused(sshd, partition, tmp_path, known_hosts):
    _, art = render_to(
        tmp_path / "local", "tiny", _ssh_overrides(sshd, partition, known_hosts, remote_dir=str(tmp_path / "remote"))
    )
    with pytest.raises(BackendError, match="refusing to connect"):
        SlurmBackend().submit(art, str(tmp_path / "local"))
    assert not (tmp_path / "remote").exists()  # nothing was copied


def test_ssh_submission_uploads_the_users_code(sshd, partition, tmp_path):
    """entrypoint.workdir travels with an SSH submission as code/ (bytes as they are), beside job.sbatch."""
    from launcher.plan import make_plan
    from launcher.recipe import load
    from launcher.render import render

    example = Path(__file__).resolve().parents[2] / "examples" / "plain-pytorch"
    r = load(example / "recipe.yaml", _ssh_overrides(sshd, partition))
    art = render(r, make_plan(r), "slurm")
    rec = SlurmBackend(poll_seconds=0.5).submit(art, str(tmp_path / "local"))
    try:
        remote = Path(rec.run_dir)
        assert (remote / "code" / "train.py").read_bytes() == (example / "train.py").read_bytes()
        assert 'export DTLAUNCH_CODE_DIR="$SUBMIT_DIR/code"' in (remote / "job.sbatch").read_text()
    finally:
        SlurmBackend().cancel(rec)
