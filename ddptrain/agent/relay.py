"""The agent while its workers run: their output and exits go to the driver, the driver's
requests come in, and every worker is killed when the driver is gone, asks to stop, or (on an
SSH host) stops sending heartbeats. ``ddptrain.agent.main`` starts the workers and hands them here.
"""

from __future__ import annotations

import os
import select
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field

from ddptrain.agent import memory as _memory
from ddptrain.agent.process import process_state
from ddptrain.wire.agent_events import AgentIdle, AgentPreempted, WorkerExited, WorkerStates, encode_event
from ddptrain.wire.protocol import AGENT_RANK, ALIVE_S, FRAME, STACK_SIGNAL, Kind, Request, encode_frame

__all__ = ["Child", "kill_all", "relay", "wait_for_bootstrap"]

_POLL_S = 0.05
# After a worker exits, how long its pipes may stay open (held by processes it started,
# such as DataLoader workers) before its exit is reported anyway.
_DRAIN_S = 0.3


@dataclass
class Child:
    rank: int
    pid: int
    fds: dict[int, bytes] = field(default_factory=dict)  # fd -> frame kind
    status: bytearray = field(default_factory=bytearray)
    status_fd: int = -1
    exitcode: int | None = None
    exited_at: float = 0.0
    maxrss_kb: int = 0  # peak RSS, from wait4


def kill_all(children: list[Child], grace_s: float) -> None:
    alive = [c for c in children if c.exitcode is None]
    for child in alive:
        try:
            os.kill(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        alive = [c for c in alive if not _reaped(c)]
        time.sleep(0.02)
    for child in alive:
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for child in alive:
        try:
            os.waitpid(child.pid, 0)
        except ChildProcessError:
            pass


class _DriverGone(Exception):
    """The driver closed the agent's stdin or asked it to stop; or, over SSH, went silent (the
    message says so)."""


class _Reset(Exception):
    """The driver asked for the workers to stop and the agent to wait for its next attempt."""


class _DriverLink:
    """The agent's side of its pipe to the driver: requests on stdin, frames on stdout.

    Over SSH (``heartbeat_s`` set) a write never blocks for long. While the pipe to sshd is full
    (a network that is down: sshd cannot forward), the agent keeps reading its stdin, and gives
    up once the driver has been silent for ``heartbeat_s``. It also writes ``Kind.ALIVE`` when
    it has written nothing for ``ALIVE_S``, so the driver can tell a host that stopped answering.
    """

    def __init__(self, out_fd: int, stdin_fd: int, heartbeat_s: float | None) -> None:
        self.out_fd = out_fd
        self.stdin_fd = stdin_fd
        self.heartbeat_s = heartbeat_s
        self.last_heard = self.last_sent = time.monotonic()
        if heartbeat_s is not None:
            os.set_blocking(out_fd, False)

    def read_requests(self) -> bytes:
        """What the driver wrote (stdin is readable)."""
        data = os.read(self.stdin_fd, 4096)
        if not data or Request.KILL in data:
            raise _DriverGone()
        self.last_heard = time.monotonic()
        if Request.RESET in data:
            raise _Reset()
        return data

    def check_heartbeat(self) -> None:
        if self.heartbeat_s is not None and time.monotonic() - self.last_heard > self.heartbeat_s:
            raise _DriverGone(f"no heartbeat from the driver for {self.heartbeat_s:g} s")

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.out_fd, view) :]
            except BlockingIOError:  # requests other than KILL that come meanwhile are dropped
                readable, _, _ = select.select([self.stdin_fd], [self.out_fd], [], _POLL_S)
                if readable:
                    self.read_requests()
                self.check_heartbeat()
        self.last_sent = time.monotonic()

    def keep_alive(self) -> None:
        if self.heartbeat_s is not None and time.monotonic() - self.last_sent >= ALIVE_S:
            self.send(encode_frame(Kind.ALIVE, AGENT_RANK, b""))


def _report_states(link: _DriverLink, children: list[Child], dump_stacks: bool) -> None:
    """Send the driver each live worker's process state; with ``dump_stacks``, also make each
    worker that can run print its Python stacks (faulthandler on ``STACK_SIGNAL``, see ``worker``)."""
    states = {}
    for child in children:
        if child.exitcode is not None:
            continue
        states[child.rank] = {"pid": child.pid, **process_state(child.pid)}
        if dump_stacks and states[child.rank]["state"] not in ("T", "t", "Z"):
            try:
                os.kill(child.pid, STACK_SIGNAL)
            except ProcessLookupError:
                pass
    link.send(encode_event(WorkerStates(AGENT_RANK, states)))


def _reaped(child: Child) -> bool:
    try:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
    except ChildProcessError:
        return True
    if pid == 0:
        return False
    child.exitcode = os.waitstatus_to_exitcode(status)
    child.maxrss_kb = usage.ru_maxrss
    child.exited_at = time.monotonic()
    return True


def relay(out_fd: int, stdin_fd: int, children: list[Child], grace_s: float, heartbeat_s: float | None = None) -> bool:
    """Relay the workers' output and exits until every worker exited, then wait for the
    driver's word; kill them all when the driver is gone, asks to stop, or (``heartbeat_s``) is
    silent that long. ``True`` when the driver asked for a reset (``Request.RESET``), while
    workers ran or after they all exited (a restart after they all failed): every worker was
    killed, and the agent is to wait for the next attempt's bootstrap.

    A first SIGTERM or SIGUSR1 to the agent is a preemption notice (its host is going away;
    SLURM's ``--signal`` sends SIGUSR1 to every process of a job's steps before the time
    limit): the driver is told (:class:`AgentPreempted`) and decides; a SIGTERM after that ends
    the agent at once. One that comes once every worker has exited ends the agent."""
    link = _DriverLink(out_fd, stdin_fd, heartbeat_s)
    notices: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: notices.append(signum))
    previous_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: notices.append(signum))
    try:
        _relay_until_done(link, children, notices)
        _await_word(link, children, notices)
    except _DriverGone as gone:
        if str(gone):
            print(f"ddptrain agent: {gone}; stopping", file=sys.stderr)
        kill_all(children, grace_s)
    except _Reset:
        kill_all(children, grace_s)
        for child in children:  # the pipes of the workers the relay had not drained yet
            for fd in [*child.fds, child.status_fd]:
                if fd != -1:
                    os.close(fd)
            child.fds.clear()
            child.status_fd = -1
        return not notices  # a host being preempted is not kept
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGUSR1, previous_usr1)
        os.set_blocking(out_fd, True)
    return False


def _await_word(link: _DriverLink, children: list[Child], notices: list[int]) -> None:
    """Every worker has exited and the driver knows: wait until it asks for a reset (raises
    :class:`_Reset`) or to stop, goes away or (over SSH) silent (:class:`_DriverGone`). Returns,
    and the agent ends, on a SIGTERM (a host being preempted is not kept)."""
    while not notices:
        readable, _, _ = select.select([link.stdin_fd], [], [], ALIVE_S / 2)
        if readable:
            data = link.read_requests()
            if Request.STATES in data or Request.STACKS in data:  # none left: an empty answer
                _report_states(link, children, dump_stacks=False)
        link.check_heartbeat()
        link.keep_alive()


def wait_for_bootstrap(out_fd: int, stdin_fd: int, heartbeat_s: float | None) -> bytes | None:
    """After a reset: tell the driver (:class:`AgentIdle`) and wait for the payload of its next
    bootstrap frame. ``None`` when the driver is gone, asks the agent to stop, or (over SSH,
    ``heartbeat_s``) is silent that long: the agent then exits. Heartbeats and requests that
    come before the frame are read and dropped (there are no workers to ask about)."""
    link = _DriverLink(out_fd, stdin_fd, heartbeat_s)
    try:
        link.send(encode_event(AgentIdle(AGENT_RANK)))
        while True:
            readable, _, _ = select.select([stdin_fd], [], [], ALIVE_S / 2)
            if readable:
                byte = os.read(stdin_fd, 1)
                if not byte or byte == Request.KILL:
                    return None
                link.last_heard = time.monotonic()
                if byte == Kind.BOOTSTRAP:
                    _, _, size = FRAME.unpack(byte + _read_exactly(stdin_fd, FRAME.size - 1))
                    return _read_exactly(stdin_fd, size)
            link.check_heartbeat()
            link.keep_alive()
    except _DriverGone as gone:
        print(f"ddptrain agent: {gone}; stopping", file=sys.stderr)
        return None
    except (OSError, EOFError):
        return None
    finally:
        os.set_blocking(out_fd, True)


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, missing = [], size
    while missing:
        chunk = os.read(fd, missing)
        if not chunk:
            raise EOFError("the driver's pipe ended inside a frame")
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _tell_preempted(link: _DriverLink, signum: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a SIGTERM from now on ends the agent at once
    name = signal.Signals(signum).name
    print(f"ddptrain agent: {name}: telling the driver that this host is being preempted", file=sys.stderr)
    link.send(encode_event(AgentPreempted(AGENT_RANK, name)))


def _relay_until_done(link: _DriverLink, children: list[Child], notices: list[int]) -> None:
    selector = selectors.DefaultSelector()
    selector.register(link.stdin_fd, selectors.EVENT_READ, ("stdin", None))
    for child in children:
        for fd in child.fds:
            selector.register(fd, selectors.EVENT_READ, ("out", child))
        selector.register(child.status_fd, selectors.EVENT_READ, ("status", child))

    def forward(key: selectors.SelectorKey) -> None:
        what, child = key.data
        data = os.read(key.fd, 65536)
        if not data:
            selector.unregister(key.fd)
            os.close(key.fd)
            if what == "out":
                del child.fds[key.fd]
            else:
                child.status_fd = -1
        elif what == "out":
            link.send(encode_frame(child.fds[key.fd], child.rank, data))
        else:
            child.status.extend(data)

    pending = list(children)  # children whose exit has not been reported
    oom_kills = _memory.oom_kills()  # a worker dead of SIGKILL is then checked against it
    told = False
    while pending:
        if notices and not told:
            told = True
            _tell_preempted(link, notices[0])
        for key, _ in selector.select(_POLL_S):
            if key.data[0] == "stdin":
                data = link.read_requests()
                if Request.STATES in data or Request.STACKS in data:  # the driver asks how the workers are
                    _report_states(link, children, dump_stacks=Request.STACKS in data)
            else:
                forward(key)
        link.check_heartbeat()
        link.keep_alive()
        for child in list(pending):
            if child.exitcode is None and not _reaped(child):
                continue
            drained = not child.fds and child.status_fd == -1
            if not drained and time.monotonic() - child.exited_at < _DRAIN_S:
                continue  # give its last output a moment, so it comes before the exit
            if child.status_fd != -1:  # held open by a process it started; its status is in the pipe
                os.set_blocking(child.status_fd, False)
                try:
                    while chunk := os.read(child.status_fd, 65536):
                        child.status.extend(chunk)
                except BlockingIOError:
                    pass
                selector.unregister(child.status_fd)
                os.close(child.status_fd)
                child.status_fd = -1
            assert child.exitcode is not None
            memory = _memory.evidence(oom_kills, child.maxrss_kb) if child.exitcode == -signal.SIGKILL else None
            link.send(encode_event(WorkerExited(child.rank, child.exitcode, bytes(child.status), memory)))
            pending.remove(child)
