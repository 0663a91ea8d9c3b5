"""What happens to the workers of a group, as the driver learns it: the event pump.

Three kinds of threads feed one queue: the channel thread (batches of worker messages, or why
it stopped), the launcher threads (agent events: a worker started or exited, an agent failed or
is gone) and the log sink (a write error). The driver thread drains it with
:meth:`GroupEvents.poll`, which keeps track of which ranks joined, returned and exited, and
returns what its caller acts on: a run's messages (:class:`MessagesHandled`), the workers'
process states (:class:`StatesReported`), a periodic check that is due (:class:`TickDue`) and
the first failure, with the other ranks failing at about the same time (:class:`FailureSeen`),
after which the group is dead. Nothing is called back: the attempt and the controller decide.
:meth:`GroupEvents.pump_until` polls for the group's own waits (workers joining, function
results) and raises :class:`GroupFailed` on a failure. ``ddptrain.driver.worker_group`` builds
on this what the driver asks of its workers.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import queue
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ddptrain.driver.logs import LogSink
from ddptrain.driver.plan import Plan
from ddptrain.errors import (
    ChannelError,
    HostLostError,
    LaunchError,
    WorkerDiedError,
    WorkerError,
    WorkerFailure,
    WorkerGroupError,
    describe_exitcode,
    peer_gone,
)
from ddptrain.wire import agent_events, protocol
from ddptrain.wire.driver_channel import Batch, DriverChannel, Undelivered
from ddptrain.wire.sealing import StoreTamperedError

__all__ = [
    "FailureSeen",
    "GroupEvent",
    "GroupEvents",
    "GroupFailed",
    "agent_death",
    "HostPreempted",
    "MessagesHandled",
    "StatesReported",
    "TickDue",
    "failure_from_record",
]

_logger = logging.getLogger(__name__)
_PUMP_S = 0.5
_TICK_S = 0.1
# What a run's attempt handles (``MessagesHandled.run``); the rest is the group's own.
_RUN_MESSAGES = (protocol.Report, protocol.Uploaded, protocol.Collective, protocol.CheckpointsQuery)


@dataclass(frozen=True)
class MessagesHandled:
    """A batch of worker messages arrived (the workers are active); ``run``: the run's messages
    among them (reports, collectives, checkpoint queries), in the order they came."""

    run: tuple[Any, ...] = ()


@dataclass(frozen=True)
class StatesReported:
    """An agent sent its workers' process states (for the hang watchdog)."""

    states: dict[int, dict[str, Any]]


@dataclass(frozen=True)
class TickDue:
    """Time for the periodic checks (a few times a second); ``last_output``: when a worker last
    printed anything (``time.monotonic()``)."""

    last_output: float


@dataclass(frozen=True)
class FailureSeen:
    """The group failed (root cause first, with the ranks that failed at about the same time).
    The group is dead from here on: shut it down."""

    failures: tuple[WorkerFailure, ...]


@dataclass(frozen=True)
class HostPreempted:
    """The agent on ``host`` got ``signal`` (SIGTERM, or SLURM's SIGUSR1 warning): the host is
    being preempted (or shut down)."""

    host: str
    signal: str = "SIGTERM"


GroupEvent = MessagesHandled | StatesReported | TickDue | HostPreempted | FailureSeen


def agent_death(code: int | None) -> str:
    """How an agent ended, from its exit code (``None``: its connection was lost). Over SSH and
    ``srun``, a signal that killed it arrives as ``128 + signal``."""
    if code is None:
        return "connection lost"
    how = describe_exitcode(code)
    if 128 < code < 128 + signal.NSIG:
        with contextlib.suppress(ValueError):
            how += f", as a remote process killed by {signal.Signals(code - 128).name} ends"
    if code in (-signal.SIGKILL, 128 + signal.SIGKILL):
        how += "; SIGKILL often means the kernel's out-of-memory killer"
    return how


class GroupFailed(WorkerGroupError):
    """The worker group failed; ``failures`` says how (first failure first). The group is dead."""

    def __init__(self, failures: list[WorkerFailure]) -> None:
        error = WorkerGroupError.from_failures(failures, None)
        super().__init__(str(error), error.worker_failures, error.failures)
        self.__cause__ = error.__cause__

    @property
    def lost_ranks(self) -> list[int]:
        """Ranks whose process died or became unreachable, as opposed to ranks whose code raised."""
        lost = (WorkerDiedError, LaunchError, StoreTamperedError)
        return sorted(f.rank for f in self.failures if isinstance(f.exception, lost))


def failure_from_record(record: protocol.FailureRecord) -> BaseException:
    """The worker's exception from its failure record, or a stand-in with its traceback."""
    if record.exception:
        try:
            exc: BaseException = pickle.loads(record.exception)
            return exc
        except Exception:
            pass
    return WorkerError(record.type, record.message, record.traceback)


class GroupEvents:
    """The event pump of a worker group (:meth:`poll`) and what it has learned of each rank.

    Args:
        plan: Where the ranks run (to name their hosts in failures).
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.hosts: dict[int, tuple[int, str]] = {}
        self.connected: set[int] = set()
        self.exited: set[int] = set()
        self.done: dict[int, tuple[bytes | None, str | None]] = {}  # ranks whose function returned
        self.exit_expected = False
        self.finishing = False  # every rank returned; failures from here on are not retried
        self.sink: LogSink | None = None
        self.channel: DriverChannel | None = None
        self._results: dict[int, dict[int, tuple[bool, Any]]] = {}  # call id -> rank -> (ok, value)
        self._next_tick = 0.0
        self._unreleased = 0  # bytes of the batches the last poll() returned, released by the next
        self._observer: Callable[[GroupEvent], None] | None = None  # see `observed`
        self._failed = False  # a call or a worker failed: the group takes no more work

    def poll(self, timeout_s: float = _PUMP_S) -> list[GroupEvent]:
        """Handle what happened since the last call (waiting up to ``timeout_s`` for something)
        and return what the caller acts on, in order; a :class:`FailureSeen` comes last.

        The channel's flow control counts a batch's messages as in flight until the next call,
        so a caller that is slow to act on them holds the workers back.

        Raises:
            ChannelError: The driver's own store channel stopped.
            OSError: A log file could not be written (a full disk).
        """
        self._release()
        events: list[GroupEvent] = []
        try:
            event = self.events.get(timeout=timeout_s)
        except queue.Empty:
            event = None
        failures = self._dispatch(event, events) if event is not None else []
        if failures:
            # Gather the other ranks that failed on their own at about the same time.
            deadline = time.monotonic() + 0.2
            while time.monotonic() < deadline:
                try:
                    more = self._dispatch(self.events.get(timeout=0.05), events)
                except queue.Empty:
                    continue
                for failure in more:
                    if failure.rank not in {f.rank for f in failures}:
                        failures.append(failure)
            for failure in failures:  # a rank's return read after the failure of a peer it left waiting
                if not failure.note and peer_gone(failure):
                    failure.note = self._returned_note(failure.rank)
            self.fail(failures)
            events.append(FailureSeen(tuple(failures)))
            return events
        now = time.monotonic()
        if now >= self._next_tick:  # not per event: a fast rank 0 may be far ahead
            self._next_tick = now + _TICK_S
            events.append(TickDue(self.sink.last_write if self.sink is not None else 0.0))
        return events

    def _release(self) -> None:
        if self._unreleased and self.channel is not None:
            self.channel.release(self._unreleased)
        self._unreleased = 0

    @contextlib.contextmanager
    def observed(self, observer: Callable[[GroupEvent], None]) -> Iterator[None]:
        """While the caller is inside the group's own blocking calls (``start``, ``execute``,
        ``stop_workers``...), hand it what their waits see besides a failure (which they
        raise): ticks, states, activity. The attempt keeps its console clock and the hang
        watchdog (``ddptrain stack`` during a process group's setup) going this way."""
        previous, self._observer = self._observer, observer
        try:
            yield
        finally:
            self._observer = previous

    def pump_until(self, done: Callable[[], bool], timeout_s: float | None = None, waiting_for: str = "") -> None:
        """Poll until ``done()`` (the group's own waits: workers joining, function results);
        raises GroupFailed on a failure, TimeoutError after ``timeout_s``. A run's messages
        arriving here are outside a training run, and ignored; the rest goes to the
        :meth:`observed` caller, if any."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not done():
                for event in self.poll():
                    if isinstance(event, FailureSeen):
                        raise GroupFailed(list(event.failures))
                    if isinstance(event, MessagesHandled):
                        for message in event.run:
                            _logger.warning("ddptrain: a worker sent %r outside a training run; ignored", message)
                    if self._observer is not None:
                        self._observer(event)
                if deadline is not None and time.monotonic() > deadline and not done():
                    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {waiting_for}")
        finally:
            self._release()

    def fail(self, failures: list[WorkerFailure]) -> GroupFailed:
        """The error that ends this group. From here on the group is dead: :meth:`shutdown`
        kills it without asking its workers anything (a rank may be stuck in a collective with
        the one that failed)."""
        self._failed = True
        return GroupFailed(failures)

    def _dispatch(self, event: tuple[str, Any], events: list[GroupEvent]) -> list[WorkerFailure]:
        source, item = event
        if source == "sink":  # a log file could not be written (a full disk): the driver's failure
            raise item
        if source == "channel":
            return [self._channel_failed(item)]
        if source == "msgs":
            return self._handle_batch(item, events)
        if isinstance(item, agent_events.WorkerStates):
            events.append(StatesReported(item.states))
            return []
        if isinstance(item, agent_events.AgentPreempted):
            first = self.plan.ranks_of_agent(None if item.rank == protocol.AGENT_RANK else item.rank)[0]
            events.append(HostPreempted(self.plan.host_of(first), item.signal))
            return []
        failure = self._handle_agent(item)
        return [failure] if failure is not None else []

    def _channel_failed(self, error: BaseException) -> WorkerFailure:
        """The channel thread stopped: tampering that names a rank fails that rank (as a lost
        message does); anything else ends the run at once."""
        if isinstance(error, StoreTamperedError) and error.rank is not None:
            return self.failure(error.rank, None, error)
        self._failed = True
        if isinstance(error, ChannelError):
            raise error
        raise ChannelError(f"the driver's store channel failed: {error}") from error

    def _handle_batch(self, batch: Batch, events: list[GroupEvent]) -> list[WorkerFailure]:
        """The group's own messages are handled here; the run's go to the caller, in order."""
        failures: list[WorkerFailure] = []
        run: list[Any] = []
        self._unreleased += batch.nbytes
        for message in batch.messages:
            if isinstance(message, _RUN_MESSAGES):
                run.append(message)
                continue
            failure = self._handle_message(message)
            if failure is not None:
                failures.append(failure)
        events.append(MessagesHandled(tuple(run)))
        return failures

    def _handle_message(self, message: Any) -> WorkerFailure | None:
        if isinstance(message, protocol.Hello):
            self.connected.add(message.rank)
            self.hosts[message.rank] = (message.pid, message.host)
        elif isinstance(message, protocol.CallResult):
            self._results.setdefault(message.call_id, {})[message.rank] = (message.ok, message.value)
        elif isinstance(message, protocol.Done):
            self.done[message.rank] = (message.returned, message.note)
        elif isinstance(message, Undelivered):
            return self.failure(message.rank, None, message.error)
        else:
            _logger.warning("ddptrain: a worker sent %r outside a training run; ignored", message)
        return None

    def _handle_agent(self, event: agent_events.AgentEvent) -> WorkerFailure | None:
        if isinstance(event, (agent_events.WorkerStates, agent_events.AgentPreempted)):  # returned by poll()
            return None
        if isinstance(event, agent_events.AgentIdle):  # kept by the session, never handed on
            return None
        if isinstance(event, agent_events.WorkerStarted):
            self.hosts.setdefault(event.rank, (event.pid, event.host))
            return None
        if isinstance(event, agent_events.WorkerExited):
            return self._worker_exited(event)
        # Agent events name the agent by its first rank (AGENT_RANK: the only agent).
        agent_ranks = self.plan.ranks_of_agent(None if event.rank == protocol.AGENT_RANK else event.rank)
        if isinstance(event, agent_events.AgentFailed):
            error = LaunchError(f"The ddptrain agent could not start the workers:\n{event.text}")
            return self.failure(agent_ranks[0], None, error, event.text)
        missing = sorted(set(agent_ranks) - self.exited)
        if isinstance(event, agent_events.AgentLost):
            if not missing or self.exit_expected:
                return None
            host = self.plan.host_of(missing[0])
            lost = HostLostError(host, event.silent_s, event.timeout_s, missing, event.stopped_pid)
            return self.failure(missing[0], None, lost)
        if missing and not self.exit_expected:
            code, said = event.exitcode, f"; it said: {event.last_words}" if event.last_words else ""
            error = LaunchError(
                f"The ddptrain agent that runs rank(s) {missing} on {self.plan.host_of(missing[0])} "
                f"died ({agent_death(code)}{said}); its workers died with it."
            )
            return self.failure(missing[0], None, error)
        return None

    def _worker_exited(self, event: agent_events.WorkerExited) -> WorkerFailure | None:
        rank, exitcode = event.rank, event.exitcode
        self.exited.add(rank)
        if event.status:  # it wrote a failure record
            record = pickle.loads(event.status)
            return self.failure(rank, exitcode, failure_from_record(record), record.traceback, record.time)
        if self.exit_expected:
            return None
        return self.failure(rank, exitcode, WorkerDiedError(rank, exitcode, event.memory))

    def _pid_host(self, rank: int) -> tuple[int | None, str]:
        pid, host = self.hosts.get(rank, (None, self.plan.hostname))
        if self.plan.placement is not None:
            host = self.plan.host_of(rank)  # the host list's name for it
        return pid, host

    def where(self, rank: int) -> str:
        pid, host = self._pid_host(rank)
        return f"rank {rank} (host {host}, pid {pid})"

    def _returned_note(self, rank: int) -> str:
        """The note for a failure of ``rank`` while other ranks had returned (its collective
        then fails for want of them)."""
        returned = sorted(r for r in self.done if r != rank)
        if not returned or self.finishing:
            return ""
        return (
            f"rank(s) {returned} had already returned from the training function; a rank that returns "
            "early makes its peers' collectives fail"
        )

    def failure(
        self, rank: int, exitcode: int | None, exc: BaseException, traceback_str: str = "", at: float | None = None
    ) -> WorkerFailure:
        """What the driver knows of a failure of ``rank`` (``at``: when the worker saw it, if it
        said; else now)."""
        pid, host = self._pid_host(rank)
        note = self._returned_note(rank)
        return WorkerFailure(
            rank=rank,
            host=host,
            pid=pid,
            exitcode=exitcode,
            exception=exc,
            traceback_str=traceback_str,
            log_path=self.sink.path(rank) if self.sink is not None else None,
            timestamp=at if at is not None else time.time(),
            log_tail=self.sink.tail(rank) if self.sink is not None else [],
            note=note,
        )
