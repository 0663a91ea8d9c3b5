"""One attempt of a run: a worker group runs the training function once, and its reports are
gathered into rounds.

The attempt plugs into its :class:`~ddptrain.worker_group.WorkerGroup`'s event pump: the
group handles what every group has (workers joining, function results, agent events, lost
messages) and hands the run's own messages (report, collective, checkpoints) to
:meth:`Attempt._handle_run_message`. The first worker failure raises ``GroupFailed``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cloudpickle

from ddptrain import _env
from ddptrain.driver.watchdog import Watch
from ddptrain.driver.worker_group import GroupFailed, WorkerGroup
from ddptrain.errors import LaunchError, WorkerFailure
from ddptrain.wire import protocol

if TYPE_CHECKING:
    from ddptrain.driver.run import Run

__all__ = ["Attempt", "GroupFailed"]

_logger = logging.getLogger(__name__)


@dataclass
class _Round:
    """One ``report()`` or collective call, gathered across ranks."""

    kind: str
    index: int
    started: float
    entries: dict[int, Any] = field(default_factory=dict)
    warned_at: float = 0.0


class Attempt:
    """One run of the training function on a worker group, from its start to its end.

    Args:
        run: The run this attempt belongs to (configs, run directory, results so far).
        index: Attempt number, 0 for the first start.
        group: The workers: not started yet, or warm from an earlier ``fit()``.
        keep: Leave the workers running when training succeeds (the group goes on warm).
    """

    def __init__(self, run: Run, index: int, group: WorkerGroup, keep: bool = False) -> None:
        self.run = run
        self.index = index
        self.group = group
        self.keep = keep
        self.world_size = group.world_size
        # Open rounds by kind, then index; created in the order of their indices (each rank
        # calls in order), so the first of a kind is its oldest.
        self.rounds: dict[str, dict[int, _Round]] = {"report": {}, "collective": {}}
        self.staged_rounds: set[int] = set()  # open report rounds that a rank passed files to
        # get_all_reported_checkpoints() calls waiting for earlier reports: (rank, index, deadline)
        self.checkpoint_waiters: list[tuple[int, int, float | None]] = []
        self.watch = Watch(run.run_dir, group.ask, group.where)

    # ----------------------------------------------------------------- lifecycle
    def run_group(self) -> list[Any]:
        """Run the training function on every worker; returns their return values by rank.

        On success the workers have exited, unless ``keep``; on a failure they are shut down.
        """
        group = self.group
        group.handler = self._handle_run_messages
        group.watch = self.watch
        progress = self.run.progress
        group.on_tick = self._tick
        log_dir = self.run.log_dir(self.index)
        datasets = self.run.dataset_shards()
        try:
            if group.started:  # warm from an earlier fit(): the workers switch to this run
                port = group.next_run(log_dir, console=progress)
                run = self.run.run_info(self.index)
                group.begin_run(run, self.run.payload, datasets, port)
            else:
                group.start(
                    payload=self.run.payload,
                    run=self.run.run_info(self.index),
                    log_dir=log_dir,
                    datasets=datasets,
                    console=progress,
                )
            backend = self.run.backend_config.make_backend()
            backend.on_start(group, self.run.backend_config)
            backend.on_training_start(group, self.run.backend_config)
            self.watch.active = True
            self.watch.activity()
            for rank in range(self.world_size):
                group.send(rank, protocol.Train())
            group.pump_until(lambda: len(group.done) == self.world_size)
            self._finish(backend)
            return [self._load_return(rank) for rank in range(self.world_size)]
        except BaseException:
            group.shutdown()
            raise
        finally:
            self.watch.active = False

    def _tick(self) -> None:
        self._check_rounds()
        self.run.progress.tick()

    def _finish(self, backend: Any) -> None:
        """Every rank returned: run the backend's teardown and let the workers exit (or wait
        for the next run). Training succeeded, so problems from here on are logged, not raised."""
        self.group.finishing = True
        self.watch.active = False
        self._warn_unfinished_rounds()
        try:
            backend.on_shutdown(self.group, self.run.backend_config)
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
    def _handle_run_messages(self, messages: list[Any]) -> WorkerFailure | None:
        """Messages in the order they came. Rank 0's metrics go to ``metrics.jsonl`` in one write
        for all of them, flushed before anything that depends on them (a checkpoint's commit,
        its acknowledgement, the callbacks) and before the group handles anything else."""
        try:
            for message in messages:
                if isinstance(message, protocol.Report):
                    if message.rank == 0:
                        self.run.record_metrics(message.metrics, self.index)
                    self._add_to_round("report", message.index, message.rank, message)
                elif isinstance(message, protocol.Collective):
                    self._add_to_round("collective", message.index, message.rank, message)
                elif isinstance(message, protocol.CheckpointsQuery):
                    deadline = None if message.timeout_s is None else time.monotonic() + message.timeout_s
                    self.checkpoint_waiters.append((message.rank, message.index, deadline))
                    self._answer_checkpoint_waiters()
                else:
                    _logger.warning("ddptrain: unexpected message %r ignored", message)
        finally:
            self.run.flush_metrics()
        return None

    def _add_to_round(self, kind: str, index: int, rank: int, entry: Any) -> None:
        rounds = self.rounds[kind]
        round_ = rounds.get(index)
        if round_ is None:
            round_ = rounds[index] = _Round(kind, index, time.monotonic())
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
        entries: list[protocol.Report] = [round_.entries[r] for r in range(self.world_size)]
        staged_ranks = [r for r, entry in enumerate(entries) if entry.staged]
        checkpoint = None
        if staged_ranks:
            name = entries[0].dir_name or f"checkpoint_{index:06d}"
            problem = self.run.name_problem(name)
            if problem is None:
                staged = [self._collect(r, index, entries[r].staged) for r in staged_ranks]  # type: ignore[arg-type]
                checkpoint = self.run.commit_checkpoint(staged, name, entries[0].metrics, index)
            for r in staged_ranks:
                self.group.send(r, protocol.Ack(index, checkpoint.path if checkpoint else None, problem))
        self.run.after_report([entry.metrics for entry in entries], checkpoint)
        self._answer_checkpoint_waiters()

    def _answer_checkpoint_waiters(self) -> None:
        """Reply to each ``get_all_reported_checkpoints()`` call once no report round up to the
        caller's last report is in flight any more (as Ray), or its ``timeout_s`` is over."""
        if not self.checkpoint_waiters:
            return
        now = time.monotonic()
        oldest = min(self.rounds["report"], default=None)  # the lowest index in flight
        waiting = []
        for rank, index, deadline in self.checkpoint_waiters:
            if oldest is not None and oldest <= index and (deadline is None or now < deadline):
                waiting.append((rank, index, deadline))
                continue
            reported = [(c.path, m) for c, m in self.run.checkpoints.reported_checkpoints()]
            self.group.send(rank, protocol.CheckpointsReply(reported))
        self.checkpoint_waiters = waiting

    def _collect(self, rank: int, index: int, staged: str) -> str:
        """The staged folder of ``rank`` as the run's storage commits it (copied back from a
        host that cannot see the run directory: ``RunStorage.collect``). A copy that fails (the
        host stopped answering, say) is a failure of ``rank``: the group fails, and
        ``FailureConfig`` decides what follows."""
        try:
            return self.run.storage.collect(rank, self.index, index, staged, self.group.launcher)
        except LaunchError as exc:
            raise self.group.fail([self.group.failure(rank, None, exc)]) from None

    def _check_rounds(self) -> None:
        """Fail when a rank waits for one that already returned; warn about late ranks."""
        self._answer_checkpoint_waiters()  # those whose timeout_s is over
        for round_ in self._waiting_rounds() if self.group.done else []:
            gone = sorted(set(self.group.done) - set(round_.entries))
            if gone:
                what = "report()" if round_.kind == "report" else "a collective (barrier/broadcast)"
                error = RuntimeError(
                    f"rank(s) {gone} returned from the training function while rank(s) {sorted(round_.entries)} "
                    f"wait for them in {what} call #{round_.index}. Every worker must call it the same "
                    "number of times."
                )
                raise self.group.fail([self.group.failure(gone[0], None, error)])
        self._warn_stragglers()

    def _waiting_rounds(self) -> list[_Round]:
        """Open rounds whose ranks wait for the others: collectives, reports with files, and
        reports a ``get_all_reported_checkpoints()`` call waits for (plain reports do not)."""
        reports = self.rounds["report"]
        waiting = [*self.rounds["collective"].values(), *(reports[i] for i in self.staged_rounds)]
        if self.checkpoint_waiters:
            last = max(index for _, index, _ in self.checkpoint_waiters)
            waiting += [r for i, r in reports.items() if i <= last and i not in self.staged_rounds]
        return waiting

    def _warn_stragglers(self) -> None:
        interval = _env.report_warn_interval_s()
        now = time.monotonic()
        for kind, rounds in self.rounds.items():
            oldest = next(iter(rounds.values()), None)
            if oldest is None:
                continue
            age = now - oldest.started
            if age < interval or now - oldest.warned_at < max(interval, 30.0):
                continue
            oldest.warned_at = now
            missing = sorted(set(range(self.world_size)) - set(oldest.entries))
            what = "report()" if kind == "report" else "a collective (barrier/broadcast)"
            _logger.warning(
                "ddptrain: rank(s) %s have not reached %s call #%d yet; rank(s) %s reached it %.1f s ago. "
                "Every worker must call it the same number of times.",
                missing,
                what,
                oldest.index,
                sorted(oldest.entries),
                age,
            )

    def _warn_unfinished_rounds(self) -> None:
        for round_ in self.rounds["report"].values():
            missing = sorted(set(range(self.world_size)) - set(round_.entries))
            _logger.warning(
                "ddptrain: report() call #%d was made by rank(s) %s but never by rank(s) %s; "
                "every worker must call report() the same number of times.",
                round_.index,
                sorted(round_.entries),
                missing,
            )
        for rounds in self.rounds.values():
            rounds.clear()
        self.staged_rounds.clear()
