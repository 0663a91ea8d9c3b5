"""``stop=`` criteria: when a trial has done enough (driver side)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Stopper", "FunctionStopper", "MaximumIterationStopper", "as_stopper"]


class Stopper:
    """Decides after each report whether a trial stops (it then ends as ``TERMINATED``)."""

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        """Whether trial ``trial_id`` stops after ``result``."""
        return False

    def stop_all(self) -> bool:
        """Whether the whole sweep stops now."""
        return False


class _DictStopper(Stopper):
    def __init__(self, criteria: Mapping[str, Any]) -> None:
        self.criteria = dict(criteria)

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        for key, limit in self.criteria.items():
            value = result.get(key)
            if value is not None and value >= limit:
                return True
        return False


class FunctionStopper(Stopper):
    """Wraps ``fn(trial_id, result) -> bool``."""

    def __init__(self, fn: Callable[[str, dict[str, Any]], bool]) -> None:
        self.fn = fn

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return bool(self.fn(trial_id, result))


class MaximumIterationStopper(Stopper):
    """Stops each trial after ``max_iter`` reports."""

    def __init__(self, max_iter: int) -> None:
        self.max_iter = max_iter

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return int(result.get("training_iteration", 0)) >= self.max_iter


def as_stopper(stop: Any) -> Stopper | None:
    """``stop=`` as a :class:`Stopper`: a dict (a trial stops when any ``result[key] >= value``),
    a function ``(trial_id, result) -> bool``, or a Stopper."""
    if stop is None or isinstance(stop, Stopper):
        return stop
    if isinstance(stop, Mapping):
        return _DictStopper(stop)
    if callable(stop):
        return FunctionStopper(stop)
    raise ValueError(f"`stop` must be a dict, a function (trial_id, result) -> bool or a Stopper, got {stop!r}.")
