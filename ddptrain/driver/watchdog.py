"""Watching a running group for stopped and wedged workers, and Python stacks on demand.

Driver side (:class:`Watch`, driven by the attempt as it polls its group): every couple of seconds it
asks the agents for their workers' process states (``Q`` on the agent's stdin; the answer is
a ``P`` frame). A worker stopped by a signal (state ``T``) is named in a warning after
``DDPTRAIN_REPORT_WARN_INTERVAL_S``. When no rank has reported or printed anything for
``DDPTRAIN_STALL_WARN_S``, the warning lists every rank's state and asks every worker for its
Python stacks (``T``: the agent sends ``protocol.STACK_SIGNAL``, on which each worker's faulthandler prints all
its threads to its output, prefixed and logged like any other line). An agent of this machine that
is stopped by a signal answers nothing (its workers' output, exits and states wait for it, and they
block once their output fills its pipe): the driver sees its process state itself and names it in
a warning after the same interval (an agent on another host that stops goes silent, and its host is
declared lost).
(``ddptrain stack RUN`` asks a live run's driver for the same: ``ddptrain.cli.stack``.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ddptrain import _env
from ddptrain.storage import layout as storage
from ddptrain.storage.layout import RunLayout
from ddptrain.wire.protocol import Request

__all__ = ["Watch"]

_Stopped = Callable[[], list[tuple[str, int]]]  # (where, pid) of each stopped agent of this machine

_logger = logging.getLogger(__name__)

_STATE_POLL_S = 2.0
_STATE_NAMES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible I/O",
    "T": "stopped by a signal",
    "t": "stopped by a debugger",
    "Z": "a zombie",
}


def describe_state(state: dict[str, Any]) -> str:
    """``"stopped by a signal"``, ``"sleeping in futex_wait_queue"``, ..."""
    text = _STATE_NAMES.get(state.get("state", "?"), f"in state {state.get('state', '?')}")
    if state.get("wchan") and state.get("wchan") != "0" and state.get("state") in ("S", "D"):
        text += f" in {state['wchan']}"
    return text


class Watch:
    """Stall and stop warnings for one attempt.

    Args:
        run_dir: The run directory (where ``ddptrain stack`` leaves its requests).
        ask_agents: Sends a :class:`~ddptrain.protocol.Request` (states, or states and stacks) to every agent.
        where: ``where(rank)`` -> ``"rank 1 (host h, pid 42)"``.
        stopped_agents: ``(where, pid)`` of each agent of this machine stopped by a signal.
    """

    def __init__(
        self,
        run_dir: str,
        ask_agents: Callable[[bytes], None],
        where: Callable[[int], str],
        stopped_agents: _Stopped = list,
    ) -> None:
        self._layout = RunLayout(run_dir)
        self._ask = ask_agents
        self._where = where
        self._stopped_agents = stopped_agents
        self._agents_stopped_since: dict[int, tuple[str, float]] = {}  # pid -> (where, since)
        self._warned_agents: dict[int, float] = {}
        self.active = False  # on while the training function runs
        self.last_activity = time.monotonic()
        self.states: dict[int, dict[str, Any]] = {}
        self._stopped_since: dict[int, float] = {}
        self._warned_stopped: dict[int, float] = {}
        self._next_poll = 0.0
        self._stall_warned_at = 0.0
        self._reply_until = 0.0

    def activity(self) -> None:
        """A rank reported, printed or otherwise showed progress."""
        self.last_activity = time.monotonic()

    def on_states(self, states: dict[int, dict[str, Any]]) -> None:
        """The states one agent sent (a ``P`` frame)."""
        now = time.monotonic()
        for rank, state in states.items():
            self.states[rank] = state
            if state.get("state") in ("T", "t"):
                self._stopped_since.setdefault(rank, now)
            else:
                self._stopped_since.pop(rank, None)
        if now < self._reply_until:  # every agent's answer to a `ddptrain stack` request
            shown = {
                str(r): {**s, "where": self._where(r), "described": describe_state(s)} for r, s in self.states.items()
            }
            try:
                storage.write_json_atomic(self._layout.stack_states, shown, private=True)
            except OSError as exc:
                _logger.warning("ddptrain: could not answer `ddptrain stack`: %s", exc)

    def check(self, last_output: float) -> None:
        """Called on each tick of the attempt: poll states, warn, answer ``ddptrain stack``."""
        now = time.monotonic()
        request = self._layout.stack_request
        if request.exists():
            request.unlink(missing_ok=True)
            _logger.warning("ddptrain: `ddptrain stack` asked for every rank's Python stacks")
            self._reply_until = now + 2.0
            self._ask(Request.STACKS)
            return
        if not self.active:
            return
        if now >= self._next_poll:
            self._next_poll = now + _STATE_POLL_S
            self._ask(Request.STATES)
            self._poll_agents(now)
        interval = _env.report_warn_interval_s()
        self._warn_stopped_agents(now, interval)
        for rank, since in self._stopped_since.items():
            if now - since >= interval and now - self._warned_stopped.get(rank, -1e9) >= max(interval, 30.0):
                self._warned_stopped[rank] = now
                pid = self.states[rank].get("pid")
                _logger.warning(
                    "ddptrain: %s has been stopped by a signal for %.0f s (process state T); its peers wait "
                    "for it (their Python stacks follow in their output). `kill -CONT %s` on its host resumes it.",
                    self._where(rank),
                    now - since,
                    pid,
                )
                self._ask(Request.STACKS)
        stall_s = _env.stall_warn_s()
        quiet = now - max(self.last_activity, last_output)
        if quiet >= stall_s and now - self._stall_warned_at >= stall_s:
            self._stall_warned_at = now
            states = "; ".join(f"{self._where(r)}: {describe_state(s)}" for r, s in sorted(self.states.items()))
            if self._agents_stopped_since:  # its workers' states are from before it stopped
                stopped = ", ".join(f"{w} (pid {pid})" for pid, (w, _) in self._agents_stopped_since.items())
                states = f"{states or 'not known'} (as last answered: the ddptrain agent {stopped} is stopped)"
            _logger.warning(
                "ddptrain: no rank has reported or printed anything for %.0f s (DDPTRAIN_STALL_WARN_S). "
                "Process states: %s. Each live rank's Python stacks follow in its output.",
                quiet,
                states or "not known yet",
            )
            self._ask(Request.STACKS)

    def _poll_agents(self, now: float) -> None:
        """Look at which agents of this machine are stopped by a signal (and since when)."""
        stopped = {pid: where for where, pid in self._stopped_agents()}
        for pid in list(self._agents_stopped_since):
            if pid not in stopped:
                del self._agents_stopped_since[pid]
                self._warned_agents.pop(pid, None)
        for pid, where in stopped.items():
            self._agents_stopped_since.setdefault(pid, (where, now))

    def _warn_stopped_agents(self, now: float, interval: float) -> None:
        """Name an agent stopped for ``interval`` (again every 30 s at least): nothing of its
        workers reaches the driver, and they block once their output fills its pipe."""
        for pid, (where, since) in self._agents_stopped_since.items():
            if now - since >= interval and now - self._warned_agents.get(pid, -1e9) >= max(interval, 30.0):
                self._warned_agents[pid] = now
                _logger.warning(
                    "ddptrain: the ddptrain agent %s (pid %s) has been stopped by a signal for %.0f s (process "
                    "state T): its workers' output, their exits and their states wait for it, and its workers "
                    "block once their output fills its pipe. `kill -CONT %s` resumes it.",
                    where,
                    pid,
                    now - since,
                    pid,
                )
