"""The driver loop of one worker-group attempt: start, set up, train, watch, tear down.

Events reach the attempt through one queue: verified store messages from the channel
thread (hello, result, report, collective, done) and agent events from the launcher thread
(started, exited, agent failure), and the log sink's write error (a full disk), which the
driver raises as its own. The first worker failure raises ``GroupFailed``; the ``finally``
of :meth:`Attempt.run` tears everything down in reverse order.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cloudpickle
import torch.distributed as dist

from ddptrain import _env, storage
from ddptrain._agent import AGENT_RANK
from ddptrain._logs import LogSink
from ddptrain.channel import DriverChannel, Keys, open_store
from ddptrain.errors import (
    LaunchError,
    WorkerDiedError,
    WorkerError,
    WorkerFailure,
    describe_exitcode,
    is_disk_full,
)
from ddptrain.watch import Watch
from ddptrain.worker_group import WorkerGroup

if TYPE_CHECKING:
    from ddptrain.launcher import AgentEvent, Launcher
    from ddptrain.run import Run

__all__ = ["Attempt", "GroupFailed"]

_logger = logging.getLogger(__name__)
_PUMP_S = 0.5
_ROUND_CHECK_S = 0.1


class GroupFailed(Exception):
    """The worker group failed; ``failures`` says how."""

    def __init__(self, failures: list[WorkerFailure]) -> None:
        super().__init__(failures[0].headline() if failures else "worker group failed")
        self.failures = failures


@dataclass
class _Round:
    """One ``report()`` or collective call, gathered across ranks."""

    kind: str
    index: int
    started: float
    entries: dict[int, Any] = field(default_factory=dict)
    warned_at: float = 0.0


def failure_from_record(record: dict[str, Any]) -> BaseException:
    """The worker's exception from its failure record, or a stand-in with its traceback."""
    if record.get("exception"):
        try:
            exc: BaseException = pickle.loads(record["exception"])
            return exc
        except Exception:
            pass
    return WorkerError(record.get("type", "Exception"), record.get("message", ""), record.get("traceback", ""))


class Attempt:
    """One start of the worker group, from launch to teardown.

    Args:
        run: The run this attempt belongs to (configs, run directory, results so far).
        index: Attempt number, 0 for the first start.
        launcher: An already spawned launcher for this attempt's workers.
    """

    def __init__(self, run: Run, index: int, launcher: Launcher) -> None:
        self.run = run
        self.index = index
        self.launcher = launcher
        self.world_size = run.scaling_config.num_workers
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.hosts: dict[int, tuple[int, str]] = {}
        self.connected: set[int] = set()
        self.results: dict[int, dict[int, tuple[bool, Any]]] = {}
        self.done: dict[int, tuple[bytes | None, str | None]] = {}
        self.exited: set[int] = set()
        self.exit_expected = False
        self.rounds: dict[tuple[str, int], _Round] = {}
        self.finishing = False  # every rank returned; only teardown is left
        # get_all_reported_checkpoints() calls waiting for earlier reports: (rank, index, deadline)
        self.checkpoint_waiters: list[tuple[int, int, float | None]] = []
        self.sink: LogSink | None = None
        self.channel: DriverChannel | None = None
        self._next_call = 0
        self._next_round_check = 0.0
        self.watch = Watch(run.run_dir, launcher.ask, self._where)

    # ----------------------------------------------------------------- lifecycle
    def run_group(self) -> list[Any]:
        """Run the training function on every worker; returns their return values by rank."""
        store: dist.TCPStore | None = None
        backend = None
        worker_group = WorkerGroup(self)
        try:
            store = open_store(self.launcher.bind_address())
            secret = secrets.token_bytes(32)
            keys = Keys(secret)
            self.channel = DriverChannel(store, keys, secret)
            self.channel.start(lambda message: self.events.put(("msg", message)))
            self.sink = LogSink(
                self.run.log_dir(self.index),
                self.run.rank_labels(),
                _env.console_ranks(),
                on_error=lambda error: self.events.put(("sink", error)),
            )
            bootstrap = self.run.bootstrap(self.index, store.host, store.port, secret)
            self.launcher.start(bootstrap, self.sink, lambda event: self.events.put(("agent", event)))
            try:
                self.pump_until(
                    lambda: len(self.connected) == self.world_size,
                    timeout_s=_env.worker_start_timeout_s(),
                    waiting_for="workers to start and connect to the driver's store",
                )
            except TimeoutError as exc:
                missing = sorted(set(range(self.world_size)) - self.connected)
                raise LaunchError(
                    f"Rank(s) {missing} did not start: {exc} (DDPTRAIN_WORKER_START_TIMEOUT_S). "
                    f"Their output is in {self.run.log_dir(self.index)}."
                ) from None
            backend = self.run.backend_config.backend_cls()
            if isinstance(backend, type):  # `backend_cls` written as a method, not a property
                backend = backend()
            backend.on_start(worker_group, self.run.backend_config)
            backend.on_training_start(worker_group, self.run.backend_config)
            self.watch.active = True
            self.watch.activity()
            for rank in range(self.world_size):
                self.channel.send(rank, ("train",))
            self.pump_until(lambda: len(self.done) == self.world_size)
            self._finish(backend, worker_group)
            return [self._load_return(rank) for rank in range(self.world_size)]
        finally:
            self.exit_expected = True
            self.launcher.shutdown(_env.shutdown_grace_s())
            if self.channel is not None:
                self.channel.stop()
            if self.sink is not None:
                self.sink.close()
            self.channel = None
            store = None

    def _finish(self, backend: Any, worker_group: WorkerGroup) -> None:
        """Every rank returned: run the backend's teardown and let the workers exit.

        Training succeeded, so problems from here on are logged, not raised.
        """
        self.finishing = True
        self.watch.active = False
        self._warn_unfinished_rounds()
        try:
            backend.on_shutdown(worker_group, self.run.backend_config)
        except Exception as exc:
            _logger.warning("ddptrain: the backend's shutdown failed after training finished (ignored): %s", exc)
        assert self.channel is not None
        self.exit_expected = True
        for rank in range(self.world_size):
            self.channel.send(rank, ("exit",))
        try:
            self.pump_until(lambda: len(self.exited) == self.world_size, timeout_s=10.0, waiting_for="workers to exit")
        except (GroupFailed, TimeoutError) as exc:
            _logger.warning("ddptrain: workers did not exit cleanly after training finished (ignored): %s", exc)

    def _load_return(self, rank: int) -> Any:
        data, note = self.done[rank]
        if note:
            _logger.warning("ddptrain: %s", note)
        return cloudpickle.loads(data) if data is not None else None

    # ----------------------------------------------------------------- event pump
    def pump_until(self, done: Callable[[], bool], timeout_s: float | None = None, waiting_for: str = "") -> None:
        """Handle events until ``done()``; raises GroupFailed on a failure."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done():
            try:
                event = self.events.get(timeout=_PUMP_S)
            except queue.Empty:
                event = None
            if event is not None:
                self._handle(event)
            now = time.monotonic()
            if now >= self._next_round_check:  # not per event: a fast rank 0 may be far ahead
                self._next_round_check = now + _ROUND_CHECK_S
                self._check_rounds()
                self.watch.check(self.sink.last_write if self.sink is not None else 0.0)
            if deadline is not None and time.monotonic() > deadline and not done():
                raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {waiting_for}")

    def _handle(self, event: tuple[str, Any]) -> None:
        failure = self._dispatch(event)
        if failure is None:
            return
        if not self.finishing and not is_disk_full(failure.exception):  # a full disk is never retried
            self.run.prepare_restart()
        failures = [failure]
        # Gather the other ranks that failed on their own at about the same time.
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            try:
                more = self._dispatch(self.events.get(timeout=0.05))
            except queue.Empty:
                continue
            if more is not None and more.rank not in {f.rank for f in failures}:
                failures.append(more)
        raise GroupFailed(failures)

    def _dispatch(self, event: tuple[str, Any]) -> WorkerFailure | None:
        source, item = event
        if source == "sink":  # a log file could not be written (a full disk): the driver's failure
            raise item
        return self._handle_message(item) if source == "msg" else self._handle_agent(item)

    def _handle_message(self, message: tuple[Any, ...]) -> WorkerFailure | None:
        kind, rank = message[0], message[1]
        self.watch.activity()
        if kind == "hello":
            self.connected.add(rank)
            self.hosts[rank] = (message[2], message[3])
        elif kind == "result":
            _, _, call_id, ok, value = message
            self.results.setdefault(call_id, {})[rank] = (ok, value)
        elif kind == "report":
            _, _, index, metrics, staged, dir_name = message
            if rank == 0:
                self.run.record_metrics(metrics, self.index)
            self._add_to_round("report", index, rank, (metrics, staged, dir_name))
        elif kind == "collective":
            _, _, index, data = message
            self._add_to_round("collective", index, rank, data)
        elif kind == "checkpoints":
            _, _, index, timeout_s = message
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            self.checkpoint_waiters.append((rank, index, deadline))
            self._answer_checkpoint_waiters()
        elif kind == "done":
            self.done[rank] = (message[2], message[3])
        elif kind == "lost":  # ("lost", LostMessageError): `rank` is the error here
            error = message[1]
            return self._failure(0 if error.rank is None else error.rank, None, error)
        return None

    def _handle_agent(self, event: AgentEvent) -> WorkerFailure | None:
        kind, rank, payload = event
        if kind == b"P":
            self.watch.on_states(pickle.loads(payload))
            return None
        if kind == b"S":
            info = pickle.loads(payload)
            self.hosts.setdefault(rank, (info["pid"], info["host"]))
            return None
        if kind == b"X":
            info = pickle.loads(payload)
            self.exited.add(rank)
            exitcode = info["exitcode"]
            if self.exit_expected and exitcode == 0 and not info["status"]:
                return None
            if info["status"]:
                record = pickle.loads(info["status"])
                return self._failure(rank, exitcode, failure_from_record(record), record["traceback"])
            if self.exit_expected:
                return None
            return self._failure(rank, exitcode, WorkerDiedError(rank, exitcode, info.get("memory")))
        # Agent events name the agent by its first rank (AGENT_RANK: the only agent).
        agent_ranks = self.run.ranks_of_agent(None if rank == AGENT_RANK else rank)
        if kind == b"F":
            text = payload.decode("utf-8", errors="replace")
            error = LaunchError(f"The ddptrain agent could not start the workers:\n{text}")
            return self._failure(agent_ranks[0], None, error, text)
        missing = sorted(set(agent_ranks) - self.exited)
        if kind == b"D" and missing and not self.exit_expected:
            code = payload.decode()
            how = "connection lost" if code == "None" else describe_exitcode(int(code))
            hint = " (SIGKILL often means the kernel's out-of-memory killer)" if code == "-9" else ""
            error = LaunchError(
                f"The ddptrain agent that runs rank(s) {missing} on {self.run.host_of(missing[0])} "
                f"died ({how}){hint}; its workers died with it."
            )
            return self._failure(missing[0], None, error)
        return None

    def _pid_host(self, rank: int) -> tuple[int | None, str]:
        pid, host = self.hosts.get(rank, (None, self.run.hostname))
        if self.run.placement is not None:
            host = self.run.host_of(rank)  # the host list's name for it
        return pid, host

    def _where(self, rank: int) -> str:
        pid, host = self._pid_host(rank)
        return f"rank {rank} (host {host}, pid {pid})"

    def _failure(self, rank: int, exitcode: int | None, exc: BaseException, traceback_str: str = "") -> WorkerFailure:
        pid, host = self._pid_host(rank)
        assert self.sink is not None
        returned = sorted(r for r in self.done if r != rank)
        note = ""
        if returned and not self.finishing:
            note = (
                f"rank(s) {returned} had already returned from the training function; a rank that returns "
                "early makes its peers' collectives fail"
            )
        return WorkerFailure(
            rank=rank,
            host=host,
            pid=pid,
            exitcode=exitcode,
            exception=exc,
            traceback_str=traceback_str,
            log_path=self.sink.path(rank),
            timestamp=time.time(),
            log_tail=self.sink.tail(rank),
            note=note,
        )

    # ----------------------------------------------------------------- calls and rounds
    def execute(
        self, ranks: list[int], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ``ranks``; results in the order of ``ranks``."""
        assert self.channel is not None
        call_id = self._next_call
        self._next_call += 1
        for rank in ranks:
            self.channel.send(rank, ("execute", call_id, (fn, args, kwargs)))

        def answered() -> bool:  # by every rank, or by one that failed: no need to wait for the rest
            replies = self.results.get(call_id, {})
            return len(replies) == len(ranks) or any(not ok for ok, _ in replies.values())

        self.pump_until(answered)
        if len(self.results.get(call_id, {})) < len(ranks):  # one failed: gather others failing with it
            try:
                self.pump_until(lambda: len(self.results.get(call_id, {})) == len(ranks), timeout_s=0.5)
            except TimeoutError:
                pass
        replies = self.results.pop(call_id)
        failed = [
            self._failure(rank, None, failure_from_record(value), value["traceback"])
            for rank, (ok, value) in sorted(replies.items())
            if not ok
        ]
        if failed:
            self.run.prepare_restart()
            raise GroupFailed(failed)
        return [cloudpickle.loads(replies[rank][1]) for rank in ranks]

    def _add_to_round(self, kind: str, index: int, rank: int, entry: Any) -> None:
        key = (kind, index)
        round_ = self.rounds.get(key)
        if round_ is None:
            round_ = self.rounds[key] = _Round(kind, index, time.monotonic())
        round_.entries[rank] = entry
        if len(round_.entries) < self.world_size:
            return
        del self.rounds[key]
        assert self.channel is not None
        if kind == "collective":
            for r in range(self.world_size):
                self.channel.send(r, ("collective", index, round_.entries[0]))
            return
        entries = [round_.entries[r] for r in range(self.world_size)]
        staged_ranks = [r for r, (_, staged, _) in enumerate(entries) if staged]
        checkpoint = None
        if staged_ranks:
            name = entries[0][2] or f"checkpoint_{index:06d}"
            problem = self.run.name_problem(name)
            if problem is None:
                staged = [self._fetch_if_remote(r, index, entries[r][1]) for r in staged_ranks]
                checkpoint = self.run.commit_checkpoint(staged, name, entries[0][0], index)
            for r in staged_ranks:
                self.channel.send(r, ("ack", index, checkpoint.path if checkpoint else None, problem))
        self.run.after_report([metrics for metrics, _, _ in entries], checkpoint)
        self._answer_checkpoint_waiters()

    def _answer_checkpoint_waiters(self) -> None:
        """Reply to each ``get_all_reported_checkpoints()`` call once no report round up to the
        caller's last report is in flight any more (as Ray), or its ``timeout_s`` is over."""
        if not self.checkpoint_waiters:
            return
        assert self.channel is not None
        now = time.monotonic()
        in_flight = [r.index for r in self.rounds.values() if r.kind == "report"]
        waiting = []
        for rank, index, deadline in self.checkpoint_waiters:
            if any(i <= index for i in in_flight) and (deadline is None or now < deadline):
                waiting.append((rank, index, deadline))
                continue
            reported = [(c.path, m) for c, m in self.run.checkpoints.reported_checkpoints()]
            self.channel.send(rank, ("checkpoints", reported))
        self.checkpoint_waiters = waiting

    def _fetch_if_remote(self, rank: int, index: int, staged: str) -> str:
        """The staged folder of ``rank`` on this machine: copied back over SSH if its host
        cannot see the run directory."""
        unshared = getattr(self.launcher, "unshared_ranks", ())
        if rank not in unshared:
            return staged
        local = os.path.join(self.run.run_dir, storage.STAGING, f"fetched_a{self.index}_r{index}", f"rank_{rank}")
        with storage.naming_full_disk(local):
            self.launcher.fetch_dir(rank, staged, local)  # type: ignore[attr-defined]
        return local

    def _check_rounds(self) -> None:
        """Fail when a rank waits for one that already returned; warn about late ranks."""
        self._answer_checkpoint_waiters()  # those whose timeout_s is over
        for round_ in self.rounds.values():
            gone = sorted(set(self.done) - set(round_.entries))
            waits = (
                round_.kind == "collective"
                or any(entry[1] for entry in round_.entries.values())
                or (round_.kind == "report" and any(index >= round_.index for _, index, _ in self.checkpoint_waiters))
            )
            if gone and waits:
                what = "report()" if round_.kind == "report" else "a collective (barrier/broadcast)"
                error = RuntimeError(
                    f"rank(s) {gone} returned from the training function while rank(s) {sorted(round_.entries)} "
                    f"wait for them in {what} call #{round_.index}. Every worker must call it the same "
                    "number of times."
                )
                self.run.prepare_restart()
                raise GroupFailed([self._failure(gone[0], None, error)])
        self._warn_stragglers()

    def _warn_stragglers(self) -> None:
        interval = _env.report_warn_interval_s()
        now = time.monotonic()
        for kind in ("report", "collective"):
            pending = [r for r in self.rounds.values() if r.kind == kind]
            if not pending:
                continue
            oldest = min(pending, key=lambda r: r.index)
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
        for round_ in sorted(self.rounds.values(), key=lambda r: r.index):
            if round_.kind == "report":
                missing = sorted(set(range(self.world_size)) - set(round_.entries))
                _logger.warning(
                    "ddptrain: report() call #%d was made by rank(s) %s but never by rank(s) %s; "
                    "every worker must call report() the same number of times.",
                    round_.index,
                    sorted(round_.entries),
                    missing,
                )
        self.rounds.clear()
