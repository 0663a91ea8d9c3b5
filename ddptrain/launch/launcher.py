"""Starting worker processes on this machine, through one agent process (driver side).

The agent (``python -m ddptrain.agent.main``) runs in its own session, imports torch once and
forks the workers, so every worker starts in about the time of one torch import. Its stdout
carries framed worker output and exit events back; closing its stdin, or a kill frame,
tears the whole tree down. The driver then also kills the agent's process group, which
catches anything the workers started (DataLoader workers included).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Collection
from typing import IO, Any, Protocol

from ddptrain.errors import AgentGoneError, HostLostError
from ddptrain.launch import forkserver
from ddptrain.launch.agent_session import AgentSession, OutputSink
from ddptrain.launch.fanout import each_host
from ddptrain.launch.reaping import exit_status, exited, reap, stopped_by_signal, wait_exited
from ddptrain.wire.agent_events import AgentEvent
from ddptrain.wire.boot import agent_command, import_pins
from ddptrain.wire.protocol import AGENT_RANK, Bootstrap

__all__ = ["GroupLauncher", "HostLauncher", "Launcher", "LocalLauncher", "AgentEvent"]

_logger = logging.getLogger(__name__)


class Launcher(Protocol):
    """Starts a worker group and tears it down."""

    @property
    def unshared_ranks(self) -> Collection[int]:
        """Ranks on hosts that cannot see the run directory: their checkpoint files are fetched."""

    def start(self, bootstrap: Bootstrap, sink: OutputSink, on_event: Callable[[AgentEvent], None]) -> None:
        """Hand the bootstrap to the agents; worker output goes to ``sink``."""

    def shutdown(self, grace_s: float) -> None:
        """Stop every worker: SIGTERM, then SIGKILL after ``grace_s``. Safe to call twice."""

    def reset(self, timeout_s: float) -> bool:
        """Stop every worker but keep the agents for the next :meth:`start` (a restart from warm
        agents); ``False`` when one of them cannot be kept (the caller shuts them all down)."""

    def bind_address(self) -> str:
        """The address the driver's store listens on: the one these agents' workers use."""

    def ask(self, command: bytes) -> None:
        """Send the agents a :class:`~ddptrain.protocol.Request` (worker states, stacks)."""

    def stopped_agents(self) -> list[tuple[str, int]]:
        """``(where, pid)`` of each agent of this machine that is stopped by a signal (see
        :meth:`HostLauncher.stopped_agents`)."""

    def fetch_dir(self, rank: int, remote: str, local: str) -> None:
        """Copy a folder from the host of ``rank`` (one of ``unshared_ranks``) to this machine,
        and delete it there."""


class HostLauncher(Protocol):
    """The agent of one host, as a :class:`GroupLauncher` drives it."""

    def start(self, bootstrap: Bootstrap, sink: OutputSink, on_event: Callable[[AgentEvent], None]) -> None:
        """Hand the host's share of the bootstrap to its agent."""

    def shutdown(self, grace_s: float) -> None:
        """Stop the host's workers and agent. Safe to call twice."""

    def reset(self, timeout_s: float) -> bool:
        """Stop the host's workers, keep its agent for the next :meth:`start` (``AgentSession.reset``)."""

    def ask(self, command: bytes) -> None:
        """Send the agent a :class:`~ddptrain.protocol.Request`."""

    def stopped_agents(self) -> list[tuple[str, int]]:
        """``[(where, pid)]`` while this host's agent runs on this machine and is stopped by a
        signal (SIGSTOP, a debugger): it then answers nothing, and its workers' output, exits
        and states wait for it. Else ``[]``; an agent on another host that stops goes silent,
        and its host is declared lost (``DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S``)."""

    def fetch_dir(self, rank: int, remote: str, local: str) -> None:
        """Copy a folder of this host (where ``rank`` runs) to this machine, and delete it there."""

    def prepare_storage(self, probe: str, run_id: str) -> str | None:
        """``None`` if this host sees the run directory (it can read ``probe``, the run's file
        that holds ``run_id``); else the folder on the host where its workers keep checkpoint
        files until they are fetched."""

    def push_dir(self, local: str, remote: str) -> None:
        """Copy a folder of this machine to ``remote`` on the host."""


class LocalConnection:
    """The pipe to an agent process on this machine, in its own session.

    Args:
        env: Environment of the agent and its workers.
    """

    where = "on this machine"
    stray_output = ""  # an agent started here prints nothing before its frames

    def __init__(self, env: dict[str, str]) -> None:
        self._env = env
        self._reaped = False  # `close` reaped the agent: its session is never signalled again

    def open(self) -> None:
        self._proc: subprocess.Popen[bytes] | forkserver.ForkedAgent
        if forkserver.enabled():
            fds = [*os.pipe(), *os.pipe(), *os.pipe()]  # stdin, stdout, stderr: (read, write) each
            try:
                agent = forkserver.spawn(self._env, fds[0], fds[3], fds[5])
                forked = agent.pid is not None  # waits for the server's first torch import, if any
                why = "" if forked else agent.server_exit()
            except OSError as exc:
                forked, why = False, str(exc)
            for fd in (fds[0], fds[3], fds[5]) if forked else fds:
                os.close(fd)
            if forked:
                self._proc = agent
                self.stdin: IO[bytes] | None = os.fdopen(fds[1], "wb")
                self.stdout: IO[bytes] = os.fdopen(fds[2], "rb")
                self.stderr: IO[bytes] = os.fdopen(fds[4], "rb")
                return
            # The server could not be started, reached, or it ended before it forked the agent.
            _logger.warning("ddptrain: the agent fork server did not start an agent (%s); starting a new process", why)
        self._proc = subprocess.Popen(
            agent_command(sys.executable, import_pins()),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self._env,
            start_new_session=True,
        )
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self.stdin, self.stdout, self.stderr = self._proc.stdin, self._proc.stdout, self._proc.stderr

    @property
    def agent_pid(self) -> int | None:
        """The agent's pid once started (``None`` before, or when a fork server ended first)."""
        proc = getattr(self, "_proc", None)
        return None if proc is None else proc.pid

    def _ended(self) -> bool:
        proc = self._proc  # a plain process is not reaped before its group was killed (`reaping`)
        return exited(proc) if isinstance(proc, subprocess.Popen) else proc.poll() is not None

    def probe(self) -> bool:
        return not self._ended()  # this machine always answers; its agent may have exited

    def write(self, data: bytes) -> None:
        stdin = self.stdin
        if stdin is None or self._ended():
            raise BrokenPipeError("the agent has exited")
        try:
            stdin.write(data)
            stdin.flush()
        except ValueError:  # closed at shutdown
            raise BrokenPipeError("the agent's stdin is closed") from None

    def wait_ready(self) -> None:
        pass  # frames from the first byte

    def exit_code(self) -> int | None:
        proc = self._proc
        if isinstance(proc, subprocess.Popen):
            return exit_status(proc, 2.0)
        try:
            return proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return None

    def abort(self) -> None:
        self._kill_session()

    def stopped_pid(self) -> int | None:
        """The agent's pid while it is stopped by a signal; ``None`` otherwise (or once reaped)."""
        pid = self._proc.pid  # None: a fork server ended before it forked this agent
        if pid is None or self._reaped or self._ended():
            return None
        return pid if stopped_by_signal(pid) else None

    def _kill_session(self) -> None:
        pid = self._proc.pid  # None: a fork server ended before it forked this agent
        if pid is None or self._reaped:
            return  # reaped (or handed back to its fork server): its pid may be a stranger's now
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self, grace_s: float) -> None:
        proc = self._proc
        if isinstance(proc, subprocess.Popen):
            stopped = wait_exited(proc, grace_s + 1.0)  # not reaped: its pid names its session until killpg
        else:
            try:
                proc.wait(timeout=grace_s + 1.0)
                stopped = True
            except subprocess.TimeoutExpired:
                stopped = False
        if not stopped:
            _logger.warning("ddptrain agent %s did not stop in %.1f s; killing it", proc.pid, grace_s + 1)
        # Whatever is left in the agent's session (its workers' own children too) goes now.
        self._kill_session()
        self._reaped = True  # or left for good (reap warns): its session is not signalled again
        reap(proc, "the ddptrain agent")
        if isinstance(proc, forkserver.ForkedAgent):
            proc.release()  # its process group is gone: the server may reap it
        for pipe in (self.stdin, self.stdout, self.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


class LocalLauncher:
    """Runs the workers of this machine under one agent process.

    Args:
        env: Environment of the agent and its workers.
    """

    unshared_ranks: Collection[int] = frozenset()  # this machine sees every run directory

    def __init__(self, env: dict[str, str]) -> None:
        self._connection = LocalConnection(env)
        self._session = AgentSession(self._connection, heartbeat_s=None, label="ddptrain agent")
        self._session.open()

    def bind_address(self) -> str:
        return "127.0.0.1"  # a local run's store is never reachable from elsewhere

    def ask(self, command: bytes) -> None:
        self._session.ask(command)

    def stopped_agents(self) -> list[tuple[str, int]]:
        pid = self._connection.stopped_pid()
        return [] if pid is None else [(self._connection.where, pid)]

    def start(self, bootstrap: Bootstrap, sink: OutputSink, on_event: Callable[[AgentEvent], None]) -> None:
        self._session.start(bootstrap, sink, on_event)

    def shutdown(self, grace_s: float) -> None:
        self._session.shutdown(grace_s)

    def reset(self, timeout_s: float) -> bool:
        return self._session.reset(timeout_s)

    def prepare_storage(self, probe: str, run_id: str) -> None:
        return None

    def push_dir(self, local: str, remote: str) -> None:
        raise RuntimeError("a local agent sees the run directory; nothing is copied to it")

    def fetch_dir(self, rank: int, remote: str, local: str) -> None:
        raise RuntimeError("a local agent sees the run directory; nothing is fetched from it")


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "localhost")


def _bind_address(addresses: list[str]) -> str:
    """Where a multi-host run's store listens: the one address the hosts reach this machine
    at (loopback when every host is this machine), or every interface when they use several."""
    remote = sorted({a for a in addresses if not _is_loopback(a)})
    if not remote:
        return "127.0.0.1"
    if len(remote) == 1:
        return remote[0]
    _logger.info(
        "ddptrain: the hosts reach this machine at several addresses (%s); the store listens on all "
        "interfaces (messages stay signed; see docs/security.md)",
        ", ".join(remote),
    )
    return "::" if any(":" in a for a in remote) else "0.0.0.0"


class GroupLauncher:
    """Launchers of several hosts driven as one: each gets its node's share of the bootstrap.

    Args:
        launchers: ``(launcher, store address as seen from that host)`` by node rank.
    """

    def __init__(self, launchers: list[tuple[HostLauncher, str]], keys: list[Any] | None = None) -> None:
        # Each host's launcher as given, by its key (``Plan.host_key``): kept for a later group.
        self._given = dict(zip(keys, launchers, strict=True)) if keys is not None else {}
        self._launchers = launchers
        self._bind = _bind_address([address for _, address in launchers])
        if not _is_loopback(self._bind):  # local agents reach the store at that address too
            self._launchers = [(launcher, self._bind if _is_loopback(a) else a) for launcher, a in launchers]
        self._by_rank: dict[int, HostLauncher] = {}
        self.unshared_ranks: set[int] = set()

    def bind_address(self) -> str:
        return self._bind

    def ask(self, command: bytes) -> None:
        for launcher, _ in self._launchers:
            launcher.ask(command)

    def stopped_agents(self) -> list[tuple[str, int]]:
        return [stopped for launcher, _ in self._launchers for stopped in launcher.stopped_agents()]

    def fetch_dir(self, rank: int, remote: str, local: str) -> None:
        self._by_rank[rank].fetch_dir(rank, remote, local)

    def _host_share(self, launcher: HostLauncher, share: Bootstrap) -> Bootstrap:
        """A host's share as it must see the run: for a host that cannot see the run directory,
        marked so, with the checkpoint to resume from copied into its staging folder (which the
        launcher removes when it shuts down, or the next run on that host if this driver is
        killed first)."""
        run = share.run
        storage = run.storage
        if not storage.run_dir or storage.probe is None:
            return share  # a group that runs functions has no run directory to share
        cache = launcher.prepare_storage(storage.probe, run.run_id)
        if cache is None:
            return share
        self.unshared_ranks.update(spec.rank for spec in share.workers)
        on_host, resume_to = storage.on_unshared_host(cache, run.attempt)
        if resume_to is not None:
            launcher.push_dir(storage.checkpoint, resume_to)  # type: ignore[arg-type]
        return dataclasses.replace(share, run=dataclasses.replace(run, storage=on_host))

    def start(self, bootstrap: Bootstrap, sink: OutputSink, on_event: Callable[[AgentEvent], None]) -> None:
        """Hand each host its share, one after the other.

        Raises:
            HostLostError: A host stopped answering before its agent got its work (its ranks named).
            AgentGoneError: A host's agent, which had started, was gone (its ranks named).
            LaunchError: A host's agent or storage could not be started.
        """
        self._by_rank.clear()
        self.unshared_ranks.clear()
        for node, (launcher, address) in enumerate(self._launchers):
            workers = tuple(
                dataclasses.replace(spec, env={**spec.env, "MASTER_ADDR": address})
                for spec in bootstrap.workers
                if spec.node_rank == node
            )
            share = dataclasses.replace(
                bootstrap, workers=workers, store=dataclasses.replace(bootstrap.store, host=address)
            )
            self._by_rank.update((spec.rank, launcher) for spec in workers)
            first = min(spec.rank for spec in workers)

            def tagged(event: AgentEvent, first: int = first) -> None:
                if event.rank == AGENT_RANK:  # name the agent by its first rank
                    event = dataclasses.replace(event, rank=first)
                on_event(event)

            try:
                launcher.start(self._host_share(launcher, share), sink, tagged)
            except HostLostError as exc:  # with the ranks it was to run
                ranks = [spec.rank for spec in workers]
                raise HostLostError(exc.host, exc.silent_s, exc.timeout_s, ranks, exc.stopped_pid) from None
            except AgentGoneError as exc:
                raise AgentGoneError(exc.what, [spec.rank for spec in workers]) from None

    def shutdown(self, grace_s: float) -> None:
        each_host(
            lambda launcher: launcher.shutdown(grace_s), [launcher for launcher, _ in self._launchers], grace_s + 10.0
        )

    def take(self, keys: set[Any], timeout_s: float) -> dict[Any, tuple[HostLauncher, str]]:
        """Reset the agents of the hosts whose keys are in ``keys`` (at once) and hand over
        those that can be kept, by key: this group's :meth:`shutdown` leaves them alone."""
        wanted = [(key, pair) for key, pair in self._given.items() if key in keys]
        results = each_host(lambda item: item[1][0].reset(timeout_s), wanted, timeout_s + 5.0)
        kept = {key: pair for (key, pair), ok in zip(wanted, results, strict=True) if ok is True}
        taken = {id(pair[0]) for pair in kept.values()}
        self._launchers = [pair for pair in self._launchers if id(pair[0]) not in taken]
        self._given = {key: pair for key, pair in self._given.items() if key not in kept}
        return kept

    def reset(self, timeout_s: float) -> bool:
        """Reset every host's agent at once; ``True`` only if each of them can be kept."""
        results = each_host(
            lambda launcher: launcher.reset(timeout_s), [launcher for launcher, _ in self._launchers], timeout_s + 5.0
        )
        return all(result is True for result in results)
