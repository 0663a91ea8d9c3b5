"""One program at a time on an SSH host, in a private folder of its own (driver side).

Used for the run's validations on a listed host (``ValidationConfig(host=...)``).
:class:`SSHHost` is the run's one connection to the host, opened at the first program (bounded
by ``DDPTRAIN_SSH_CONNECT_TIMEOUT_S``) and again after it was lost. :class:`SSHProcess` is one
program there; a thread of its own runs its whole life, so that nothing the driver does waits
on the network: it creates a fresh private folder (``/tmp/ddptrain-<kind>-<random>``, 0700)
by SFTP, lets its caller put the program's files there (:data:`Setup`), starts the program
exactly as the agent is started (``remote_command``: the environment goes over stdin, never
on the command line), copies its output (stdout and stderr) to a local file, waits for it to
end, reads its result file back and removes the folder.

The program's stdin stays open while it runs, and a heartbeat byte goes down it every
``ALIVE_S`` (as to an agent): closing it is how :meth:`SSHProcess.kill` ends it, and the
connection dropping (the driver died, its sshd was killed) closes it too. A link that went
down closes nothing on the host, so the program must end itself and what it started when its
stdin ends or stays silent for ``DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S``
(``ddptrain.driver.validation_child`` does). The driver's reads on such a link end within twice
that (``ssh_connect``), and the process then fails with the connection lost.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from ddptrain import _env
from ddptrain.errors import LaunchError
from ddptrain.launch.host_scripts import PID_LINE, env_frame
from ddptrain.launch.hosts import HostSpec
from ddptrain.launch.ssh_connect import connect, remote_command
from ddptrain.launch.ssh_files import HostFiles
from ddptrain.wire.protocol import ALIVE_S

__all__ = ["SSHHost", "SSHProcess", "Setup"]

_logger = logging.getLogger(__name__)

# What goes into the private folder before the program starts: called in the process's thread
# with the host's files and the folder; returns the files to write there (name -> bytes).
Setup = Callable[[HostFiles, str], dict[str, bytes]]

_CLEANUP_S = 10.0  # for removing the folder from a host that answers


class SSHHost:
    """The run's SSH connection to ``host``, for programs run there one after another.

    Args:
        host: The host (after ``~/.ssh/config`` lookups).
        env: The programs' environment (sent over stdin).
        python: Python executable on the host.
        workdir: Working directory of the programs on the host.

    Raises:
        ConfigError: A variable of ``env`` cannot be passed (see ``env_frame``).
    """

    def __init__(self, host: HostSpec, env: dict[str, str], python: str, workdir: str | None) -> None:
        self.host = host
        self.name = host.name
        self.python = python
        self.workdir = workdir
        self.frame = env_frame(env)
        self._lock = threading.Lock()
        self._client: Any = None
        self._closed = False

    def client(self) -> Any:
        """The connected paramiko client: the open one, or a new one (bounded by
        ``DDPTRAIN_SSH_CONNECT_TIMEOUT_S``).

        Raises:
            LaunchError: The host cannot be reached or logged in to (the error names it), or
                :meth:`close` was called.
        """
        with self._lock:
            client = self._client
            transport = client.get_transport() if client is not None else None
            if transport is not None and transport.is_active():
                return client
        fresh = connect(self.host, _env.ssh_connect_timeout_s())  # not under the lock: close() never waits on it
        with self._lock:
            closed, old = self._closed, self._client
            if not closed:
                self._client = fresh
        if old is not None:
            old.close()
        if closed:
            fresh.close()
            raise LaunchError(f"host {self.name!r}: the run's connection to it was closed", hosts=[self.name])
        return fresh

    def close(self) -> None:
        """Close the connection (what runs over it sees its stdin end). Safe to call twice."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()


class SSHProcess:
    """One program on an :class:`SSHHost`, in a private folder of its own, run by a thread.

    Args:
        host: The host's connection.
        kind: A word for the folder's name and the thread's (``validation``).
        setup: Puts the program's files in its folder (see :data:`Setup`).
        program: The program's command line, given its folder.
        log: The local file its output is appended to.
        result: The name of the file in its folder that holds its result.
    """

    def __init__(
        self,
        host: SSHHost,
        kind: str,
        setup: Setup,
        program: Callable[[str], list[str]],
        log: str,
        result: str,
    ) -> None:
        self.host = host
        self.folder = f"/tmp/ddptrain-{kind}-{secrets.token_hex(12)}"
        self.returncode: int | None = None  # once ended: the program's exit status (None: a signal, or none)
        self.result: bytes | None = None  # once ended: its result file, if it wrote one
        self.error: str | None = None  # once ended: why it did not run to its end (not started, connection lost)
        self._setup = setup
        self._program = program
        self._log = log
        self._result_name = result
        self._lock = threading.Lock()
        self._killed = False
        self._files: HostFiles | None = None
        self._channel: Any = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ddptrain-{kind}-{host.name}", daemon=True)
        self._thread.start()

    def ended(self) -> bool:
        """Whether it ended (and its result was read back, its folder removed). Never blocks."""
        return self._done.is_set()

    def kill(self, timeout_s: float) -> None:
        """End it: close its stdin (the program then kills itself and what it started, and
        removes its folder), or stop its setup; wait up to ``timeout_s`` for it to end (its
        thread then reads back what is left and removes the folder: :meth:`wait`)."""
        with self._lock:
            self._killed = True
            channel, files = self._channel, self._files
        if channel is not None:
            try:
                channel.shutdown_write()
            except (OSError, EOFError):
                pass
            deadline = time.monotonic() + timeout_s
            while not (channel.status_event.is_set() or self._done.is_set()) and time.monotonic() < deadline:
                self._done.wait(0.05)
            if not (channel.status_event.is_set() or self._done.is_set()):
                _logger.warning("ddptrain: the program on host %r did not end in %.0f s", self.host.name, timeout_s)
                channel.close()  # sshd closes its stdin too
            return
        if files is not None:
            files.close()  # stops a copy in progress: its thread then ends
        self._done.wait(timeout_s)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for its thread to be done (result read, folder removed)."""
        return self._done.wait(timeout_s)

    # ----------------------------------------------------------------- its thread
    def _run(self) -> None:
        made = False
        try:
            client = self.host.client()
            files = HostFiles(client, self.host.name, self.host.python, lambda: None)
            with self._lock:
                self._files = files
            if self._killed:
                return
            files.make_private_dir(self.folder)
            made = True
            for name, data in self._setup(files, self.folder).items():
                files.write_file(f"{self.folder}/{name}", data)
            channel = client.get_transport().open_session()
            with self._lock:
                if self._killed:
                    channel.close()
                    return
                self._channel = channel
            channel.set_combine_stderr(True)
            channel.exec_command(remote_command(self.host.python, self.host.workdir, self._program(self.folder)))
            try:
                channel.sendall(self.host.frame)
            except OSError:
                pass  # it ended already (no such directory or python): its output says why
            if self._killed:
                channel.shutdown_write()
            self._copy_output(channel)
            if channel.status_event.wait(5.0):
                code = int(channel.recv_exit_status())
                self.returncode = None if code == -1 else code
            if not client.get_transport().is_active():
                self.error = f"the connection to host {self.host.name!r} was lost while it ran"
            else:
                self.result = files.read_file(f"{self.folder}/{self._result_name}")
        except LaunchError as exc:
            self.error = str(exc)
        except Exception as exc:  # paramiko's, OSError, EOFError: the connection failed
            self.error = f"host {self.host.name!r}: {type(exc).__name__}: {exc}"
        finally:
            try:
                self._clean(made)
            finally:
                if self.error is not None and not self._killed:
                    self._say(f"ddptrain: {self.error}\n")  # its log says why it has no output
                self._done.set()

    def _say(self, text: str) -> None:
        try:
            with open(self._log, "a") as out:
                out.write(text)
        except OSError as exc:
            _logger.warning("ddptrain: cannot write %s: %s", self._log, exc)

    def _copy_output(self, channel: Any) -> None:
        """Append the program's output to the log file until it ends (the first line, the
        pid that ``PRESTART`` prints, is left out), and send it a heartbeat byte every
        ``ALIVE_S`` meanwhile, whether it prints or not."""
        head: bytes | None = b""
        channel.settimeout(ALIVE_S)
        sent = time.monotonic()
        with open(self._log, "ab") as out:
            while True:
                if time.monotonic() - sent >= ALIVE_S:
                    sent = time.monotonic()
                    try:
                        channel.send(b"\0")  # after `kill`'s EOF: sends nothing
                    except OSError:
                        pass  # closed: the next read says it ended
                try:
                    data = channel.recv(65536)
                except TimeoutError:  # socket.timeout
                    continue
                if not data:
                    break
                if head is not None:
                    head += data
                    if PID_LINE.startswith(head[: len(PID_LINE)]) and b"\n" not in head:
                        continue  # maybe the pid line, not whole yet
                    if head.startswith(PID_LINE):
                        head = head.split(b"\n", 1)[1]
                    data, head = head, None
                out.write(data)
                out.flush()
            if head:
                out.write(head)

    def _clean(self, made: bool) -> None:
        with self._lock:
            files, self._files = self._files, None
            channel = self._channel
        try:
            if made and files is not None:
                files.remove_dir(self.folder, _CLEANUP_S)
        except LaunchError as exc:  # the program removes it itself once its stdin ends
            _logger.info("ddptrain: %s", exc)
        finally:
            if files is not None:
                files.close()
            if channel is not None:
                channel.close()
