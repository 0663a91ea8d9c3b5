"""One agent on one host, seen from the driver, whatever the connection to it.

A :class:`HostConnection` is a byte pipe to an agent process: its stdin, stdout and stderr,
its exit status, and how to stop it. Today there are two: a local subprocess
(``launcher.LocalConnection``) and an SSH channel (``ssh.SSHConnection``); a new kind of host
(``srun``, ``kubectl exec``) is one more small class. :class:`AgentSession` does the rest once
for all of them: the bootstrap frame, reading framed worker output and agent events
(``ddptrain.wire.protocol``, ``ddptrain.wire.agent_events``), the agent's stderr (prefixed, and its tail
kept for errors), heartbeats, requests, and the events that say the agent stopped answering or
is gone.

A host that can be cut off (over SSH) is watched from the moment its connection is open, not
only once its workers run: until its agent speaks, the host's own answers to
:meth:`HostConnection.probe` (its SSH server's) say it is there, so a network that goes away
while the agent starts, the host's storage is checked, or the training function loads, is
noticed within the same bound as mid-run.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Protocol

from ddptrain.errors import AgentGoneError, HostLostError, LaunchError
from ddptrain.wire.agent_events import AgentEvent, AgentFailed, AgentGone, AgentIdle, AgentLost, decode_agent_event
from ddptrain.wire.boot import versions
from ddptrain.wire.protocol import AGENT_RANK, ALIVE_S, Bootstrap, Kind, Request, encode_bootstrap, read_frame

__all__ = ["AgentEvent", "AgentSession", "HostConnection", "OutputSink"]

_logger = logging.getLogger(__name__)


class OutputSink(Protocol):
    """Where a launcher puts its workers' output (the driver's ``LogSink``)."""

    def write(self, rank: int, stream: bytes, data: bytes) -> None:
        """Take a chunk of a rank's stdout (``b"O"``) or stderr (``b"E"``)."""


class HostConnection(Protocol):
    """A byte pipe to one agent process."""

    where: str  # "on this machine", "on host 'h0'": for messages
    stdout: IO[bytes]  # framed output (see ``ddptrain.wire.protocol``)
    stderr: IO[bytes]  # the agent's own messages, line by line
    stray_output: str  # what a remote program's stdout said instead of the agent's pid (its shell's words)

    @property
    def agent_pid(self) -> int | None:
        """The agent's pid once it runs (a remote one has printed its pid line); else ``None``."""

    def open(self) -> None:
        """Start the agent; from now on ``stdout`` and ``stderr`` can be read."""

    def probe(self) -> bool:
        """Block until the host answers a request that costs it nothing (an SSH server's reply);
        ``False`` once the connection is gone."""

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
    """Drives one agent through ``connection``; :meth:`open` starts it.

    Args:
        connection: The pipe to the agent.
        heartbeat_s: Send a heartbeat byte this often (``None``: none; a local agent sees its
            driver die through its stdin).
        label: Prefix of the agent's stderr lines on the driver's stderr.
        lost_after_s: Declare the host lost (:attr:`lost`, :class:`AgentLost`) once nothing came
            from it for this long, from the moment the session exists; its connection is then
            dropped, which ends every wait on it. ``None``: never (a local agent).
        stopped_pid: Asked (in a thread of its own) once the host is silent for half of
            ``lost_after_s``: the agent's pid if the host says the agent is stopped by a signal
            (then :attr:`lost` says so), else ``None``. An answer that has not come when the host
            is declared lost is not waited for.
    """

    def __init__(
        self,
        connection: HostConnection,
        heartbeat_s: float | None,
        label: str,
        lost_after_s: float | None = None,
        stopped_pid: Callable[[], int | None] | None = None,
    ) -> None:
        self.connection = connection
        self._stopped_pid = stopped_pid
        self._heartbeat_s = heartbeat_s
        self._label = label
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stderr_thread: threading.Thread | None = None
        self._stderr_tail: list[str] = []
        # When something last came from the agent; `None` until it speaks after the bootstrap
        # (its first worker started). Until then, `_answered_at`: when the host last answered a
        # probe. `_busy`: the driver is handling a frame.
        self._heard_at: float | None = None
        self._answered_at = time.monotonic()  # the connection was just made
        self._busy = False
        self._lock = threading.Lock()  # `lost` and `_on_event`: who tells the driver
        self._on_event: Callable[[AgentEvent], None] | None = None
        self._sink: OutputSink | None = None  # where worker output goes (the current attempt's)
        self._write_lock = threading.Lock()  # a bootstrap frame is never cut by a heartbeat byte
        self._reading = False  # the frames of a started agent are being read
        self._ran = False  # a frame came from the agent once (it ran an attempt)
        self._idle = threading.Event()  # the agent answered a reset
        self.lost: AgentLost | None = None  # set when the host stopped answering
        if lost_after_s is not None:
            self._spawn(self._probe, "probe")
            self._spawn(lambda: self._watch(lost_after_s), "watch")

    def open(self) -> None:
        """Start the agent (see :meth:`HostConnection.open`): watched already, so a host that
        stops answering meanwhile ends it within ``lost_after_s`` (check :attr:`lost`)."""
        self.connection.open()
        # Read stderr from the start: a full pipe would stall the agent.
        self._spawn(self._read_stderr, "stderr")
        self._stderr_thread = self._threads[-1]

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
        if self._stderr_thread is not None:
            self._stderr_thread.join(1.0)  # let it take the last lines
        lines = self._stderr_tail[-10:] + ([self.connection.stray_output] if self.connection.stray_output else [])
        tail = "\n".join(lines)
        return f"exit status {code}" + (f":\n{tail}" if tail else "")

    def start(self, bootstrap: Bootstrap, sink: OutputSink, on_event: Callable[[AgentEvent], None]) -> None:
        """Send the bootstrap; from now on worker output goes to ``sink`` and agent events to
        ``on_event``, ending with :class:`AgentGone` (after an :class:`AgentFailed` if the agent
        never ran), or with :class:`AgentLost` once the host stopped answering (``lost_after_s``).
        After a :meth:`reset`, the same agent gets the next attempt's bootstrap.

        Raises:
            AgentGoneError: The agent had run (or ran the last attempt) and is gone.
            LaunchError: The agent never started, or the host stopped answering (:attr:`lost`
                says so).
        """
        with self._lock:
            warm = self._reading  # a reset agent: its frames are read already
            if warm:  # what it sends from now on is this attempt's
                self._sink, self._on_event = sink, on_event
        try:
            self._write(encode_bootstrap(bootstrap, versions()))
        except OSError:
            if self.lost is not None:
                raise LaunchError(f"{self.connection.where} the host stopped answering") from None
            if warm or self.connection.agent_pid is not None:  # it ran, then went: FailureConfig decides
                gone = f"The ddptrain agent {self.connection.where} was gone before it got its work"
                raise AgentGoneError(f"{gone} ({self.exit_detail()})") from None
            raise LaunchError(f"{self.connection.where} the agent did not start ({self.exit_detail()})") from None
        with self._lock:
            if self.lost is not None:  # while the bootstrap went out
                raise LaunchError(f"{self.connection.where} the host stopped answering")
            self._sink, self._on_event = sink, on_event
        if warm:
            return
        self._reading = True
        self._spawn(self._read_frames, "frames")
        if self._heartbeat_s is not None:
            self._spawn(self._heartbeat, "heartbeat")

    def lost_error(self, host: str) -> HostLostError | None:
        """Once the host stopped answering (:attr:`lost`): the error that says so, naming it
        ``host`` (a remote launcher's ``lost_error``)."""
        lost = self.lost
        return None if lost is None else HostLostError(host, lost.silent_s, lost.timeout_s, None, lost.stopped_pid)

    def start_on(
        self, host: str, bootstrap: Bootstrap, sink: OutputSink, on_event: Callable[[AgentEvent], None]
    ) -> None:
        """:meth:`start` on a remote host (SSH, a SLURM node).

        Raises:
            HostLostError: ``host`` stopped answering before its agent got its work.
            AgentGoneError: The agent had run and is gone.
            LaunchError: The agent never started.
        """
        try:
            self.start(bootstrap, sink, on_event)
        except LaunchError:
            lost = self.lost_error(host)
            if lost is not None:
                raise lost from None
            raise

    def _read_frames(self) -> None:
        self.connection.wait_ready()
        seen = False
        while (frame := read_frame(self.connection.stdout)) is not None:
            seen = self._ran = True
            self._busy = True  # a slow sink is the driver's delay, not the host's
            kind, rank, data = frame
            sink, on_event = self._sink, self._on_event
            if kind == Kind.ALIVE:
                pass
            elif kind in (Kind.STDOUT, Kind.STDERR):
                if sink is not None:
                    sink.write(rank, kind, data)
            else:
                try:
                    event = decode_agent_event(kind, rank, data)
                except Exception as exc:  # another version, or a damaged stream: say so, never hang
                    where = self.connection.where
                    event = AgentFailed(rank, f"{where} the agent sent an unreadable frame: {exc!r}")
                if isinstance(event, AgentIdle):
                    with self._lock:  # nothing more of the last attempt's reaches its group
                        self._sink = self._on_event = None
                    self._idle.set()
                elif on_event is not None:
                    on_event(event)
            self._heard_at = time.monotonic()
            self._busy = False
        self._busy = True  # the pipe ended: nothing more to watch
        with self._lock:
            self._reading = False
            on_event = self._on_event
        self._idle.set()  # a reset waiting for it ends (not `idle`: the agent is gone)
        if on_event is None:
            return
        if not seen and not self._stop.is_set():  # it never ran (wrong python, missing ddptrain...), or went
            detail, where = self.exit_detail(), self.connection.where
            said = "was gone before it got its work" if self._ran else "did not start"
            on_event(AgentFailed(AGENT_RANK, f"{where} the agent {said} ({detail})"))
        on_event(AgentGone(AGENT_RANK, self.connection.exit_code(), self._last_words()))

    def _last_words(self) -> str:
        """The agent's last stderr line, if it is the agent's own (why it stopped)."""
        if self._stderr_thread is not None:
            self._stderr_thread.join(1.0)  # let it take the last lines
        last = self._stderr_tail[-1] if self._stderr_tail else ""
        return last if last.startswith("ddptrain agent: ") else ""

    def reset(self, timeout_s: float) -> bool:
        """Make the agent ready for the next attempt's :meth:`start`: it kills every worker (and
        what they started) and waits for a new bootstrap. ``False`` when it cannot be kept (it
        is gone, its host stopped answering, it was preempted, or it did not answer within
        ``timeout_s``): the caller then shuts the session down and starts a new agent."""
        if self._stop.is_set() or self.lost is not None or not self._reading:
            return False
        self._idle.clear()
        try:
            self._write(Request.RESET)
        except OSError:
            return False
        if not self._idle.wait(timeout_s):
            _logger.warning("ddptrain: the agent %s did not reset in %.1f s", self.connection.where, timeout_s)
            return False
        return self._reading and self.lost is None

    def _write(self, data: bytes) -> None:
        with self._write_lock:
            self.connection.write(data)

    def _probe(self) -> None:
        """Until the agent speaks, ask the host for an answer every ``ALIVE_S`` (the agent is
        silent while it starts, imports and loads the training function, which may take long)."""
        while self._heard_at is None and not self._stop.is_set():
            if not self.connection.probe():
                return
            self._answered_at = time.monotonic()
            self._stop.wait(ALIVE_S)

    def _watch(self, timeout_s: float) -> None:
        """Declare the host lost once nothing came from it for ``timeout_s``: from its agent once
        it spoke, before that in answer to a probe. Then drop the connection, which ends every
        wait on it (starting the agent, checking the storage, a copy of checkpoint files). The
        agent's own heartbeat check stops its workers on the host.

        A silence that this process made (it was stopped, by SIGSTOP or Ctrl-Z, or got no CPU)
        is not the host's: the watch itself did not run, and what the host sent meanwhile
        waits in the pipe. Then the host gets a new ``timeout_s`` from now, and a warning
        says why its agent may have stopped its workers (our heartbeats stopped too)."""
        ticked = time.monotonic()
        stopped: _StoppedCheck | None = None  # is the agent stopped? asked during this silence
        while not self._stop.wait(ALIVE_S / 2):
            now = time.monotonic()
            paused_s, ticked = now - ticked - ALIVE_S / 2, now
            if paused_s > timeout_s / 2:
                _say_driver_paused(paused_s, timeout_s)
                self._answered_at = now
                if self._heard_at is not None:
                    self._heard_at = now
                continue
            if self._busy:
                continue
            heard = self._heard_at if self._heard_at is not None else self._answered_at
            silent_s = time.monotonic() - heard
            if silent_s <= timeout_s / 2:
                stopped = None  # it spoke: a later silence asks again
            elif stopped is None and self._stopped_pid is not None:
                stopped = _StoppedCheck(self._stopped_pid)
            if silent_s > timeout_s:
                pid = stopped.pid if stopped is not None else None
                why = "the host stopped answering" if pid is None else f"its agent (pid {pid}) is stopped by a signal"
                _logger.warning(
                    "ddptrain: nothing came from %s for %.1f s (DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S=%g): "
                    "%s; dropping its connection",
                    self.connection.where.removeprefix("on "),
                    silent_s,
                    timeout_s,
                    why,
                )
                with self._lock:
                    self.lost = AgentLost(AGENT_RANK, silent_s, timeout_s, pid)
                    on_event = self._on_event
                if on_event is not None:
                    on_event(self.lost)
                self.connection.abort()
                return

    def _heartbeat(self) -> None:
        assert self._heartbeat_s is not None
        while not self._stop.wait(self._heartbeat_s):
            try:
                self._write(Request.HEARTBEAT)
            except OSError:
                return

    def ask(self, command: bytes) -> None:
        """Send the agent a :class:`~ddptrain.protocol.Request`."""
        try:
            self._write(command)
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


class _StoppedCheck:
    """Asks, in a daemon thread, whether a silent host's agent is stopped by a signal; ``pid``
    is its answer once it came (a host that is gone never answers: the thread ends when its
    connection is dropped)."""

    def __init__(self, ask: Callable[[], int | None]) -> None:
        self.pid: int | None = None
        self._ask = ask
        threading.Thread(target=self._run, name="ddptrain-agent-stopped", daemon=True).start()

    def _run(self) -> None:
        self.pid = self._ask()


_paused_lock = threading.Lock()
_paused_said_at = -1e9  # when the last pause of this process was said (one line for every host)


def _say_driver_paused(paused_s: float, timeout_s: float) -> None:
    """Warn, once for all the hosts' watches, that this process did not run for ``paused_s``."""
    global _paused_said_at
    with _paused_lock:
        now = time.monotonic()
        if now - _paused_said_at < timeout_s:
            return
        _paused_said_at = now
    _logger.warning(
        "ddptrain: this driver process (pid %d) did not run for %.1f s (stopped by a signal or Ctrl-Z, "
        "or starved of CPU); the agents on other hosts stop their workers once the driver's heartbeats "
        "are missing for %g s (DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S), and their hosts are not to blame",
        os.getpid(),
        paused_s,
        timeout_s,
    )
