"""How ``TorchTrainer`` treats its worker group's failures, and the one call it does not wait
for (``load_state_dict(blocking=False)``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ddptrain.errors import LaunchError, WorkerDiedError, WorkerGroupError
from ddptrain.launch.hosts import HostSpec
from ddptrain.worker_group import WorkerGroup

__all__: list[str] = []

_logger = logging.getLogger(__name__)
_LAUNCH_ROUNDS = 3  # attempts (with backoff) to start any workers at all after a failure


class PendingCall:
    """``group.execute(fn, *args)`` running in a thread, so that the caller returns before the
    workers are done; :meth:`wait` joins it and raises what it raised.

    Only one thread uses the group at a time: the trainer waits for a pending call before it
    uses the group again. The workers run commands in the order they get them, so a call sent
    later would run after this one anyway; waiting first also brings this one's error (a
    worker that died, or raised) to the caller.
    """

    def __init__(self, group: WorkerGroup, state: Any, fn: Callable[..., Any], *args: Any) -> None:
        self.group = group
        self.state = state  # what the call loads: the trainer's restart state once it succeeded
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="ddptrain-sgd-call", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self.group.execute(fn, *args)
        except BaseException as exc:  # handed to the caller by wait()
            self._error = exc

    def wait(self) -> None:
        """Block until every worker answered; raises the call's error (a ``WorkerGroupError``)."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def start_what_starts(
    start: Callable[[int, list[HostSpec] | None], WorkerGroup], num_workers: int, hosts: list[HostSpec] | None
) -> WorkerGroup:
    """A group of as many workers as will start, ``num_workers`` at most: ``start(workers,
    hosts)`` is tried with fewer and fewer workers (leaving out hosts that failed), in a few
    rounds with a growing pause. An error of the user's code is raised at once."""
    last: BaseException | None = None
    for round_ in range(_LAUNCH_ROUNDS):
        if round_:
            time.sleep(2.0**round_)
        excluded: set[str] = set()
        for workers in range(num_workers, 0, -1):
            left = None
            if hosts is not None:
                left = [h for h in hosts if h.name not in excluded]
                if sum(h.slots or 1 for h in left) < workers:
                    continue  # the hosts left cannot hold this many
            try:
                return start(workers, left)
            except (LaunchError, WorkerGroupError) as exc:
                if isinstance(exc, WorkerGroupError) and not lost_worker(exc):
                    raise  # the operator's own error: a retry would fail the same way
                last = exc
                excluded |= failed_hosts(exc, hosts)
                _logger.info("ddptrain: %d worker(s) did not start: %s", workers, exc)
    raise WorkerGroupError(f"No worker could be started after a failure: {last}", {}) from last


def lost_worker(exc: WorkerGroupError, group: WorkerGroup | None = None) -> bool:
    """Whether a failure means a worker (or its host) was lost, rather than an error of the
    user's code: only the first can be fixed by a restart."""
    if not exc.worker_failures and not exc.failures:
        return True  # "the worker group is not running"
    if any(isinstance(e, (WorkerDiedError, LaunchError)) for e in exc.worker_failures.values()):
        return True
    if group is not None:
        # A peer's collective may fail before the driver hears that a worker died: listen a moment.
        try:
            group.pump_until(lambda: bool(group.exited), timeout_s=1.0)
        except WorkerGroupError as more:
            return any(isinstance(e, (WorkerDiedError, LaunchError)) for e in more.worker_failures.values())
        except TimeoutError:
            return False
        return True
    return False


def discard(group: WorkerGroup) -> None:
    """Kill a group that failed at once. Its backend's orderly shutdown (destroying the process
    group) would wait for a rank that may be stuck in a collective for good, so it is skipped."""
    group.backend = None
    group.shutdown(grace_s=0)


def failed_hosts(exc: BaseException, hosts: list[HostSpec] | None) -> set[str]:
    """Names of the hosts of a host list that a failure names (a host that could not be reached)."""
    if hosts is None:
        return set()
    names = {f.host for f in getattr(exc, "failures", []) if isinstance(f.exception, (WorkerDiedError, LaunchError))}
    text = str(exc)
    names |= {h.name for h in hosts if f"host {h.name!r}" in text}
    return names & {h.name for h in hosts}


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
