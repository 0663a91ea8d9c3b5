"""One attempt of a run: a worker group runs the training function once, and its reports are
gathered into rounds.

The attempt polls its :class:`~ddptrain.driver.worker_group.WorkerGroup`
(``group.poll()``): the group handles what every group has (workers joining, function results,
agent events, lost messages) and returns the run's own messages (report, collective,
checkpoints), the workers' states for the hang watchdog, ticks, and the first failure. The
attempt ends with an :data:`Outcome`: :class:`Succeeded`, :class:`Failed`, or :class:`Preempted`
(a preemption notice, ``ddptrain.driver.preemption``: the workers were told, and the attempt
stopped once a checkpoint was committed after it, or at its deadline); what follows (a
restart, or the run's end) is the controller's decision.

The attempt sees its run through two narrow views: an :class:`AttemptContext` (what starting and
steering the group needs) and a :class:`ReportSink` (where the reports go), which ``Run``
implements. Those views and the outcomes live in :mod:`ddptrain.driver.attempt_types` (and are
re-exported here); a round and the warnings about late ranks in :mod:`ddptrain.driver.rounds`.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import cloudpickle

from ddptrain.checkpoint import Checkpoint
from ddptrain.driver import preemption
from ddptrain.driver.attempt_types import (
    AttemptContext,
    Failed,
    Outcome,
    Preempted,
    ReportSink,
    Resized,
    Succeeded,
)
from ddptrain.driver.group_events import (
    FailureSeen,
    GroupEvent,
    HostPreempted,
    MessagesHandled,
    StatesReported,
    TickDue,
    failure_from_record,
)
from ddptrain.driver.rounds import Round, warn_stragglers, warn_unfinished
from ddptrain.driver.watchdog import Watch
from ddptrain.driver.worker_group import GroupFailed, WorkerGroup
from ddptrain.errors import LaunchError, WorkerFailure, is_disk_full
from ddptrain.wire import protocol

__all__ = [
    "Attempt",
    "AttemptContext",
    "Failed",
    "GroupFailed",
    "Outcome",
    "Preempted",
    "ReportSink",
    "Resized",
    "Succeeded",
]

_logger = logging.getLogger(__name__)
_POLL_S = 0.5  # the longest wait for the group's next event


class Attempt:
    """One run of the training function on a worker group, from its start to its end.

    Args:
        context: What the attempt needs of its run.
        reports: Where its reports go.
        group: The workers: not started yet, or warm from an earlier ``fit()``.
        keep: Leave the workers running when training succeeds (the group goes on warm).
        clock: ``time.monotonic`` (a test's fake clock).
        watch: An elastic run's watch on the hosts it left out (``ddptrain.driver.elastic.HostWatch``):
            once one answers again, the attempt stops at the next committed checkpoint.
    """

    def __init__(
        self,
        context: AttemptContext,
        reports: ReportSink,
        group: WorkerGroup,
        keep: bool = False,
        clock: Callable[[], float] = time.monotonic,
        watch: Any = None,
    ) -> None:
        self.context = context
        self.reports = reports
        self.index = context.index
        self.group = group
        self.keep = keep
        self.clock = clock
        self.world_size = group.world_size
        # Open rounds by kind, then index; created in the order of their indices (each rank
        # calls in order), so the first of a kind is its oldest.
        self.rounds: dict[str, dict[int, Round]] = {"report": {}, "collective": {}}
        self.staged_rounds: set[int] = set()  # open report rounds that a rank passed files to
        # Report rounds every rank made, in report order, waiting for their ranks' background
        # uploads (ASYNC) or for an earlier round to commit: (index, entries by rank).
        self.to_commit: collections.deque[tuple[int, list[protocol.Report]]] = collections.deque()
        self.uploaded: dict[int, dict[int, str]] = {}  # report index -> rank -> its uploaded folder
        # get_all_reported_checkpoints() calls waiting for earlier reports (and validations, if
        # `validated`): (rank, index, deadline, validated)
        self.checkpoint_waiters: list[tuple[int, int, float | None, bool]] = []
        self.watch = Watch(context.run_dir, group.ask, group.where, group.stopped_agents)
        self.notice: preemption.Notice | None = None  # the preemption notice the workers were given
        self.after_notice: Checkpoint | None = None  # a checkpoint committed since
        self.watch_hosts = watch
        self.back: tuple[str, ...] = ()  # hosts left out that answer again
        self.after_back: Checkpoint | None = None  # a checkpoint committed since they do

    # ----------------------------------------------------------------- lifecycle
    def run(self) -> Outcome:
        """Run the training function on every worker until every rank returned, or one failed.

        On success the workers have exited, unless ``keep``. On a failure the group is dead and
        left for the caller to shut down. Errors of the driver itself (its channel, a full disk
        where it writes) are raised, the group shut down.
        """
        group, ctx = self.group, self.context
        try:
            with group.observed(self._observe):  # the group's own waits: starting, the backend's setup
                if group.started:  # warm from an earlier fit(): the workers switch to this run
                    port = group.next_run(ctx.log_dir, console=ctx.progress)
                    group.begin_run(ctx.run_info, ctx.payload, ctx.datasets, port)
                else:
                    group.start(
                        payload=ctx.payload,
                        run=ctx.run_info,
                        log_dir=ctx.log_dir,
                        datasets=ctx.datasets,
                        console=ctx.progress,
                    )
                backend = ctx.backend_config.make_backend()
                backend.on_start(group, ctx.backend_config)
                backend.on_training_start(group, ctx.backend_config)
            self.watch.active = True
            self.watch.activity()
            for rank in range(self.world_size):
                group.send(rank, protocol.Train())
            while len(group.done) < self.world_size:
                failed = self._handle(group.poll(_POLL_S))
                if failed is not None:
                    return self._failed(failed)
                stop = self._preempted() or self._resized()
                if stop is not None and len(group.done) < self.world_size:
                    return stop
            with group.observed(self._observe):
                self._finish(backend)
            return Succeeded([self._load_return(rank) for rank in range(self.world_size)], self.keep)
        except GroupFailed as exc:  # from the group's own calls (start, execute), or a round's check
            return self._failed(exc.failures)
        except BaseException:
            group.shutdown()
            raise
        finally:
            self.watch.active = False

    def _failed(self, failures: list[WorkerFailure] | tuple[WorkerFailure, ...]) -> Failed:
        self.watch.active = False
        retryable = not self.group.finishing and not any(is_disk_full(f.exception) for f in failures)
        return Failed(tuple(failures), retryable)

    def _observe(self, event: GroupEvent) -> None:
        """What the group's own blocking calls saw (their failures they raise)."""
        self._handle([event])

    def _handle(self, events: list[GroupEvent]) -> tuple[WorkerFailure, ...] | None:
        """Act on what the group saw; the failures if it failed."""
        for event in events:
            if isinstance(event, MessagesHandled):
                self.watch.activity()
                if event.run:
                    self._handle_run_messages(list(event.run))
            elif isinstance(event, StatesReported):
                self.watch.on_states(event.states)
            elif isinstance(event, TickDue):
                if self.reports.validations.poll():
                    self._answer_checkpoint_waiters()
                self._check_rounds()
                self.context.progress.tick()
                self.watch.check(event.last_output)
            elif isinstance(event, HostPreempted):
                preemption.request_preemption(f"{event.signal} to the agent on host {event.host}", hosts=[event.host])
            elif isinstance(event, FailureSeen):
                return event.failures
        return None

    def _preempted(self) -> Preempted | None:
        """Tell the workers of a preemption notice once; stop once a checkpoint was committed
        after it, or at its deadline (at once after a second notice)."""
        notice = preemption.pending()
        if notice is None:
            return None
        if self.notice is None or notice.hosts != self.notice.hosts:  # new, or more hosts going away
            self.notice = notice
            self._tell_workers(notice)
        if self.after_notice is not None or notice.expired():
            return Preempted(notice, self.after_notice)
        return None

    def _resized(self) -> Resized | None:
        """Stop for a larger group at the first checkpoint committed once hosts left out
        answer again (the hosts' watch is polled, never called back)."""
        if self.watch_hosts is None:
            return None
        if not self.back:
            self.back = tuple(self.watch_hosts.back())
            if self.back:
                self.context.progress.say(
                    f"ddptrain: host(s) {', '.join(self.back)} answer again; the group grows at the next checkpoint"
                )
            return None
        return Resized(self.back, self.after_back) if self.after_back is not None else None

    def _tell_workers(self, notice: preemption.Notice) -> None:
        nodes: dict[str, list[int]] = {}
        for rank in range(self.world_size):
            host = self.group.host_of(rank)
            if notice.hosts is None or host in notice.hosts:
                nodes.setdefault(host, []).append(rank)
        message = protocol.Preempt(notice.deadline_ms, nodes, notice.reason)
        for rank in range(self.world_size):
            self.group.notify(rank, message)
        window = max(0.0, notice.deadline - time.monotonic())
        self.context.progress.say(
            f"ddptrain: preemption notice ({notice.reason}): the workers have {window:.0f} s to report a "
            "checkpoint; the run stops once one is committed"
        )

    def _finish(self, backend: Any) -> None:
        """Every rank returned: run the backend's teardown and let the workers exit (or wait
        for the next run). Training succeeded, so problems from here on are logged, not raised."""
        self.group.finishing = True
        self.watch.active = False
        self._drop_unfinished_rounds()
        try:
            backend.on_shutdown(self.group, self.context.backend_config)
        except Exception as exc:
            _logger.warning("ddptrain: the backend's shutdown failed after training finished (ignored): %s", exc)
        if not self.keep or not self.group.alive:
            self.group.stop_workers()

    def _load_return(self, rank: int) -> Any:
        data, note = self.group.done[rank]
        if note:
            _logger.warning("ddptrain: %s", note)
        return cloudpickle.loads(data) if data is not None else None

    # ----------------------------------------------------------------- the run's messages
    def _handle_run_messages(self, messages: list[Any]) -> None:
        """Messages in the order they came. Rank 0's metrics go to ``metrics.jsonl`` in one write
        for all of them, flushed before anything that depends on them (a checkpoint's commit,
        its acknowledgement, the callbacks) and before the group handles anything else."""
        try:
            for message in messages:
                if isinstance(message, protocol.Report):
                    if message.rank == 0:
                        self.reports.record_metrics(message.metrics, self.index)
                    self._add_to_round("report", message.index, message.rank, message)
                elif isinstance(message, protocol.Uploaded):
                    self._on_uploaded(message)
                elif isinstance(message, protocol.Collective):
                    self._add_to_round("collective", message.index, message.rank, message)
                elif isinstance(message, protocol.CheckpointsQuery):
                    deadline = None if message.timeout_s is None else self.clock() + message.timeout_s
                    self.checkpoint_waiters.append((message.rank, message.index, deadline, message.validated))
                    self._answer_checkpoint_waiters()
                else:
                    _logger.warning("ddptrain: unexpected message %r ignored", message)
        finally:
            self.reports.flush_metrics()

    def _add_to_round(self, kind: str, index: int, rank: int, entry: Any) -> None:
        rounds = self.rounds[kind]
        round_ = rounds.get(index)
        if round_ is None:
            round_ = rounds[index] = Round(kind, index, self.clock())
        round_.entries[rank] = entry
        if kind == "report" and entry.staged:
            self.staged_rounds.add(index)
        if len(round_.entries) < self.world_size:
            return
        del rounds[index]
        self.staged_rounds.discard(index)
        if kind == "collective":
            for r in range(self.world_size):
                self.group.send(r, protocol.CollectiveResult(index, round_.entries[0].data))
            return
        self.to_commit.append((index, [round_.entries[r] for r in range(self.world_size)]))
        self._commit_ready()

    def _on_uploaded(self, message: protocol.Uploaded) -> None:
        """A rank's background upload ended: its folder is recorded for the commit, or the
        group fails with its error (a ``StorageError`` naming the store)."""
        if message.staged is None:
            record = protocol.FailureRecord(
                time.time(), "ddptrain.errors.StorageError", message.text, message.text, message.error
            )
            error = failure_from_record(record)
            raise self.group.fail([self.group.failure(message.rank, None, error, message.text)])
        self.uploaded.setdefault(message.index, {})[message.rank] = message.staged
        self._commit_ready()

    def _commit_ready(self) -> None:
        """Commit the report rounds whose files are all there, in report order (a round whose
        uploads are still running holds back the rounds after it, with their callbacks)."""
        while self.to_commit:
            index, entries = self.to_commit[0]
            uploaded = self.uploaded.get(index, {})
            if any(entry.pending and entry.rank not in uploaded for entry in entries):
                return
            self.to_commit.popleft()
            self.uploaded.pop(index, None)
            self._commit(index, entries, uploaded)

    def _commit(self, index: int, entries: list[protocol.Report], uploaded: dict[int, str]) -> None:
        staged_of: dict[int, str] = {}
        for entry in entries:
            folder = uploaded[entry.rank] if entry.pending else entry.staged
            if folder is not None:
                staged_of[entry.rank] = folder
        checkpoint = None
        if staged_of:
            ranks = sorted(staged_of)
            name = entries[0].dir_name or f"checkpoint_{index:06d}"
            problem = self.reports.name_problem(name, [staged_of[r] for r in ranks])
            if problem is None:
                staged = [self._collect(r, index, staged_of[r]) for r in ranks]
                validation = next((e.validation for e in entries if e.validation is not None), None)
                checkpoint = self.reports.commit_checkpoint(staged, name, entries[0].metrics, index, validation)
                if self.notice is not None:
                    self.after_notice = checkpoint
                if self.back:
                    self.after_back = checkpoint
            for r in ranks:
                if not entries[r].pending:  # a SYNC rank waits for the answer
                    self.group.send(r, protocol.Ack(index, checkpoint.path if checkpoint else None, problem))
            waiting = [r for r in ranks if entries[r].pending]
            if problem is not None and waiting:  # nobody waits to be told: the rank fails here
                raise self.group.fail([self.group.failure(waiting[0], None, ValueError(problem))])
        self.reports.after_report([entry.metrics for entry in entries], checkpoint)
        self._answer_checkpoint_waiters()

    def _answer_checkpoint_waiters(self) -> None:
        """Reply to each ``get_all_reported_checkpoints()`` call once no report round up to the
        caller's last report is in flight any more (as Ray) and, for ``VALIDATED``, no
        validation is queued or running; or once its ``timeout_s`` is over."""
        if not self.checkpoint_waiters:
            return
        now = self.clock()
        in_flight = [*self.rounds["report"], *(index for index, _ in self.to_commit)]
        oldest = min(in_flight, default=None)  # the lowest index in flight
        validating = self.reports.validations.validating()
        waiting = []
        for rank, index, deadline, validated in self.checkpoint_waiters:
            busy = (oldest is not None and oldest <= index) or (validated and validating)
            if busy and (deadline is None or now < deadline):
                waiting.append((rank, index, deadline, validated))
                continue
            reported = self.reports.reported_checkpoints()
            self.group.send(rank, protocol.CheckpointsReply(reported))
        self.checkpoint_waiters = waiting

    def _collect(self, rank: int, index: int, staged: str) -> str:
        """The staged folder of ``rank`` as the run's storage commits it (copied back from a
        host that cannot see the run directory: ``RunStorage.collect``). A copy that fails (the
        host stopped answering, say) is a failure of ``rank``: the group fails, and
        ``FailureConfig`` decides what follows."""
        try:
            return self.context.storage.collect(rank, self.index, index, staged, self.group.launcher)
        except LaunchError as exc:
            raise self.group.fail([self.group.failure(rank, None, exc)]) from None

    def _check_rounds(self) -> None:
        """Fail when a rank waits for one that already returned; warn about late ranks."""
        self._answer_checkpoint_waiters()  # those whose timeout_s is over
        for round_ in self._waiting_rounds() if self.group.done else []:
            gone = sorted(set(self.group.done) - set(round_.entries))
            if gone:
                error = RuntimeError(
                    f"rank(s) {gone} returned from the training function while rank(s) {sorted(round_.entries)} "
                    f"wait for them in {round_.what} call #{round_.index}. Every worker must call it the same "
                    "number of times."
                )
                raise self.group.fail([self.group.failure(gone[0], None, error)])
        warn_stragglers(self.rounds, self.world_size, self.clock())

    def _waiting_rounds(self) -> list[Round]:
        """Open rounds whose ranks wait for the others: collectives, reports with files, and
        reports a ``get_all_reported_checkpoints()`` call waits for (plain reports do not)."""
        reports = self.rounds["report"]
        waiting = [*self.rounds["collective"].values(), *(reports[i] for i in self.staged_rounds)]
        if self.checkpoint_waiters:
            last = max(index for _, index, _, _ in self.checkpoint_waiters)
            waiting += [r for i, r in reports.items() if i <= last and i not in self.staged_rounds]
        return waiting

    def _drop_unfinished_rounds(self) -> None:
        """Training succeeded: warn about the rounds it left open, and forget them."""
        warn_unfinished(self.rounds["report"].values(), self.to_commit, self.uploaded, self.world_size)
        for rounds in self.rounds.values():
            rounds.clear()
        self.staged_rounds.clear()
        self.to_commit.clear()
        self.uploaded.clear()
