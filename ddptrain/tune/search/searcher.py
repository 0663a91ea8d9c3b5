"""``Searcher``: what suggests the config of each new trial (driver side)."""

from __future__ import annotations

from typing import Any

__all__ = ["Searcher"]


class Searcher:
    """Suggests trial configs and learns from their results.

    The sweep calls :meth:`set_search_properties` once, then :meth:`suggest` for each new
    trial, :meth:`on_trial_result` for each report and :meth:`on_trial_complete` at the end of
    each trial. Calls come from one thread at a time.

    Args:
        metric: The metric to optimize (default: ``TuneConfig.metric``).
        mode: ``"min"`` or ``"max"`` (default: ``TuneConfig.mode``).
    """

    FINISHED = "FINISHED"

    def __init__(self, metric: str | None = None, mode: str | None = None) -> None:
        if mode is not None and mode not in ("min", "max"):
            raise ValueError(f"`mode` must be 'min' or 'max', got {mode!r}.")
        self.metric = metric
        self.mode = mode

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict[str, Any]) -> bool:
        """Take the sweep's metric, mode and ``param_space``; returns whether they were taken."""
        self.metric = self.metric or metric
        self.mode = self.mode or mode
        return True

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        """The config of trial ``trial_id``; ``None`` for not now, :attr:`FINISHED` for never again."""
        raise NotImplementedError

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        """A report of a running trial."""

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        """The trial ended: ``result`` is its last report, ``error`` whether it failed."""

    @property
    def total_trials(self) -> int | None:
        """How many trials this searcher will suggest in all, when known."""
        return None
