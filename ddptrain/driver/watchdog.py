"""Watching a running group for stopped and wedged workers, and Python stacks on demand.

Driver side (:class:`Watch`, driven by the attempt as it polls its group): every couple of seconds it
asks the agents for their workers' process states (``Q`` on the agent's stdin; the answer is
a ``P`` frame). A worker stopped by a signal (state ``T``) is named in a warning after
``DDPTRAIN_REPORT_WARN_INTERVAL_S``. When no rank has reported or printed anything for
``DDPTRAIN_STALL_WARN_S``, the warning lists every rank's state and asks every worker for its
Python stacks (``T``: the agent sends ``protocol.STACK_SIGNAL``, on which each worker's faulthandler prints all
its threads to its output, prefixed and logged like any other line).
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
    """

    def __init__(self, run_dir: str, ask_agents: Callable[[bytes], None], where: Callable[[int], str]) -> None:
        self._layout = RunLayout(run_dir)
        self._ask = ask_agents
        self._where = where
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
        interval = _env.report_warn_interval_s()
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
            _logger.warning(
                "ddptrain: no rank has reported or printed anything for %.0f s (DDPTRAIN_STALL_WARN_S). "
                "Process states: %s. Each live rank's Python stacks follow in its output.",
                quiet,
                states or "not known yet",
            )
            self._ask(Request.STACKS)
