"""The controller: ``fit()`` as a loop of plan → attempt → restart.

Each attempt runs one worker group (``ddptrain.driver.attempt.Attempt``) and returns what
happened: ``Succeeded`` or ``Failed``. Every decision is taken here. When an attempt failed
and ``FailureConfig.max_failures`` allows another one, the next attempt's placement plan is
built and its agents start at once, before the failed group is torn down. The plan is built
anew for every attempt: a host file edited meanwhile is read again, and a later elastic mode
can change the world size between attempts. A failure after every rank returned, and a full
disk, are never retried.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from ddptrain import _env
from ddptrain.driver import preemption
from ddptrain.driver.attempt import Attempt, Failed, Preempted, Resized, Succeeded
from ddptrain.driver.elastic import HostWatch, answering
from ddptrain.driver.plan import Plan
from ddptrain.driver.run import Run
from ddptrain.driver.warm import keeps_warm, put_warm, take_warm
from ddptrain.driver.worker_group import WorkerGroup
from ddptrain.errors import (
    ChannelError,
    ConfigError,
    HostLostError,
    LaunchError,
    RunPreemptedError,
    WorkerFailure,
    WorkerGroupError,
    is_disk_full,
)
from ddptrain.launch.hosts import HostSpec
from ddptrain.launch.launcher import Launcher
from ddptrain.result import Result

__all__ = ["Controller"]

_logger = logging.getLogger(__name__)


class Controller:
    """Runs the attempts of ``run`` until one succeeds or the failure budget is spent.

    Args:
        run: The run's state: configs, storage, reports, the first attempt's plan.
        start_agents: Starts the agents of a plan (``Plan.new_launcher``; a test's fake).
        new_group: Makes the worker group of a plan and its agents (``WorkerGroup``; a test's fake).
        clock: ``time.monotonic`` for the attempts (a test's fake clock).
        new_watch: Watches an elastic run's left-out hosts during an attempt (``HostWatch``; a
            test's fake).
    """

    def __init__(
        self,
        run: Run,
        *,
        start_agents: Callable[[Plan], Launcher] = Plan.new_launcher,
        new_group: Callable[[Plan, Launcher], WorkerGroup] = WorkerGroup,
        clock: Callable[[], float] = time.monotonic,
        new_watch: Callable[[list[HostSpec], float], Any] = HostWatch,
    ) -> None:
        self.run = run
        self._new_watch = new_watch
        self._start_agents = start_agents
        self._new_group = new_group
        self._clock = clock
        failure_config = run.run_config.failure_config
        self.max_failures = failure_config.max_failures if failure_config else 0  # -1: unlimited
        self.root_causes: list[WorkerFailure] = []  # the first failure of each failed attempt
        self.group: WorkerGroup | None = None
        self._next: tuple[Plan, Launcher] | None = None  # the next attempt's, started on a failure
        self._next_error: Exception | None = None  # why they could not start
        self._dead_nodes: list[str] = []  # a fixed-size SLURM run's nodes lost in the last attempt
        self._min_wait_until: float | None = None  # an elastic run waits for min_workers until then

    def fit(self) -> Result:
        """Run the attempts; the Result of the one that succeeded.

        Raises:
            WorkerGroupError: The last attempt failed (every attempt's root cause is listed).
            ControllerError: The driver could not write the run (a full disk).
        """
        try:
            with preemption.sigterm_notices():  # a SIGTERM now is a preemption notice
                return self._fit()
        finally:  # after the handler is restored: a notice belongs to the fit() that got it
            preemption.drop_unused(self.run.name)

    def _fit(self) -> Result:
        run = self.run
        with run.opened() as index:  # makes run.plan, locked
            _logger.info("ddptrain: run %r in %s with %d workers", run.name, run.location, run.plan.world_size)
            # A warm group from an earlier fit(), or new agents importing torch meanwhile.
            try:
                self.group = take_warm(run.plan) or self._first_group(index)
            except LaunchError as exc:  # a host that cannot be reached: the run failed, it was not aborted
                run.ended(error=_one_line(exc))
                raise
            kept = False
            try:
                return_values, keep = self._attempts(index)
                run.validations.finish()  # bounded: DDPTRAIN_VALIDATION_WAIT_S
                run.ended()
                kept = keep and self.group.alive and put_warm(self.group)
            finally:
                if self.group is not None and not kept:
                    self.group.shutdown()
                if self._next is not None:
                    self._next[1].shutdown(_env.shutdown_grace_s())
                    self._next = None
                if run.datasets is not None:
                    run.datasets.release()
        return run.result(return_values)

    def _first_group(self, index: int) -> WorkerGroup:
        """The first attempt's group. An elastic run leaves the hosts whose agents cannot start
        out (they are watched like hosts lost later), down to ``min_workers``."""
        run = self.run
        while True:
            try:
                return self._new_group(run.plan, self._start_agents(run.plan))
            except LaunchError as exc:
                unreachable = set(exc.hosts) - run.left_out
                if not run.scaling_config.elastic or not unreachable:
                    raise
                _logger.warning("ddptrain: leaving out host(s) %s: %s", ", ".join(sorted(unreachable)), exc)
                run.left_out = run.left_out | unreachable
                why = f"host(s) {', '.join(sorted(unreachable))} left out (their agents could not start)"
                run.use_plan(self._plan_with_min_workers(), index, why)

    def _attempts(self, index: int) -> tuple[list[Any], bool]:
        """Attempt after attempt from number ``index``: the return values of the one that
        succeeded, and whether its workers stay warm."""
        while True:
            assert self.group is not None
            self.run.save_status("RUNNING", attempt=index)
            self._min_wait_until = None  # a later wait for min_workers has a bound of its own
            watch = self._watch()
            attempt = Attempt(
                self.run.attempt_context(index),
                self.run,
                self.group,
                keep=keeps_warm(self.run.plan),
                clock=self._clock,
                watch=watch,
            )
            try:
                outcome = attempt.run()
            except (ChannelError, LaunchError) as exc:  # the driver's channel stopped, an agent never ran
                self.run.ended(error=_one_line(exc))  # ERRORED, not ABORTED
                raise
            finally:
                if watch is not None:
                    watch.stop()
            if isinstance(outcome, Succeeded):
                return outcome.return_values, outcome.keep_warm
            if isinstance(outcome, Resized) and preemption.pending() is None:
                index = self._grow(outcome, index)
                continue
            notice = preemption.pending()
            if notice is not None and notice.hosts is not None and self.run.scaling_config.elastic:
                shrunk = self._shrink(outcome, notice, index)
                if shrunk is not None:
                    index = shrunk
                    continue
            if not isinstance(outcome, Failed) or notice is not None:  # a failure in the window is not retried
                self._stop_preempted(outcome, notice or outcome.notice)  # type: ignore[union-attr]
            assert isinstance(outcome, Failed)
            index = self._restart(outcome, index)

    def _watch(self) -> Any:
        """An elastic run's watch on the hosts it left out, started (``None``: nothing to watch)."""
        run = self.run
        if not run.scaling_config.elastic or not run.left_out:
            return None
        # A SLURM node lost mid-run is not watched: SLURM takes a failed node out of the job (or
        # ends the job), so it does not come back to this allocation.
        hosts = [h for h in Plan.read_hosts(run.scaling_config) or [] if h.name in run.left_out and not h.srun]
        if not hosts:
            return None
        return self._new_watch(hosts, run.scaling_config.elastic_resize_monitor_interval_s).start()

    def _grow(self, resized: Resized, index: int) -> int:
        """Hosts left out answer again: the next attempt runs on a larger group from the
        checkpoint the last one stopped at. Not a failure (``max_failures`` is not spent); if
        the larger group's agents cannot start, the hosts stay left out and the group restarts
        at its size."""
        assert self.group is not None
        run = self.run
        run.left_out = run.left_out - set(resized.hosts)
        why = f"host(s) {', '.join(resized.hosts)} came back"
        try:
            plan = run.new_plan()
            launcher = self._warm_launcher(plan) or self._start_agents(plan)
        except (LaunchError, ConfigError) as exc:
            _logger.warning("ddptrain: host(s) %s answer but cannot run workers: %s", ", ".join(resized.hosts), exc)
            run.left_out = run.left_out | set(resized.hosts)
            why = "restarted at its size (the hosts that answered again could not start workers)"
            plan = run.new_plan()
            launcher = self._start_agents(plan)
        self.group.shutdown()
        self.group = None
        run.clean_after_failure()
        run.use_plan(plan, index + 1, why)
        self.group = self._new_group(plan, launcher)
        index += 1
        run.progress.say(
            f"ddptrain: attempt {index} starts from {resized.checkpoint.path} with {plan.world_size} workers", index
        )
        run.save_status("RESTARTING", attempt=index)
        return index

    def _shrink(self, outcome: Failed | Preempted | Resized, notice: preemption.Notice, index: int) -> int | None:
        """Hosts of an elastic run are being preempted (a SIGTERM to their agents): the attempt
        stopped at the checkpoint its workers reported after the notice (or at its deadline),
        and the next one runs without those hosts, from the latest checkpoint: a resize, not a
        failure. ``None`` when the other hosts cannot hold ``min_workers`` (or their agents
        cannot start): the run then stops as preempted."""
        assert self.group is not None
        run = self.run
        hosts = set(notice.hosts or ())
        before = run.left_out
        run.left_out = before | hosts
        try:
            plan = run.new_plan()
            launcher = self._warm_launcher(plan) or self._start_agents(plan)
        except (LaunchError, ConfigError) as exc:
            _logger.warning("ddptrain: the run cannot go on without host(s) %s: %s", ", ".join(sorted(hosts)), exc)
            run.left_out = before
            return None
        self.group.shutdown()
        self.group = None
        run.clean_after_failure(list(outcome.failures) if isinstance(outcome, Failed) else [])
        preemption.clear()
        why = f"host(s) {', '.join(sorted(hosts))} preempted ({notice.reason})"
        run.use_plan(plan, index + 1, why)
        self.group = self._new_group(plan, launcher)
        index += 1
        run.progress.say(
            f"ddptrain: attempt {index} starts from {run.latest_path or 'scratch'} with {plan.world_size} workers",
            index,
        )
        run.save_status("RESTARTING", attempt=index)
        return index

    def _stop_preempted(self, outcome: Failed | Preempted | Resized, notice: preemption.Notice) -> None:
        """A preemption notice stopped the attempt (or it failed during the notice's window):
        the run is recorded as PREEMPTED, and ``fit()`` raises ``RunPreemptedError``."""
        assert self.group is not None
        self.group.shutdown()
        self.group = None
        run = self.run
        failures = list(outcome.failures) if isinstance(outcome, Failed) else []
        run.clean_after_failure(failures)  # a report round cut short, and the logs
        if failures:
            _logger.warning("ddptrain: during the preemption window: %s", failures[0].headline())
        preemption.clear()
        run.preempted(notice.reason)
        latest = run.latest_checkpoint
        where = f"from checkpoint {latest.path}" if latest is not None else "from scratch (no checkpoint was reported)"
        raise RunPreemptedError(
            f"Run {run.name!r} was preempted ({notice.reason}). Run the script again with the same "
            f"RunConfig(name={run.name!r}, storage_path=...) to resume it {where}.",
            checkpoint=latest,
            reason=notice.reason,
        )

    def _budget_left(self, pending: int = 0) -> bool:
        """Whether another attempt is allowed after the failures seen (``pending``: one more
        that is being torn down and not counted yet)."""
        return self.max_failures == -1 or len(self.root_causes) + pending <= self.max_failures

    def _plan_with_min_workers(self) -> Plan:
        """The next plan. When the hosts an elastic run has not left out cannot hold
        ``min_workers``, wait for left-out hosts to answer again (their SSH port, every second),
        up to ``DDPTRAIN_ELASTIC_MIN_WORKERS_TIMEOUT_S`` from the first such wait of the attempt
        to come; hosts that answer are taken back (their agents may still fail to start: then
        they are left out again, within the same bound).

        Raises:
            LaunchError: Still too few workers at the end of the wait (what it waited for is said).
        """
        run = self.run
        while True:
            try:
                return run.new_plan()
            except LaunchError as exc:
                if not run.scaling_config.elastic or not run.left_out:
                    raise
                timeout_s = _env.elastic_min_workers_timeout_s()
                now = self._clock()
                if self._min_wait_until is None:
                    self._min_wait_until = now + timeout_s
                    run.progress.say(
                        f"ddptrain: waiting up to {timeout_s:g} s for host(s) {', '.join(sorted(run.left_out))} to "
                        f"answer again: {exc}"
                    )
                left_s = self._min_wait_until - now
                if left_s <= 0:
                    raise LaunchError(
                        f"{exc} Waited {timeout_s:g} s for host(s) {', '.join(sorted(run.left_out))} to answer again "
                        "(DDPTRAIN_ELASTIC_MIN_WORKERS_TIMEOUT_S).",
                        hosts=sorted(run.left_out),
                    ) from None
                hosts = [h for h in Plan.read_hosts(run.scaling_config) or [] if h.name in run.left_out]
                back = answering(hosts, min(_env.ssh_connect_timeout_s(), left_s, 1.0))
                if back:
                    _logger.warning("ddptrain: host(s) %s answer again; taking them back", ", ".join(back))
                    run.left_out = run.left_out - set(back)
                else:
                    time.sleep(min(1.0, max(0.0, self._min_wait_until - self._clock())))

    def _start_next(self, wait: bool = False) -> None:
        try:
            plan = self._plan_with_min_workers() if wait else self.run.new_plan()
            self._next = (plan, self._start_agents(plan))
            self._next_error = None
        except (LaunchError, ConfigError) as exc:  # tried once more when the group is down
            self._next_error = exc
            _logger.warning("ddptrain: could not start the next attempt's agents: %s", exc)

    def _warm_next(self) -> tuple[Plan, Launcher] | None:
        """The failed group's agents, reset for the next attempt (their workers and what those
        started are gone), when the next plan runs on the same hosts and every agent is alive:
        the next workers are forked from them, without a new SSH connection or torch import.
        ``None``: new agents start (``DDPTRAIN_WARM_RESTARTS=0``, a host lost or changed, an
        agent that died, was preempted, or did not answer the reset in time).

        Raises:
            LaunchError: Agents were kept, but those of the plan's other hosts could not start.
        """
        try:
            plan = self.run.new_plan()
        except (LaunchError, ConfigError):
            return None
        launcher = self._warm_launcher(plan)
        return None if launcher is None else (plan, launcher)

    def _warm_launcher(self, plan: Plan) -> Launcher | None:
        """The agents of ``plan``: those of the current group that run on its hosts and can be
        kept (reset), and new ones for its other hosts (``None``: none kept; see
        :meth:`_warm_next`). Over a host list each host's agent is kept or not on its own: a
        lost host costs only its replacement's start.

        Raises:
            LaunchError: The new agents could not start (the kept ones are shut down).
        """
        group = self.group
        assert group is not None
        old = group.launcher
        if not _env.warm_restarts() or old is None:
            return None
        timeout_s = _env.shutdown_grace_s() + 5.0
        if plan.placement is not None and group.plan.placement is not None and hasattr(old, "take"):
            kept = old.take({plan.host_key(host) for host in plan.placement.hosts}, timeout_s)
            if not kept:
                return None
            _logger.info("ddptrain: the next attempt keeps the agents of %d host(s)", len(kept))
            return plan.new_launcher(kept)  # a LaunchError: the kept agents were shut down too
        if plan.agents_key() != group.plan.agents_key() or not old.reset(timeout_s):
            return None
        group.launcher = None  # kept: the group's shutdown leaves them
        _logger.info("ddptrain: the next attempt's workers start from the last attempt's agents")
        return old

    def _restart(self, failed: Failed, index: int) -> int:
        """After attempt ``index`` failed: the number of the next one, its group started.

        If another attempt may follow, its agents start first, while the failed group is torn
        down (they import torch meanwhile).

        Raises:
            WorkerGroupError: No attempt follows (the budget is spent, the failure came after
                every rank returned, a disk is full, or the next group could not start).
        """
        assert self.group is not None
        left = self._leave_out_lost(failed)
        self._dead_nodes = [] if self.run.scaling_config.elastic else self._lost_slurm_nodes(list(failed.failures))
        if self._dead_nodes:  # a fixed-size run cannot go on without them: no new attempt on them
            failed = dataclasses.replace(failed, retryable=False)
        if failed.retryable and self._next is None and self._budget_left(pending=1):
            try:
                self._next = self._warm_next()
            except LaunchError as exc:  # a host's new agent could not start: not tried twice now
                self._next_error = exc
                _logger.warning("ddptrain: could not start the next attempt's agents: %s", exc)
            else:
                if self._next is None:
                    self._start_next()
        self.group.shutdown()
        self.group = None
        run = self.run
        failures = list(failed.failures)  # root cause first (the group orders them)
        run.clean_after_failure(failures)
        self.root_causes.append(failures[0])
        run.attempt_failed(index, failures[0])
        run.after_exception(failures)
        if failed.retryable and self._budget_left():
            if self._next is None and not self._still_lost(failures):  # not started early, or that failed: once more
                self._start_next(wait=True)
            if self._next is not None:
                plan, launcher = self._next
                self._next = None
                run.use_plan(
                    plan, index + 1, f"host(s) {', '.join(left)} left (lost in attempt {index})" if left else ""
                )
                self.group = self._new_group(plan, launcher)
        if self.group is None:
            run.ended(error=failures[0].headline())
            raise self._final_error(failures, index) from failures[0].exception
        budget = f"failure {len(self.root_causes)} of {'unlimited' if self.max_failures == -1 else self.max_failures}"
        # The console line is the progress's (a warning here printed it a second time).
        _logger.info(
            "ddptrain: attempt %d failed (%s); restarting from %s (%s allowed)",
            index,
            failures[0].headline(),
            run.latest_path or "scratch",
            budget,
        )
        index += 1
        run.progress.restarting(index, failures[0].headline(), run.latest_path, f"{budget} allowed")
        run.save_status("RESTARTING", attempt=index)
        return index

    def _leave_out_lost(self, failed: Failed) -> list[str]:
        """An elastic run leaves the hosts lost in a failed attempt (stopped answering, or their
        agent died) out of the next attempts; the names of those newly left out."""
        if not self.run.scaling_config.elastic:
            return []
        lost = {f.host for f in failed.failures if isinstance(f.exception, LaunchError) and f.host}
        new = sorted(lost - self.run.left_out)
        self.run.left_out = self.run.left_out | lost
        return new

    def _lost_slurm_nodes(self, failures: list[WorkerFailure]) -> list[str]:
        """The nodes of a SLURM allocation that stopped answering in the failed attempt: SLURM
        takes a failed node out of the job or ends the job, so no later attempt can use them."""
        lost = {f.exception.host for f in failures if isinstance(f.exception, HostLostError)}
        if not lost:
            return []
        return sorted(h.name for h in Plan.read_hosts(self.run.scaling_config) or [] if h.srun and h.name in lost)

    def _still_lost(self, failures: list[WorkerFailure]) -> list[str]:
        """The hosts that stopped answering in the failed attempt and that the next attempt's
        agents could not reach during the teardown: they had one connect timeout to come back,
        and are not tried again."""
        lost = {f.exception.host for f in failures if isinstance(f.exception, HostLostError)}
        error = self._next_error
        return sorted(lost & set(error.hosts)) if isinstance(error, LaunchError) else []

    def _final_error(self, failures: list[WorkerFailure], index: int) -> WorkerGroupError:
        error = WorkerGroupError.from_failures(failures, str(self.run.log_dir(index)))
        causes = self.root_causes
        if len(causes) > 1:
            first = index - len(causes) + 1
            lines = [f"  attempt {first + i}: {f.headline()} (log: {f.log_path})" for i, f in enumerate(causes)]
            error.args = (f"{error.args[0]}\nRoot cause of every attempt ({len(causes)}):\n" + "\n".join(lines),)
        if any(is_disk_full(f.exception) for f in failures):
            error.args = (
                f"{error.args[0]}\nA file system is full: the group was not restarted (FailureConfig does not "
                "apply, every attempt would fail the same way until space is freed).",
            )
        elif self._dead_nodes:
            names = ", ".join(repr(name) for name in self._dead_nodes)
            error.args = (
                f"{error.args[0]}\nNode {names} of the SLURM allocation stopped answering: the run was not "
                f"restarted, it needs all its {self.run.plan.world_size} workers. Give `num_workers=(min, max)` "
                "to go on without a lost node (and `--no-kill` to sbatch/salloc, so that SLURM keeps the job), "
                "or run again in a new allocation to resume.",
            )
        elif self._next_error is not None:
            error.args = (f"{error.args[0]}\nThe next attempt could not start: {self._next_error}",)
            lost = self._still_lost(failures)
            if lost:
                names = ", ".join(repr(name) for name in lost)
                error.args = (
                    f"{error.args[0]}\nHost {names} stopped answering and could not be reached again (tried once). "
                    "Bring it back or take it out of the host list, then run again to resume.",
                )
        return error


def _one_line(exc: BaseException) -> str:
    """``exc`` for the run's one-line summary: its first line, and its last when it has more
    (where an agent's error output ends with the cause)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(exc).__name__}: {text}"
