"""``WorkerGroup``: worker processes started once, running functions on request.

A group owns what lives as long as its workers: the agents (a :class:`Launcher`), the driver's
store and its signed channel, and the log sink. What happens to its workers is polled
(:meth:`~ddptrain.driver.group_events.GroupEvents.poll`, ``ddptrain.driver.group_events``):
the first worker failure is a ``FailureSeen`` event (its own blocking calls raise
:class:`GroupFailed`), after which the group is dead and is shut down.

A training run (``fit()``) uses a group for one attempt and, inside
``ddptrain.reuse_workers()``, hands it on warm to the next ``fit()`` with the same plan.
Backends get the group in their hooks (``execute``, ``execute_single``, ``get_workers``...),
and code that drives workers itself (the ``TrainingOperator`` API) starts one with
:meth:`WorkerGroup.launch`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import cloudpickle

from ddptrain import _env
from ddptrain.driver.group_events import GroupEvents, GroupFailed, failure_from_record
from ddptrain.driver.logs import LogSink
from ddptrain.driver.plan import Plan
from ddptrain.errors import AgentGoneError, HostLostError, LaunchError, WorkerGroupError
from ddptrain.torch.config import TorchConfig
from ddptrain.wire import protocol
from ddptrain.wire.channel import Keys, open_store
from ddptrain.wire.driver_channel import DriverChannel

if TYPE_CHECKING:
    import torch.distributed as dist

    from ddptrain.backend import BackendConfig
    from ddptrain.config import RunConfig, ScalingConfig
    from ddptrain.launch.launcher import Launcher

__all__ = ["GroupFailed", "WorkerGroup", "WorkerMetadata"]

_logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class WorkerMetadata:
    """Where one worker runs (also reachable as ``worker.metadata``, Ray's spelling)."""

    rank: int
    hostname: str
    pid: int

    @property
    def metadata(self) -> WorkerMetadata:
        return self

    @property
    def node_ip(self) -> str:
        return self.hostname


class WorkerGroup(GroupEvents):
    """The workers of one plan, from start to shutdown.

    Args:
        plan: Where the ranks run.
        launcher: Agents already started for this group (``None``: started by :meth:`start`).
    """

    def __init__(self, plan: Plan, launcher: Launcher | None = None) -> None:
        super().__init__(plan)
        self.launcher = launcher
        self.world_size = plan.world_size
        self._store: dist.TCPStore | None = None
        self._rendezvous: dist.TCPStore | None = None  # a warm run's process-group store
        self._next_call = 0
        self._closed = False
        self.backend: tuple[Any, BackendConfig] | None = None  # set up by `launch`, torn down by `shutdown`

    # ----------------------------------------------------------------- public entry point
    @classmethod
    def launch(
        cls,
        scaling_config: ScalingConfig,
        *,
        run_config: RunConfig | None = None,
        backend_config: BackendConfig | None = None,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> WorkerGroup:
        """Start ``scaling_config.num_workers`` workers and set up their backend (default: a
        torch process group), ready for :meth:`execute`. Shut it down with :meth:`shutdown`,
        or use it as a context manager.

        Args:
            log_dir: Folder for one log file per rank; ``None``: worker output goes to the
                console only (rank-prefixed, as always).
        """
        config = backend_config or TorchConfig()
        plan = Plan(
            scaling_config, run_config._env_vars() if run_config is not None else None, config.shares_visible_gpus()
        )
        plan.check_gpus()
        group = cls(plan)
        try:
            group.start(payload=None, run=protocol.RunInfo(), log_dir=Path(log_dir) if log_dir is not None else None)
            backend = config.make_backend()
            backend.on_start(group, config)
            group.backend = (backend, config)
        except BaseException:
            group.shutdown()
            raise
        return group

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ----------------------------------------------------------------- start and stop
    @property
    def started(self) -> bool:
        return self.channel is not None

    @property
    def alive(self) -> bool:
        """Started, not shut down, no failure seen, and every worker still running."""
        return self.started and not self._closed and not self._failed and not self.exited

    def start(
        self,
        *,
        payload: bytes | None,
        run: protocol.RunInfo,
        log_dir: Path | None,
        datasets: dict[int, Any] | None = None,
        console: Any = None,
    ) -> None:
        """Start the workers and wait until each has joined the driver's store.

        Args:
            payload: The pickled user function the workers load before their first command.
            run: The workers' first run (``Run.run_info``); an empty one for a group that only
                runs functions.
            log_dir: Where each rank's output goes (``None``: the console only).
            datasets: Each rank's dataset shard specs.
            console: Writes worker lines to the console (``Progress.console_write``).

        Raises:
            GroupFailed: A worker failed, a host stopped answering, or an agent that had started
                was gone, while they started.
            LaunchError: A host's agent could not start them, or they did not join in time.
        """
        if self.launcher is None:
            self.launcher = self.plan.new_launcher()
        self._store = open_store(self.launcher.bind_address())
        secret = secrets.token_bytes(32)
        self.channel = DriverChannel(self._store, Keys(secret), secret, self.world_size)
        self.channel.start(
            lambda batch: self.events.put(("msgs", batch)), lambda error: self.events.put(("channel", error))
        )
        self.sink = LogSink(
            log_dir,
            self.plan.rank_labels(),
            _env.console_ranks(),
            on_error=lambda error: self.events.put(("sink", error)),
            console=console,
        )
        if not run.argv:
            run = dataclasses.replace(run, argv=tuple(sys.argv))
        store = protocol.StoreAddress(self._store.host, self._store.port, secret, _env.store_connect_timeout_s())
        bootstrap = self.plan.bootstrap(payload, run, store, datasets)
        try:
            self.launcher.start(bootstrap, self.sink, lambda event: self.events.put(("agent", event)))
        except (HostLostError, AgentGoneError) as exc:  # as if it went away a moment later: FailureConfig decides
            raise self.fail([self.failure(min(exc.ranks, default=0), None, exc)]) from None
        try:
            self.pump_until(
                lambda: len(self.connected) == self.world_size,
                timeout_s=_env.worker_start_timeout_s(),
                waiting_for="workers to start and connect to the driver's store",
            )
        except TimeoutError as exc:
            missing = sorted(set(range(self.world_size)) - self.connected)
            where = f" Their output is in {log_dir}." if log_dir is not None else ""
            raise LaunchError(
                f"Rank(s) {missing} did not start: {exc} (DDPTRAIN_WORKER_START_TIMEOUT_S).{where}"
            ) from None

    def stop_workers(self, timeout_s: float = 10.0) -> None:
        """Ask every worker to exit and wait for them (problems are logged: the work is done)."""
        if not self.alive or self.channel is None:
            return
        self.exit_expected = True
        for rank in range(self.world_size):
            self.channel.send(rank, protocol.Exit())
        try:
            self.pump_until(
                lambda: len(self.exited) == self.world_size, timeout_s=timeout_s, waiting_for="workers to exit"
            )
        except (GroupFailed, TimeoutError) as exc:
            _logger.warning("ddptrain: workers did not exit cleanly after their work finished (ignored): %s", exc)

    def shutdown(self, grace_s: float | None = None) -> None:
        """Stop every worker and agent: SIGTERM, then SIGKILL after ``grace_s``. Safe to call twice."""
        if self._closed:
            return
        if self.backend is not None and self.alive:
            backend, config = self.backend
            self.backend = None
            try:
                backend.on_shutdown(self, config)
            except Exception as exc:
                _logger.warning("ddptrain: the backend's shutdown failed (ignored): %s", exc)
            self.stop_workers()
        self._closed = True
        self.exit_expected = True
        if self.launcher is not None:
            self.launcher.shutdown(_env.shutdown_grace_s() if grace_s is None else grace_s)
        if self.channel is not None:
            self.channel.stop()
        if self.sink is not None:
            self.sink.close()
        self._store = self._rendezvous = None

    def ask(self, command: bytes) -> None:
        """Send the agents a one-byte request (worker states, stacks)."""
        if self.launcher is not None:
            self.launcher.ask(command)

    def stopped_agents(self) -> list[tuple[str, int]]:
        """``(where, pid)`` of each agent on this machine that is stopped by a signal."""
        return self.launcher.stopped_agents() if self.launcher is not None and not self._closed else []

    def send(self, rank: int, message: Any) -> None:
        assert self.channel is not None
        self.channel.send(rank, message)

    def notify(self, rank: int, message: Any) -> None:
        """Send ``rank`` a notice it reads while it trains (``protocol.Preempt``)."""
        assert self.channel is not None
        self.channel.notify(rank, message)

    def host_of(self, rank: int) -> str:
        """The name of the host that runs ``rank`` (the host list's name for it)."""
        return self.plan.host_of(rank)

    def next_run(self, log_dir: Path | None, console: Any = None) -> int:
        """Ready a warm group for its next run: its output goes to ``log_dir`` from now on.

        Returns the port of a fresh store for the run's process group (``MASTER_PORT``):
        torch's rendezvous keys (``default_pg/0/...``) are the same for every process group,
        so a second one built on the same store would read the first one's stale addresses.
        """
        assert self.sink is not None and self.launcher is not None
        self.sink.retarget(log_dir)
        self.sink.console = console
        self._release()  # the last run's last batch (its Done messages)
        self.done.clear()
        self.finishing = False
        self._rendezvous = open_store(self.launcher.bind_address())
        return int(self._rendezvous.port)

    # ----------------------------------------------------------------- running functions
    def call(
        self, ranks: list[int], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ``ranks``; results in the order of ``ranks``."""
        return self._call(ranks, lambda call_id: protocol.Execute(call_id, fn, args, kwargs))

    def begin_run(
        self, run: protocol.RunInfo, payload: bytes | None, datasets: dict[int, Any] | None, port: int
    ) -> None:
        """Switch every (warm) worker to the run ``run``, whose process group meets on ``port``."""
        self._call(list(range(len(self))), lambda call_id: protocol.BeginRun(call_id, run, payload, datasets, port))

    def _call(self, ranks: list[int], command: Callable[[int], Any]) -> list[Any]:
        if not self.alive:
            raise WorkerGroupError("The worker group is not running (it was shut down or one of its workers died).", {})
        call_id = self._next_call
        self._next_call += 1
        for rank in ranks:
            self.send(rank, command(call_id))

        def answered() -> bool:  # by every rank, or by one that failed: no need to wait for the rest
            replies = self._results.get(call_id, {})
            return len(replies) == len(ranks) or any(not ok for ok, _ in replies.values())

        self.pump_until(answered)
        if len(self._results.get(call_id, {})) < len(ranks):  # one failed: gather others failing with it
            try:
                self.pump_until(lambda: len(self._results.get(call_id, {})) == len(ranks), timeout_s=0.5)
            except TimeoutError:
                pass
        replies = self._results.pop(call_id)
        failed = [
            self.failure(rank, None, failure_from_record(value), value.traceback, value.time)
            for rank, (ok, value) in sorted(replies.items())
            if isinstance(value, protocol.FailureRecord)
        ]
        if failed:
            raise self.fail(failed)
        return [cloudpickle.loads(replies[rank][1]) for rank in ranks]

    def execute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every worker at once; results in rank order.

        ``fn`` is pickled with cloudpickle. If it raises on any worker, this raises
        :class:`GroupFailed` (a :class:`~ddptrain.WorkerGroupError`) with the worker's
        traceback, and the group must be shut down.
        """
        return self.call(list(range(len(self))), fn, args, kwargs)

    def execute_single(self, worker_index: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the worker of rank ``worker_index``."""
        if not 0 <= worker_index < len(self):
            raise IndexError(f"`worker_index` must be in [0, {len(self)}), got {worker_index}.")
        return self.call([worker_index], fn, args, kwargs)[0]

    def __len__(self) -> int:
        return self.world_size

    def get_resources_per_worker(self) -> dict[str, float]:
        """The resources each worker was given (``CPU``, ``GPU``)."""
        scaling = self.plan.scaling_config
        return {"CPU": scaling.num_cpus_per_worker, "GPU": scaling.num_gpus_per_worker}

    def get_workers(self) -> list[WorkerMetadata]:
        """Host and pid of every worker, in rank order."""
        return [WorkerMetadata(rank, self.hosts[rank][1], self.hosts[rank][0]) for rank in range(len(self))]
