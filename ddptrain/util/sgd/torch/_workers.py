"""The worker group behind one ``TorchTrainer``, and the state a new group resumes from.

:class:`Workers` holds at most one live ``WorkerGroup`` (an operator on every worker) and rank
0's state after the last successful call. Before the group is used it lets a
``load_state_dict(blocking=False)`` still under way finish, and replaces a group that failed
with as many workers as will start; it also shuts the group down. When to retry a call or to
grow back to ``num_workers`` is the trainer's decision (``torch_trainer``); how a failure is
told apart from the user's error is ``_recovery``'s.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeAlias

from ddptrain.errors import WorkerGroupError
from ddptrain.launch.hosts import HostSpec
from ddptrain.util.sgd.torch import _runner
from ddptrain.util.sgd.torch._recovery import PendingCall, discard, first_line, lost_worker, start_what_starts
from ddptrain.worker_group import WorkerGroup

__all__: list[str] = []

_logger = logging.getLogger(__name__)

State: TypeAlias = dict[str, Any] | bytes | None
"""A state dict, or one pickled by rank 0 (``_runner.train``) or the driver; ``None``: none yet."""


class Workers:
    """A trainer's worker group and the state a replacement group resumes from.

    Args:
        start: ``start(workers, hosts, state)`` launches a group with an operator on each worker,
            loaded with ``state``; it raises (and leaves nothing running) if that fails.
        num_workers: How many workers the trainer asked for; a restart starts at most this many.
        hosts: The trainer's host list, or ``None`` for this machine.
    """

    def __init__(
        self,
        start: Callable[[int, list[HostSpec] | None, State], WorkerGroup],
        num_workers: int,
        hosts: list[HostSpec] | None,
    ) -> None:
        self._start = start
        self.num_workers = num_workers
        self.hosts = hosts
        self.state: State = None  # rank 0's state after the last successful call
        self.generation = 0  # counts the groups started: what was built for an older one is stale
        self.last_resize = time.monotonic()  # when the group last shrank or tried to grow
        self._pending: PendingCall | None = None  # a load_state_dict(blocking=False) under way
        self.group: WorkerGroup | None = start(num_workers, hosts, None)

    @property
    def count(self) -> int:
        """Workers in the group now; 0 once shut down."""
        return len(self.group) if self.group is not None else 0

    def live(self) -> WorkerGroup:
        """The group; raises once the trainer was shut down."""
        if self.group is None:
            raise RuntimeError("This TorchTrainer was shut down.")
        return self.group

    def settle(self) -> None:
        """Wait for a ``load_state_dict(blocking=False)`` still under way; its failure ends the
        group and is raised here. Once it succeeded, its state is what a restart resumes from."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.wait()
        except WorkerGroupError as exc:
            discard(pending.group)
            if lost_worker(exc):  # the state was fine: a restart loads it
                self.state = pending.state
            raise
        self.state = pending.state

    def ready(self) -> WorkerGroup:
        """The group, once a pending call is done, restarted first if it failed."""
        self.live()
        self.settle()
        if not self.live().alive:
            self.restart()
        return self.live()

    def call(self, fn: Callable[..., Any], *args: Any, rank: int | None = None) -> Any:
        """``fn(*args)`` on every worker (or on ``rank``); a failure ends the group (the next
        call starts a new one)."""
        group = self.ready()
        try:
            return group.execute(fn, *args) if rank is None else group.execute_single(rank, fn, *args)
        except WorkerGroupError:
            discard(group)
            raise

    def restart(self) -> None:
        """Replace a failed group: as many workers as will start (``num_workers`` at most),
        resuming from :attr:`state`."""
        if self.group is not None:
            discard(self.group)
            self.group = None
        group = start_what_starts(
            lambda workers, hosts: self._start(workers, hosts, self.state), self.num_workers, self.hosts
        )
        self.generation += 1
        if len(group) < self.num_workers:
            message = (
                f"ddptrain: only {len(group)} of {self.num_workers} workers could be started; training "
                f"goes on with {len(group)} (it tries to grow back before later train() calls)."
            )
            _logger.warning(message)
            # stacklevel 3: the user's call (train(), ...) that found the group failed.
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            self.last_resize = time.monotonic()
        self.group = group

    def replace(self, group: WorkerGroup, state: State) -> None:
        """Shut the live group down in favour of ``group`` (started from ``state``)."""
        self.live().shutdown()
        self.group, self.state = group, state
        self.generation += 1

    def load(self, data: bytes, blocking: bool) -> None:
        """Load a pickled state dict into every worker; without ``blocking``, return once it is
        on its way (:meth:`settle` waits for it)."""
        group = self.ready()
        if not blocking:
            self._pending = PendingCall(group, data, _runner.load_state_dict, data)
            return
        try:
            group.execute(_runner.load_state_dict, data)
        except WorkerGroupError:
            discard(group)
            raise
        self.state = data

    def shutdown(self, force: bool) -> None:
        """Stop every worker (``force``: without letting operators clean up), once a pending
        call is done. Safe to call twice."""
        group, self.group = self.group, None
        if group is None:
            return
        try:  # a load_state_dict(blocking=False) under way first (its thread owns the group until then)
            self.settle()
        except WorkerGroupError as exc:
            _logger.warning("ddptrain: loading a state failed before the shutdown (ignored): %s", first_line(exc))
        if force or not group.alive:
            discard(group)
            return
        try:
            group.execute(_runner.teardown)
        except WorkerGroupError as exc:
            _logger.warning("ddptrain: a worker failed while shutting down (ignored): %s", first_line(exc))
            discard(group)
            return
        group.shutdown()
