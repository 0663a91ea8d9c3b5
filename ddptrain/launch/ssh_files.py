"""The run's files on an SSH host that does not see the run directory (driver side).

Such a host's workers keep their checkpoint files in a private staging folder on the host
(``/tmp/ddptrain-<run id>``, see ``ddptrain._host_scripts.STORAGE_PREP``); the driver copies
them back over the agent's own SSH connection (SFTP) before it commits a checkpoint, and pushes
there the checkpoint to resume from. Every error names the host, and says so when the host had
stopped answering (the driver then dropped the connection, which ended the copy).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import socket
import stat
from collections.abc import Callable, Iterator
from typing import Any

from ddptrain.errors import AgentGoneError, HostLostError, LaunchError, is_disk_full
from ddptrain.launch.host_scripts import STAGING_PREFIX, STORAGE_PREP, one_line

__all__ = ["HostFiles"]

_logger = logging.getLogger(__name__)


def _child_path(folder: str, name: str) -> str | None:
    """``folder/name`` if ``name`` is a plain file name (no ``/``, not ``.`` or ``..``), else ``None``."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        return None
    return os.path.join(folder, name)


class HostFiles:
    """One host's staging folder and checkpoint copies, over its SSH connection.

    Args:
        client: The host's connected paramiko client (the agent's connection).
        host: The host's name, for messages.
        python: Python executable on the host.
        lost: The error that says the host stopped answering, once it did; else ``None``.
    """

    def __init__(self, client: Any, host: str, python: str, lost: Callable[[], HostLostError | None]) -> None:
        self._client = client
        self._host = host
        self._python = python
        self._lost = lost
        self._sftp_client: Any = None
        self.cache_dir: str | None = None  # this run's staging folder, once made

    def _failed(self, doing: str, exc: BaseException) -> LaunchError:
        """The error of an SSH operation that failed: it names the host, and says so when the
        host stopped answering."""
        lost = self._lost()
        if lost is not None:
            return lost
        return LaunchError(f"host {self._host!r}: {doing} failed: {exc!r}", hosts=[self._host])

    @contextlib.contextmanager
    def _doing(self, doing: str) -> Iterator[None]:
        """Errors of the SSH operation inside become :meth:`_failed`'s (a ``LaunchError`` passes)."""
        try:
            yield
        except LaunchError:
            raise
        except Exception as exc:
            raise self._failed(doing, exc) from exc

    def _sftp(self) -> Any:
        import paramiko  # loaded by the connection already: a lookup

        if self._sftp_client is None:
            try:
                self._sftp_client = self._client.open_sftp()
            except paramiko.SSHException as exc:
                transport = self._client.get_transport()
                if self._lost() is not None or transport is None or not transport.is_active():
                    raise self._failed("opening SFTP", exc) from exc  # the connection failed, not SFTP
                raise LaunchError(
                    f"host {self._host!r} cannot see the run directory, so checkpoints are copied over "
                    f"SFTP, but its SSH server refused SFTP ({exc}). Enable the sftp subsystem there, or put "
                    "`storage_path` on a file system the hosts share."
                ) from None
        return self._sftp_client

    def prepare(self, probe: str, run_id: str, agent_pid: int) -> str | None:
        """``None`` if the host sees the run directory (it can read ``probe``, the run's file that
        holds ``run_id``: ``StorageSpec.probe``); else its new staging folder, owned by the agent
        ``agent_pid``. Either way, remove the staging folders of runs whose agent is gone from
        the host (their driver was killed before it could remove them).

        Raises:
            LaunchError: The staging folder exists but is not a private folder of this user, or
                the host could not be asked (the error names it).
        """
        cache = f"{STAGING_PREFIX}{run_id}"
        owner = f"driver {socket.gethostname()} pid {os.getpid()}"
        args = [probe, run_id, cache, str(agent_pid), owner]
        command = shlex.join([self._python, "-I", "-S", "-c", one_line(STORAGE_PREP), *args])
        try:
            _, stdout, stderr = self._client.exec_command(command, timeout=60)
            out, err = stdout.read().decode(errors="replace"), stderr.read().decode(errors="replace")
        except Exception as exc:  # paramiko's, OSError (a timeout), EOFError: the connection failed
            raise self._failed("checking whether it sees the run directory", exc) from exc
        try:
            answer = json.loads(out)
        except ValueError:
            lost = self._lost()  # the connection was dropped while it ran: no answer
            if lost is not None:
                raise lost from None
            stdout.channel.status_event.wait(5.0)  # the exit status follows the output
            status = stdout.channel.exit_status  # -1: none came (the check was killed by a signal)
            if not (out.strip() or err.strip()) and (status == -1 or status > 128):
                raise AgentGoneError(
                    f"host {self._host!r}: its storage check was killed before it answered "
                    f"({'no exit status' if status == -1 else f'exit status {status}'})"
                ) from None
            said = err.strip() or out.strip() or "it said nothing"
            raise LaunchError(
                f"host {self._host!r}: cannot prepare its storage (the check's exit status {status}): {said}"
            ) from None
        if answer.get("error"):
            raise LaunchError(f"host {self._host!r}: {answer['error']}")
        if answer["shared"]:
            return None
        self.cache_dir = cache  # removed from the host by `close`
        return cache

    def fetch_dir(self, remote: str, local: str) -> None:
        """Copy a folder from the host to this machine (recursively), then delete it there.

        Raises:
            LaunchError: The host listed a name that is not a plain file name (``..``, an absolute
                path, a ``/``): a compromised host must not write outside ``local``. Or the copy
                failed: the error names the host (:class:`HostLostError` if it stopped answering).
        """
        try:
            self._fetch(remote, local)
            self._client.exec_command(f"rm -rf -- {shlex.quote(remote)}")[1].channel.recv_exit_status()
        except LaunchError:
            raise
        except Exception as exc:  # paramiko's, OSError, EOFError: mostly, the connection failed
            if is_disk_full(exc):
                raise  # this machine's disk: the caller names the file
            raise self._failed(f"copying {remote} back to this machine", exc) from exc

    def _fetch(self, remote: str, local: str) -> None:
        sftp = self._sftp()
        os.makedirs(local, exist_ok=True)
        for entry in sftp.listdir_attr(remote):
            target = _child_path(local, entry.filename)
            if target is None:
                raise LaunchError(
                    f"host {self._host!r} listed {entry.filename!r} in {remote}, which is not a plain file "
                    f"name; refusing to copy it to {local}."
                )
            source = f"{remote}/{entry.filename}"
            if stat.S_ISDIR(entry.st_mode or 0):
                self._fetch(source, target)
            else:
                sftp.get(source, target)

    def push_dir(self, local: str, remote: str) -> None:
        """Copy a folder from this machine to the host (recursively).

        Raises:
            LaunchError: The copy failed (it names the host).
        """
        with self._doing(f"copying {local} to it"):
            self._push(local, remote)

    def _push(self, local: str, remote: str) -> None:
        sftp = self._sftp()
        self._client.exec_command(f"mkdir -p -- {shlex.quote(remote)}")[1].channel.recv_exit_status()
        for name in os.listdir(local):
            source, target = os.path.join(local, name), f"{remote}/{name}"
            if os.path.isdir(source):
                self._push(source, target)
            else:
                sftp.put(source, target)

    # ----------------------------------------------------------------- a private folder of one program
    def make_private_dir(self, remote: str) -> None:
        """Create the folder ``remote`` (a fresh, unguessable name), private to the SSH user (0700).

        Raises:
            LaunchError: It exists already, or could not be made (the error names the host).
        """
        with self._doing(f"creating the private folder {remote}"):
            self._sftp().mkdir(remote, 0o700)  # fails if it exists: nobody else's folder is used
            self._sftp().chmod(remote, 0o700)  # whatever the SFTP server's umask did

    def write_file(self, remote: str, data: bytes) -> None:
        """Write ``data`` to the file ``remote`` on the host (in a folder of :meth:`make_private_dir`)."""
        with self._doing(f"writing {remote}"), self._sftp().open(remote, "wb") as f:
            f.write(data)

    def read_file(self, remote: str) -> bytes | None:
        """The content of the file ``remote`` on the host; ``None`` if it cannot be read there
        (missing, not this user's). A failed connection raises (the error names the host)."""
        with self._doing(f"reading {remote}"):
            try:
                with self._sftp().open(remote, "rb") as f:
                    return bytes(f.read())
            except (FileNotFoundError, PermissionError):  # as paramiko raises SFTP's own answers
                return None

    def remove_dir(self, remote: str, timeout_s: float) -> None:
        """Remove the folder ``remote`` and what it holds from the host, waiting up to ``timeout_s``.

        Raises:
            LaunchError: The connection failed (the error names the host).
        """
        with self._doing(f"removing {remote}"):
            channel = self._client.get_transport().open_session()
            try:
                channel.exec_command(f"rm -rf -- {shlex.quote(remote)}")
                channel.status_event.wait(timeout_s)
            finally:
                channel.close()

    def close(self) -> None:
        """Remove the staging folder from the host (one that stopped answering keeps it: the
        next run there removes it), and close SFTP."""
        if self.cache_dir is not None and self._lost() is not None:
            _logger.info("ddptrain: %s stays on %s, which stopped answering", self.cache_dir, self._host)
        elif self.cache_dir is not None:
            try:
                self._client.exec_command(f"rm -rf -- {shlex.quote(self.cache_dir)}")[1].channel.recv_exit_status()
            except Exception as exc:
                _logger.warning("ddptrain: could not remove %s on %s: %s", self.cache_dir, self._host, exc)
        if self._sftp_client is not None:
            self._sftp_client.close()
