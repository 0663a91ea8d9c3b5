"""One agent on one host, seen from the driver, whatever the connection to it.

A :class:`HostConnection` is a byte pipe to an agent process: its stdin, stdout and stderr,
its exit status, and how to stop it. Today there are two: a local subprocess
(``launcher.LocalConnection``) and an SSH channel (``ssh.SSHConnection``); a new kind of host
(``srun``, ``kubectl exec``) is one more small class. :class:`AgentSession` does the rest once
for all of them: the bootstrap frame, reading framed worker output and agent events
(``ddptrain.protocol``, ``ddptrain.agent_events``), the agent's stderr (prefixed, and its tail
kept for errors), heartbeats, requests, and the events that say the agent stopped answering or
is gone.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Protocol

from ddptrain.driver.logs import LogSink
from ddptrain.errors import LaunchError
from ddptrain.wire.agent_events import AgentEvent, AgentFailed, AgentGone, AgentLost, decode_agent_event
from ddptrain.wire.boot import versions
from ddptrain.wire.protocol import AGENT_RANK, ALIVE_S, Bootstrap, Kind, Request, encode_bootstrap, read_frame

__all__ = ["AgentEvent", "AgentSession", "HostConnection"]

_logger = logging.getLogger(__name__)


class HostConnection(Protocol):
    """A byte pipe to one agent process."""

    where: str  # "on this machine", "on host 'h0'": for messages
    stdout: IO[bytes]  # framed output (see ``ddptrain.protocol``)
    stderr: IO[bytes]  # the agent's own messages, line by line

    def write(self, data: bytes) -> None:
        """Write to the agent's stdin. Raises OSError when the agent is gone."""

    def wait_ready(self) -> None:
        """Block until ``stdout`` carries frames (e.g. past a line the agent prints first)."""

    def exit_code(self) -> int | None:
        """The agent's exit status once its output ended (``None``: unknown, connection lost)."""

    def close(self, grace_s: float) -> None:
        """Stop the agent (it has been asked to) and release the connection."""

    def abort(self) -> None:
        """Drop the connection at once, without a word to the agent (it stopped answering):
        every read and write on it ends."""


class AgentSession:
    """Drives one agent through ``connection``.

    Args:
        connection: The pipe to the agent.
        heartbeat_s: Send a heartbeat byte this often (``None``: none; a local agent sees its
            driver die through its stdin).
        label: Prefix of the agent's stderr lines on the driver's stderr.
    """

    def __init__(self, connection: HostConnection, heartbeat_s: float | None, label: str) -> None:
        self.connection = connection
        self._heartbeat_s = heartbeat_s
        self._label = label
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stderr_tail: list[str] = []
        # When something last came from the agent; `None` until its workers run (before that,
        # the worker start timeout bounds the wait). `_busy`: the driver is handling a frame.
        self._heard_at: float | None = None
        self._busy = False
        self.lost: AgentLost | None = None  # set when the agent stopped answering
        # Read stderr from the start: a full pipe would stall the agent.
        self._spawn(self._read_stderr, "stderr")

    def _spawn(self, target: Callable[[], None], what: str) -> None:
        thread = threading.Thread(target=target, name=f"ddptrain-agent-{what}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _read_stderr(self) -> None:
        try:
            for line in self.connection.stderr:
                text = line.decode("utf-8", errors="replace").rstrip()
                if self._heard_at is not None:
                    self._heard_at = time.monotonic()
                if text:
                    self._stderr_tail = (self._stderr_tail + [text])[-20:]
                    sys.stderr.write(f"[{self._label}] {text}\n")
        except (OSError, ValueError):
            pass  # closed under us at shutdown

    def exit_detail(self) -> str:
        """``exit status N`` and the agent's last stderr lines, for errors."""
        code = self.connection.exit_code()
        self._threads[0].join(1.0)  # the stderr reader: let it take the last lines
        tail = "\n".join(self._stderr_tail[-10:])
        return f"exit status {code}" + (f":\n{tail}" if tail else "")

    def start(self, bootstrap: Bootstrap, sink: LogSink, on_event: Callable[[AgentEvent], None]) -> None:
        """Send the bootstrap; from now on worker output goes to ``sink`` and agent events to
        ``on_event``, ending with :class:`AgentGone` (after an :class:`AgentFailed` if the agent
        never ran). With ``bootstrap.heartbeat_s`` (SSH hosts), an agent whose workers run and
        from which nothing came for that long is declared lost (:class:`AgentLost`) and its
        connection dropped.

        Raises:
            LaunchError: The agent is gone before it got its work.
        """
        try:
            self.connection.write(encode_bootstrap(bootstrap, versions()))
        except OSError:
            raise LaunchError(f"{self.connection.where} the agent did not start ({self.exit_detail()})") from None

        def read_frames() -> None:
            self.connection.wait_ready()
            seen = False
            while (frame := read_frame(self.connection.stdout)) is not None:
                seen = True
                self._busy = True  # a slow sink is the driver's delay, not the host's
                kind, rank, data = frame
                if kind == Kind.ALIVE:
                    pass
                elif kind in (Kind.STDOUT, Kind.STDERR):
                    sink.write(rank, kind, data)
                else:
                    try:
                        event = decode_agent_event(kind, rank, data)
                    except Exception as exc:  # another version, or a damaged stream: say so, never hang
                        where = self.connection.where
                        event = AgentFailed(rank, f"{where} the agent sent an unreadable frame: {exc!r}")
                    on_event(event)
                self._heard_at = time.monotonic()
                self._busy = False
            self._busy = True  # the pipe ended: nothing more to watch
            if not seen and not self._stop.is_set():  # the agent never ran: wrong python, missing ddptrain, ...
                detail = self.exit_detail()
                on_event(AgentFailed(AGENT_RANK, f"{self.connection.where} the agent did not start ({detail})"))
            on_event(AgentGone(AGENT_RANK, self.connection.exit_code()))

        self._spawn(read_frames, "frames")
        if self._heartbeat_s is not None:
            self._spawn(self._heartbeat, "heartbeat")
        if bootstrap.heartbeat_s is not None:
            timeout_s = bootstrap.heartbeat_s
            self._spawn(lambda: self._watch(timeout_s, on_event), "watch")

    def _watch(self, timeout_s: float, on_event: Callable[[AgentEvent], None]) -> None:
        """Declare the agent lost once nothing came from it for ``timeout_s`` while its workers
        run; then drop the connection, which ends every wait on it (a copy of checkpoint files
        included). Its own heartbeat check stops the agent's workers on the host."""
        while not self._stop.wait(ALIVE_S / 2):
            heard = self._heard_at
            if heard is None or self._busy:
                continue
            silent_s = time.monotonic() - heard
            if silent_s > timeout_s:
                _logger.warning(
                    "ddptrain: nothing came from the agent %s for %.1f s (DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S=%g): "
                    "the host stopped answering; dropping its connection",
                    self.connection.where,
                    silent_s,
                    timeout_s,
                )
                self.lost = AgentLost(AGENT_RANK, silent_s, timeout_s)
                on_event(self.lost)
                self.connection.abort()
                return

    def _heartbeat(self) -> None:
        assert self._heartbeat_s is not None
        while not self._stop.wait(self._heartbeat_s):
            try:
                self.connection.write(Request.HEARTBEAT)
            except OSError:
                return

    def ask(self, command: bytes) -> None:
        """Send the agent a :class:`~ddptrain.protocol.Request`."""
        try:
            self.connection.write(command)
        except Exception:
            pass  # the agent is gone; that is reported elsewhere

    def shutdown(self, grace_s: float) -> None:
        """Ask the agent to stop its workers (``Request.KILL``), then close the connection. Safe twice."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.ask(Request.KILL)
        self.connection.close(grace_s)
        for thread in self._threads:
            thread.join(2.0)
