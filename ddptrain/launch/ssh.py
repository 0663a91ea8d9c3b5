"""Starting one host's workers over SSH (driver side), with paramiko.

One SSH connection per host runs the agent (``ddptrain._agent_start.agent_command``) without a pty;
the agent's stdin, stdout and stderr are the channel's. The driver first sends the forwarded
environment over stdin (never on the command line, which every user of the host can see), then
the bootstrap (function and secret); it reads framed output and exit events from stdout, and
sends a heartbeat byte every half second: the agent kills its whole process tree when stdin
closes (the connection dropped, the driver died) or when heartbeats stop (a host or network that
vanished without closing the connection). The agent says it is alive as often; a host from which
nothing came for ``DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S`` is declared lost and its connection dropped
(``AgentSession``), so nothing waits on it any longer; if the host still says that its agent
is stopped by a signal (SIGSTOP, a debugger), the error says that instead.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import IO, Any

from ddptrain import _env
from ddptrain.errors import ConfigError, HostLostError, LaunchError
from ddptrain.launch.agent_session import AgentSession, OutputSink
from ddptrain.launch.host_scripts import env_frame, read_pid_line
from ddptrain.launch.hosts import HostSpec, gpus_needed, is_local, slots_for_gpus
from ddptrain.launch.reaping import stat_says_stopped
from ddptrain.launch.ssh_connect import connect, remote_command
from ddptrain.launch.ssh_files import HostFiles
from ddptrain.wire.agent_events import AgentEvent
from ddptrain.wire.protocol import ALIVE_S, Bootstrap

__all__ = ["SSHLauncher", "gpu_count", "gpu_slots"]

_logger = logging.getLogger(__name__)


_STOPPED_CHECK_S = 3.0  # a bound on each step of asking a silent host whether its agent is stopped
_GPU_PROBE = "nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true"


def gpu_count(host: HostSpec) -> int:
    """How many GPUs ``host`` has: torch's count here, ``nvidia-smi -L`` over SSH elsewhere."""
    if is_local(host):
        import torch

        return torch.cuda.device_count()
    client = connect(host, _env.ssh_connect_timeout_s())
    try:
        _, stdout, _ = client.exec_command(_GPU_PROBE, timeout=30)
        return int(stdout.read().decode().strip() or 0)
    finally:
        client.close()


def gpu_slots(hosts: list[HostSpec], gpus_per_worker: float) -> list[HostSpec]:
    """Hosts without ``slots`` get one slot per ``gpus_per_worker`` GPUs: of their ``gpus``,
    else probed on the host.

    Raises:
        ConfigError: A host without ``slots`` has no GPU, or a host's ``gpus`` are fewer than
            its ``slots`` need.
    """
    counted: list[HostSpec] = []
    for host in hosts:
        if host.slots is not None:
            needed = gpus_needed(host.slots, gpus_per_worker)
            if host.gpus is not None and len(host.gpus) < needed:
                raise ConfigError(
                    f"host {host.name!r} runs {host.slots} worker(s) at {gpus_per_worker:g} GPU(s) each, which "
                    f"need {needed} GPU(s), but its `gpus` lists {len(host.gpus)} "
                    f"({','.join(map(str, host.gpus))}). List more `gpus=` or lower its `slots=`."
                )
            counted.append(host)
            continue
        count = len(host.gpus) if host.gpus is not None else gpu_count(host)
        slots = slots_for_gpus(count, gpus_per_worker)
        if slots < 1:
            where = "its `gpus` list" if host.gpus is not None else "nvidia-smi"
            raise ConfigError(
                f"host {host.name!r} has no GPU that `use_gpu=True` could use ({where} lists {count}); "
                "give it `slots=` in the host list, or remove it."
            )
        counted.append(dataclasses.replace(host, slots=slots))
    return counted


class SSHConnection:
    """The pipe to an agent started over an SSH channel (no pty): its stdin, stdout and stderr
    are the channel's. The agent first prints its pid on a line of its own.

    Args:
        client: A connected paramiko client.
        host: The host (for messages).
        command: The remote command that starts the agent.
        env: Environment variables of the agent and its workers (sent over stdin).

    Raises:
        ConfigError: A variable of ``env`` cannot be passed (see ``env_frame``).
    """

    def __init__(self, client: Any, host: HostSpec, command: str, env: dict[str, str]) -> None:
        self.where = f"on host {host.name!r}"
        self.agent_pid: int | None = None  # on the host; known once `pid_known` is set
        self.stray_output = ""  # what its stdout said instead of the pid line
        self.pid_known = threading.Event()
        self._name = host.name
        self._command = command
        self._frame = env_frame(env)
        self._transport = client.get_transport()
        # The address this machine uses to reach the host: the host can reach us back on it.
        self.local_address: str = self._transport.sock.getsockname()[0]
        self._channel: Any = None

    def open(self) -> None:
        self._channel = self._transport.open_session()
        self._channel.exec_command(self._command)
        self.stdout: IO[bytes] = self._channel.makefile("rb")
        self.stderr: IO[bytes] = self._channel.makefile_stderr("rb")
        try:
            self._channel.sendall(self._frame)
        except OSError:
            pass  # it ended already; `start` reports how
        threading.Thread(target=self._read_pid, name=f"ddptrain-ssh-{self._name}", daemon=True).start()

    def probe(self) -> bool:
        # A global request the server does not know: OpenSSH answers it with a failure, as it
        # does for its own client's ServerAliveInterval. Returns once answered or disconnected.
        self._transport.global_request("keepalive@openssh.com", wait=True)
        return bool(self._transport.is_active())

    def _read_pid(self) -> None:
        """The first line of the agent's stdout: its pid (nothing if it never started)."""
        try:
            self.agent_pid, self.stray_output = read_pid_line(self.stdout)
        finally:
            self.pid_known.set()

    def stopped_pid(self) -> int | None:
        """The agent's pid if the host says it is stopped by a signal (state ``T`` in its
        ``/proc/PID/stat``, read over a new channel of this connection); ``None`` if it is not,
        or the host cannot say. A host that is gone may not answer at all: paramiko's wait for
        the command has no bound, so call it in a thread of its own (:meth:`abort` ends it)."""
        pid = self.agent_pid
        if pid is None:
            return None
        try:
            channel = self._transport.open_session(timeout=_STOPPED_CHECK_S)
            try:
                channel.settimeout(_STOPPED_CHECK_S)
                channel.exec_command(f"cat /proc/{int(pid)}/stat")
                stat = channel.makefile("rb").read(4096)
            finally:
                channel.close()
        except Exception:  # noqa: BLE001 - the host did not say: not known to be stopped
            return None
        return pid if stat_says_stopped(stat) else None

    def write(self, data: bytes) -> None:
        if self._channel is None:
            raise BrokenPipeError("the agent was not started")
        self._channel.sendall(data)

    def wait_ready(self) -> None:
        self.pid_known.wait()  # the pid line comes first

    def exit_code(self) -> int | None:
        # The exit status may follow the end of the output by a moment.
        if self._channel is None or not self._channel.status_event.wait(2.0):
            return None
        code = int(self._channel.recv_exit_status())
        return None if code == -1 else code  # -1: the connection ended without an exit status

    def close(self, grace_s: float) -> None:
        if self._channel is None:
            return
        try:
            self._channel.shutdown_write()
        except OSError:
            pass
        deadline_s = grace_s + 2.0
        if not self._channel.status_event.wait(deadline_s):
            _logger.warning("ddptrain: the agent %s did not stop in %.0f s", self.where, deadline_s)
        self._channel.close()

    def abort(self) -> None:
        # The whole SSH connection: a copy of checkpoint files on it must end too.
        self._transport.close()


class SSHLauncher:
    """Runs one host's workers under an agent started over SSH.

    Args:
        host: The host (after ``~/.ssh/config`` lookups).
        env: Environment variables of the agent and its workers.
        python: Python executable on the host.
        workdir: Working directory on the host.
    """

    def __init__(self, host: HostSpec, env: dict[str, str], python: str, workdir: str | None) -> None:
        self.host = host
        self.workdir = workdir
        self._lost_after_s = _env.ssh_heartbeat_timeout_s()
        self._client: Any = connect(host, _env.ssh_connect_timeout_s())
        self.python = python
        try:
            self._connection = SSHConnection(self._client, host, remote_command(python, workdir), env)
        except Exception as exc:
            self._client.close()
            raise LaunchError(f"host {host.name!r}: cannot start the ddptrain agent: {exc}.") from None
        self.local_address = self._connection.local_address
        # The host is watched from here on: one that stops answering while its agent starts is
        # dropped within the heartbeat timeout. Over SSH the agent also stops when the driver's
        # heartbeat stops (a host or network that vanished).
        label = f"ddptrain agent {host.name}"
        self._session = AgentSession(
            self._connection, ALIVE_S, label, lost_after_s=self._lost_after_s, stopped_pid=self._connection.stopped_pid
        )
        try:
            self._session.open()
        except Exception as exc:
            self._session.shutdown(0)
            self._client.close()
            lost = self.lost_error()
            if lost is not None:
                raise lost from None
            raise LaunchError(f"host {host.name!r}: cannot start the ddptrain agent: {exc}.") from None
        self._files = HostFiles(self._client, host.name, python, self.lost_error)

    def lost_error(self) -> HostLostError | None:
        """Once the host stopped answering (its connection was dropped, which ended whatever
        waited on it): the error that says so."""
        return self._session.lost_error(self.host.name)

    @property
    def agent_pid(self) -> int | None:
        return self._connection.agent_pid

    def start(self, bootstrap: Bootstrap, sink: OutputSink, on_event: Callable[[AgentEvent], None]) -> None:
        """Hand the host's share of the bootstrap to its agent (see ``AgentSession.start``).

        Raises:
            HostLostError: The host stopped answering before its agent got its work.
            LaunchError: The agent is gone.
        """
        bootstrap = dataclasses.replace(bootstrap, cwd=self.workdir, heartbeat_s=self._lost_after_s)
        self._session.start_on(self.host.name, bootstrap, sink, on_event)

    # ----------------------------------------------------------------- files (no shared storage)
    def prepare_storage(self, probe: str, run_id: str) -> str | None:
        """Check whether this host sees the run directory; if not, create its private staging
        folder (``/tmp/ddptrain-<run id>``, 0700, owned by this host's agent) and return its
        path (see ``HostFiles.prepare``).

        Raises:
            HostLostError: The host stopped answering.
            LaunchError: The agent did not start in time, or see ``HostFiles.prepare``.
        """
        if not self._connection.pid_known.wait(_env.worker_start_timeout_s()):
            raise LaunchError(f"the ddptrain agent on host {self.host.name!r} did not start in time")
        if self.agent_pid is None:
            lost = self.lost_error()
            if lost is not None:
                raise lost
            return None  # the agent did not start: `start` reports why
        return self._files.prepare(probe, run_id, self.agent_pid)

    def fetch_dir(self, rank: int, remote: str, local: str) -> None:
        """Copy a folder from the host to this machine, then delete it there (``HostFiles.fetch_dir``)."""
        self._files.fetch_dir(remote, local)

    def push_dir(self, local: str, remote: str) -> None:
        """Copy a folder from this machine to the host (``HostFiles.push_dir``)."""
        self._files.push_dir(local, remote)

    def reset(self, timeout_s: float) -> bool:
        """Stop the workers and keep the agent for the next attempt (``AgentSession.reset``)."""
        return self._client is not None and self._session.reset(timeout_s)

    def ask(self, command: bytes) -> None:
        """Send the agent a one-byte request (see ``Launcher.ask``)."""
        self._session.ask(command)

    def stopped_agents(self) -> list[tuple[str, int]]:
        return []  # a stopped agent there goes silent: its host is declared lost

    def bind_address(self) -> str:
        return self.local_address

    def shutdown(self, grace_s: float) -> None:
        if self._client is None:
            return
        self._session.shutdown(grace_s)
        self._files.close()
        self._client.close()
        self._client = None
