"""Run SLURM commands on a login node over SSH (paramiko), and ship the rendered files there by SFTP.

Security choices, on purpose: the host key must be in known_hosts (RejectPolicy) unless the recipe says
`accept_unknown_host: true`; authentication is by key file or agent only, never a password; every
remote command is built with shlex quoting, so paths and ids can never become shell code.
"""

from __future__ import annotations

import os
import posixpath
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from ...errors import BackendError
from .spec import SshSpec

if TYPE_CHECKING:
    import paramiko  # imported when connecting: it is an optional dependency (dtlaunch[slurm])


def _remote_path(path: str) -> str:
    """`~/x` -> `x`: relative paths resolve against the login directory, both in SFTP and in the
    remote shell (which starts there), and a quoted `~` would not expand."""
    if path == "~":
        return "."
    return path[2:] if path.startswith("~/") else path


class SshTransport:
    def __init__(self, spec: SshSpec | dict):
        self.spec = spec if isinstance(spec, SshSpec) else msgspec.convert(spec, SshSpec)
        self._client: paramiko.SSHClient | None = None

    @property
    def where(self) -> str:
        s = self.spec
        return f"{s.user + '@' if s.user else ''}{s.host}:{s.port}"

    def connect(self) -> paramiko.SSHClient:
        if self._client is not None:
            return self._client
        try:
            import paramiko
        except ImportError:
            raise BackendError("paramiko is not installed: pip install 'dtlaunch[slurm]' to submit over ssh") from None
        s = self.spec
        client = paramiko.SSHClient()
        try:
            if s.known_hosts:
                client.load_host_keys(os.path.expanduser(s.known_hosts))
            else:
                client.load_system_host_keys()
        except (OSError, paramiko.SSHException) as e:
            raise BackendError(f"cannot read known_hosts {s.known_hosts or '~/.ssh/known_hosts'}: {e}") from None
        client.set_missing_host_key_policy(
            paramiko.AutoAddPolicy() if s.accept_unknown_host else paramiko.RejectPolicy()
        )
        try:
            client.connect(
                s.host,
                port=s.port,
                username=s.user,
                key_filename=os.path.expanduser(s.key_file) if s.key_file else None,
                allow_agent=True,
                look_for_keys=s.key_file is None,
                password=None,
                timeout=20,
                auth_timeout=20,
            )
        except paramiko.BadHostKeyException as e:
            raise BackendError(
                f"ssh {self.where}: the host key CHANGED ({e}); refusing to connect. "
                "If the host was reinstalled, update known_hosts after checking the fingerprint."
            ) from None
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                raise BackendError(
                    f"ssh {self.where}: host key is not in {s.known_hosts or '~/.ssh/known_hosts'}; refusing to connect. "
                    f"Check its fingerprint and add it (ssh-keyscan -p {s.port} {s.host}), or set "
                    "targets.slurm.ssh.accept_unknown_host: true"
                ) from None
            raise BackendError(f"ssh {self.where}: {e} (authentication uses key_file or the ssh agent only)") from None
        except OSError as e:
            raise BackendError(f"ssh {self.where}: cannot connect: {e}") from None
        self._client = client
        return client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def run(self, argv: Sequence[str], cwd: str | None = None, timeout: float = 120) -> tuple[int, str, str]:
        """Run argv (quoted word by word) in cwd on the remote host; returns (rc, stdout, stderr)."""
        cmd = " ".join(shlex.quote(a) for a in argv)
        if cwd:
            cmd = f"cd {shlex.quote(_remote_path(cwd))} && {cmd}"
        try:
            _, out, err = self.connect().exec_command(cmd, timeout=timeout)
            o, e = out.read().decode(errors="replace"), err.read().decode(errors="replace")
            return out.channel.recv_exit_status(), o, e
        except (TimeoutError, OSError, EOFError) as e:  # socket.timeout is a TimeoutError
            raise BackendError(
                f"ssh {self.where}: `{argv[0]}` did not complete ({type(e).__name__}: {e})",
                fix="check the login node and its SLURM controller, then try again",
            ) from None

    def upload(self, files: dict[str, str | bytes], executable: set[str], remote_dir: str) -> str:
        """Write the files under remote_dir (created); return its absolute path."""
        sftp = self.connect().open_sftp()
        try:
            base = _remote_path(remote_dir)
            self._mkdirs(sftp, base)
            for rel, content in files.items():
                path = posixpath.join(base, rel)
                self._mkdirs(sftp, posixpath.dirname(path))
                with sftp.open(path, "w") as f:
                    f.write(content if isinstance(content, bytes) else content.encode())
                sftp.chmod(path, 0o755 if rel in executable else 0o644)
            return sftp.normalize(base)
        except OSError as e:
            raise BackendError(f"ssh {self.where}: cannot write {remote_dir}: {e}") from None
        finally:
            sftp.close()

    def read(self, path: str, offset: int = 0) -> bytes | None:
        """The file's bytes from offset, or None if it does not exist (yet)."""
        sftp = self.connect().open_sftp()
        try:
            with sftp.open(_remote_path(path), "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return None
        except OSError:
            return None
        finally:
            sftp.close()

    @staticmethod
    def _mkdirs(sftp, path: str) -> None:
        if path in ("", ".", "/"):
            return
        try:
            sftp.stat(path)
            return
        except FileNotFoundError:
            pass
        SshTransport._mkdirs(sftp, posixpath.dirname(path))
        sftp.mkdir(path)
