"""Preemption notices in the driver: the one place that records them.

A notice comes from a SIGTERM to the driver while ``fit()`` runs (a spot instance's or a
scheduler's notice; :func:`sigterm_notices`), from a host's agent that got one
(``AgentPreempted``), or from code of the driver's process calling :func:`request_preemption`
(SLURM's warning signal, say). The attempt reads it with :func:`pending`: it hands the
workers a ``PreemptionInfo`` and stops once a checkpoint reported after the notice is committed,
or at the notice's deadline; the controller records the run as PREEMPTED. A second notice
moves the deadline to now: the run stops at once. Notices from the agents of other hosts are
not second notices: they add their hosts to the first (SLURM's ``--signal`` reaches every
node's agent within a moment).

The state is this process's (one ``fit()`` at a time runs its attempts in the main thread);
a signal handler writes it with plain assignments only. A notice belongs to the ``fit()`` that
got it: one still pending when that ``fit()`` ends (it came as the run finished) is dropped by
:func:`drop_unused`, so the next ``fit()`` in the process is not stopped by it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

from ddptrain import _env

__all__ = ["Notice", "clear", "drop_unused", "pending", "request_preemption", "sigterm_notices"]

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Notice:
    """A preemption notice.

    Attributes:
        reason: What it was, for the console, ``run.json`` and the workers.
        deadline: When the run stops at the latest (``time.monotonic()``).
        deadline_ms: The same as UNIX time in milliseconds (what the workers are told).
        hosts: The hosts going away (``None``: the driver's own notice, every host).
        at_once: A second notice came: stop now, without waiting for a checkpoint.
    """

    reason: str
    deadline: float
    deadline_ms: int
    hosts: tuple[str, ...] | None = None
    at_once: bool = False

    def expired(self) -> bool:
        return self.at_once or time.monotonic() >= self.deadline


_notice: Notice | None = None


def request_preemption(reason: str, deadline_s: float | None = None, hosts: list[str] | None = None) -> None:
    """Tell the running ``fit()`` that it is being preempted (safe in a signal handler).

    The workers get a ``PreemptionInfo`` (``ddptrain.get_preemption_info()``) and have until the
    deadline to report a checkpoint; the run then stops and is recorded as PREEMPTED, and
    ``fit()`` raises ``RunPreemptedError``. A second call stops the run at once, unless both
    name ``hosts``: another host's notice adds its hosts (and its reason) to the first.

    Args:
        reason: What the notice is, e.g. ``"SLURM warning signal (USR1)"``.
        deadline_s: Seconds from now until the run must have stopped (default:
            ``DDPTRAIN_PREEMPTION_WINDOW_S``, 30 s).
        hosts: The hosts going away (default: all of them, the driver's own notice).
    """
    global _notice
    if _notice is not None and hosts and _notice.hosts is not None:  # more hosts going away
        more = tuple(host for host in hosts if host not in _notice.hosts)
        if more:
            _notice = dataclasses.replace(_notice, hosts=_notice.hosts + more, reason=f"{_notice.reason}; {reason}")
        return
    if _notice is not None:  # a second notice: stop now
        _notice = dataclasses.replace(_notice, deadline=time.monotonic(), at_once=True)
        return
    window = _env.preemption_window_s() if deadline_s is None else max(0.0, deadline_s)
    _notice = Notice(
        reason=reason,
        deadline=time.monotonic() + window,
        deadline_ms=int((time.time() + window) * 1000),
        hosts=tuple(hosts) if hosts else None,
    )


def pending() -> Notice | None:
    """The notice the running ``fit()`` must act on, if any."""
    return _notice


def clear() -> None:
    """Forget the notice (the run it stopped was recorded as preempted)."""
    global _notice
    _notice = None


def drop_unused(run_name: str) -> None:
    """``fit()`` of run ``run_name`` ended: forget a notice it did not act on (it came as the
    run finished), saying so, so that it does not stop the next ``fit()`` of this process."""
    notice = _notice
    if notice is None:
        return
    clear()
    _logger.warning(
        "ddptrain: the preemption notice (%s) came as run %r ended; it was not acted on, and the next "
        "fit() of this process does not see it",
        notice.reason,
        run_name,
    )


@contextlib.contextmanager
def sigterm_notices() -> Iterator[None]:
    """While the body runs, a SIGTERM to this process is a preemption notice (and a second one
    stops the run at once) instead of ending the process. Only in the main thread, where
    Python runs signal handlers; elsewhere a no-op. The earlier handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        request_preemption(f"SIGTERM to the driver (pid {os.getpid()})")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
