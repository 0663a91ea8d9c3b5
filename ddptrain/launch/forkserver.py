"""Local agents forked from a server that has imported torch once (driver side).

Importing torch is most of an agent's start (seconds of CPU). A driver that starts several
local agents (a restart after a failure, the next ``fit()``, a sweep's trials) asks one fork
server per agent environment for them instead (``ddptrain.agent.forkserver``): the first agent
costs what it always did, every later one a ``fork()``. The server never runs user code, so
nothing of one run reaches the next; it is started with the agent's exact environment, umask,
interpreter and pinned import folders, and a driver whose environment differs gets another one
(at most ``_IDLE_SERVERS`` idle ones are kept). Variables that cannot matter while torch and
ddptrain are imported (ddptrain's own settings, read when used, and pytest's per-test
``PYTEST_CURRENT_TEST``) do not count as a difference: each agent gets its exact environment
when it is forked. A server ends with the driver process.

``DDPTRAIN_AGENT_FORKSERVER=0`` starts every agent as a new process instead.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

from ddptrain._proc import state_letter
from ddptrain.wire.boot import FORKSERVER_FD_VAR, agent_command, import_pins

__all__ = ["ForkedAgent", "enabled", "server_pids", "spawn"]

_logger = logging.getLogger(__name__)

_IDLE_SERVERS = 4
_PID_TIMEOUT_S = 300.0  # the first agent waits for the server's torch import


def enabled() -> bool:
    """Whether local agents are forked from a server (``DDPTRAIN_AGENT_FORKSERVER``, default on)."""
    return os.environ.get("DDPTRAIN_AGENT_FORKSERVER", "1").strip() != "0" and hasattr(socket, "send_fds")


class ForkedAgent:
    """An agent forked by a server: what ``LocalConnection`` uses of ``subprocess.Popen``."""

    def __init__(self, server: _Server) -> None:
        self._server = server
        self._pid: int | None = None
        self._code: int | None = None
        self._answered = threading.Event()  # the pid is known, or will never be
        self._exited = threading.Event()
        self._released = False  # its group was killed: the server may reap it once it exits

    @property
    def pid(self) -> int | None:
        """The agent's pid (its session's and process group's id); ``None`` if the server ended
        before forking it. Waits for the server's first torch import, within a bound."""
        if not self._answered.wait(_PID_TIMEOUT_S):
            _logger.warning("ddptrain: the agent fork server did not start an agent in %.0f s", _PID_TIMEOUT_S)
        return self._pid

    def server_exit(self) -> str:
        """How the server ended (for a warning), once :attr:`pid` came back ``None``."""
        code = self._server.proc.poll()
        return f"it exited with status {code}" if code is not None else "it stopped answering"

    def poll(self) -> int | None:
        """The exit code once the agent exited, else ``None``."""
        if not self._exited.is_set() and not self._server.alive:
            self._exit_without_server()
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the agent to exit (``subprocess.TimeoutExpired`` after ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._exited.wait(0.1):
            if not self._server.alive:
                self._exit_without_server()
                if self._exited.is_set():
                    break
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("ddptrain agent", timeout or 0.0)
        assert self._code is not None
        return self._code

    def release(self) -> None:
        """Let the server reap the agent (after the driver killed its process group): now if
        it exited, else once it does (one the driver gave up waiting for, ``reaping.reap``)."""
        self._released = True
        if self._pid is not None and self._exited.is_set():
            self._server.send(f"R {self._pid}".encode())

    def _answer(self, pid: int | None) -> None:
        self._pid = pid
        self._answered.set()

    def _exit(self, code: int) -> None:
        self._code = code
        self._exited.set()
        if self._released and self._pid is not None:  # released before it exited
            self._server.send(f"R {self._pid}".encode())

    def _exit_without_server(self) -> None:
        """The server ended: the agent (now init's child) is over once its pid is gone."""
        pid = self._pid if self._answered.is_set() else None
        if pid is not None and state_letter(pid) not in ("", "Z", "X"):
            return  # still running
        self._answer(pid)
        self._exit(-1 if pid is not None else 1)  # the code is unknown: the server reaped no more


def _start_server(env: dict[str, str], fd: int) -> subprocess.Popen[bytes]:
    """The server process: an agent's command line, in a session of its own, with ``env`` and
    ``fd`` (its end of the socket pair) named in it. Its ``pid``, ``poll()`` and ``wait()`` are
    what the driver uses."""
    return subprocess.Popen(
        agent_command(sys.executable, import_pins()),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**env, FORKSERVER_FD_VAR: str(fd)},
        pass_fds=(fd,),
        start_new_session=True,
    )


class _Server:
    def __init__(self, key: tuple[object, ...], env: dict[str, str]) -> None:
        self.key = key
        self.owner = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = _start_server(env, theirs.fileno())
        finally:
            theirs.close()
        self.sock = ours
        self.alive = True
        self._send_lock = threading.Lock()
        self._waiting: collections.deque[ForkedAgent] = collections.deque()  # for their pid, in order
        self._agents: dict[int, ForkedAgent] = {}
        threading.Thread(target=self._read, name="ddptrain-agent-forkserver", daemon=True).start()

    def busy(self) -> bool:
        return bool(self._waiting) or any(not a._exited.is_set() for a in self._agents.values())

    def spawn(self, env: dict[str, str], stdin: int, stdout: int, stderr: int) -> ForkedAgent:
        agent = ForkedAgent(self)
        request = b"F" + json.dumps(env).encode()
        with self._send_lock:
            self._waiting.append(agent)
            try:
                socket.send_fds(self.sock, [request], [stdin, stdout, stderr])
            except OSError:
                self._waiting.remove(agent)
                raise
        return agent

    def send(self, message: bytes) -> None:
        with self._send_lock, contextlib.suppress(OSError):
            self.sock.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self.sock.recv(64)
            except OSError:
                message = b""
            if not message:
                break
            kind, *fields = message.decode().split()
            if kind == "P":
                agent = self._waiting.popleft()
                self._agents[int(fields[0])] = agent
                agent._answer(int(fields[0]))
            elif kind == "X":
                exited = self._agents.pop(int(fields[0]), None)
                if exited is not None:
                    exited._exit(int(fields[1]))
        self.alive = False
        while self._waiting:  # never forked: the server ended first
            self._waiting.popleft()._answer(None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)

    def close(self) -> None:
        """End the server (its agents live on: each ends with its own stdin)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


_lock = threading.Lock()
_servers: list[_Server] = []  # most recently used last


def _import_time_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` that may change what importing torch and ddptrain does."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith("DDPTRAIN_") and k != "PYTEST_CURRENT_TEST"))


def _umask() -> str:
    with open("/proc/self/status") as f:
        return next((line.split()[1] for line in f if line.startswith("Umask:")), "")


def spawn(env: dict[str, str], stdin: int, stdout: int, stderr: int) -> ForkedAgent:
    """Fork an agent with these standard streams from the server for ``env`` (started now if
    there is none: the call does not wait for its imports)."""
    key = (sys.executable, tuple(import_pins()), _import_time_env(env), _umask())
    with _lock:
        _servers[:] = [s for s in _servers if s.alive and s.owner == os.getpid()]  # not a forked copy's
        server = next((s for s in _servers if s.key == key), None)
        if server is None:
            server = _Server(key, env)
        else:
            _servers.remove(server)
        _servers.append(server)
        idle = [s for s in _servers[:-1] if not s.busy()]
        for old in idle[: max(0, len(_servers) - _IDLE_SERVERS)]:
            _servers.remove(old)
            old.close()
    return server.spawn(env, stdin, stdout, stderr)


def server_pids() -> list[int]:
    """The pids of this process's fork servers (they outlive a ``fit()`` on purpose)."""
    with _lock:
        return [s.proc.pid for s in _servers if s.alive and s.owner == os.getpid()]
