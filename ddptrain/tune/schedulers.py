"""Trial schedulers: which running trials to stop early (driver side).

A scheduler sees every report of every trial (``on_trial_result``) and answers ``CONTINUE``
or ``STOP``. A trial told to ``STOP`` has its worker group torn down at once and ends as
``TERMINATED`` with ``stopped_early`` set (shown as ``STOPPED`` in the status table), not as
an error. Pausing trials (PBT, HyperBand's synchronous brackets) is not supported.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["TrialScheduler", "FIFOScheduler", "ASHAScheduler", "AsyncHyperBandScheduler", "MedianStoppingRule"]


class TrialScheduler:
    """Base class: decides at each report whether a trial goes on."""

    CONTINUE = "CONTINUE"
    STOP = "STOP"

    def __init__(self, metric: str | None = None, mode: str | None = None) -> None:
        if mode is not None and mode not in ("min", "max"):
            raise ValueError(f"`mode` must be 'min' or 'max', got {mode!r}.")
        self.metric = metric
        self.mode = mode

    def set_search_properties(self, metric: str | None, mode: str | None) -> bool:
        """Take the sweep's metric and mode where none was given to the scheduler."""
        self.metric = self.metric or metric
        self.mode = self.mode or mode
        return True

    def on_trial_add(self, trial_id: str) -> None:
        """A trial starts."""

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> str:
        """A report of ``trial_id``: return :attr:`CONTINUE` or :attr:`STOP`."""
        return self.CONTINUE

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None) -> None:
        """A trial ended (finished, stopped or failed)."""

    def _score(self, result: dict[str, Any]) -> float | None:
        """The result's metric, negated for ``mode="min"`` so that higher is always better."""
        value = result.get(self.metric) if self.metric else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            return None
        return float(value) if self.mode == "max" else -float(value)

    def _require(self, name: str) -> None:
        if self.metric is None or self.mode is None:
            raise ValueError(
                f"{name} needs a metric and a mode: pass `TuneConfig(metric=..., mode=...)` "
                f"or `{name}(metric=..., mode=...)`."
            )


class FIFOScheduler(TrialScheduler):
    """Runs every trial to its end (the default)."""


class _Bracket:
    """One ASHA bracket: the rungs and the scores recorded at each."""

    def __init__(self, min_t: float, max_t: float, reduction_factor: float, s: int) -> None:
        self.rf = reduction_factor
        count = int(math.log(max_t / min_t, reduction_factor) - s + 1)
        self.rungs: list[tuple[float, dict[str, float]]] = [
            (min_t * reduction_factor ** (k + s), {}) for k in reversed(range(max(count, 0)))
        ]

    def cutoff(self, recorded: dict[str, float]) -> float | None:
        if not recorded:
            return None
        return float(np.nanpercentile(list(recorded.values()), (1 - 1 / self.rf) * 100))

    def on_result(self, trial_id: str, t: float, score: float) -> bool:
        """Whether the trial should stop; records its score at the highest rung it reached."""
        for milestone, recorded in self.rungs:
            if t < milestone or trial_id in recorded:
                continue
            cutoff = self.cutoff(recorded)
            recorded[trial_id] = score
            return cutoff is not None and score < cutoff
        return False


class AsyncHyperBandScheduler(TrialScheduler):
    """Asynchronous successive halving (ASHA), as Ray's ``ASHAScheduler``.

    At each rung (``grace_period``, ``grace_period * reduction_factor``, ... up to ``max_t``
    in units of ``time_attr``) a trial goes on only if its metric is in the top
    ``1 / reduction_factor`` of the trials that reached that rung before it.

    Args:
        time_attr: The result field counting progress (``"training_iteration"``: reports).
        metric: The metric to compare (default: ``TuneConfig.metric``).
        mode: ``"min"`` or ``"max"`` (default: ``TuneConfig.mode``).
        max_t: Trials are stopped when ``time_attr`` reaches it.
        grace_period: No trial is stopped before ``time_attr`` reaches it.
        reduction_factor: How much each rung thins the trials out.
        brackets: Number of brackets (trials are spread over them).
        stop_last_trials: Stop trials that reach ``max_t`` (as Ray).

    Example:
        >>> scheduler = ASHAScheduler(max_t=10, grace_period=1, reduction_factor=2)
        >>> Tuner(trainer, tune_config=TuneConfig(metric="loss", mode="min", scheduler=scheduler))
    """

    def __init__(
        self,
        time_attr: str = "training_iteration",
        metric: str | None = None,
        mode: str | None = None,
        max_t: float = 100,
        grace_period: float = 1,
        reduction_factor: float = 4,
        brackets: int = 1,
        stop_last_trials: bool = True,
    ) -> None:
        super().__init__(metric, mode)
        if grace_period <= 0 or max_t < grace_period:
            raise ValueError(f"ASHA needs 0 < grace_period <= max_t, got grace_period={grace_period}, max_t={max_t}.")
        if reduction_factor <= 1:
            raise ValueError(f"`reduction_factor` must be > 1, got {reduction_factor}.")
        if brackets < 1:
            raise ValueError(f"`brackets` must be >= 1, got {brackets}.")
        self.time_attr = time_attr
        self.max_t = max_t
        self.stop_last_trials = stop_last_trials
        self._brackets = [_Bracket(grace_period, max_t, reduction_factor, s) for s in range(brackets)]
        self._trial_bracket: dict[str, _Bracket] = {}
        self._added = 0

    def on_trial_add(self, trial_id: str) -> None:
        self._require(type(self).__name__)
        # Round-robin is enough for the few brackets ASHA is used with.
        self._trial_bracket[trial_id] = self._brackets[self._added % len(self._brackets)]
        self._added += 1

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> str:
        t = result.get(self.time_attr)
        if t is None:
            return self.CONTINUE
        if self.stop_last_trials and t >= self.max_t:
            return self.STOP
        score = self._score(result)
        bracket = self._trial_bracket.get(trial_id)
        if score is None or bracket is None:
            return self.CONTINUE
        return self.STOP if bracket.on_result(trial_id, t, score) else self.CONTINUE

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None) -> None:
        bracket = self._trial_bracket.pop(trial_id, None)
        t = (result or {}).get(self.time_attr)
        score = self._score(result) if result else None
        if bracket is not None and t is not None and score is not None:
            bracket.on_result(trial_id, t, score)


ASHAScheduler = AsyncHyperBandScheduler


class MedianStoppingRule(TrialScheduler):
    """Stop a trial whose best result so far is worse than the median of the other trials'
    running averages at the same point (Ray's ``MedianStoppingRule``).

    Args:
        time_attr: The result field counting progress.
        metric: The metric to compare (default: ``TuneConfig.metric``).
        mode: ``"min"`` or ``"max"`` (default: ``TuneConfig.mode``).
        grace_period: No trial is stopped before ``time_attr`` reaches it.
        min_samples_required: Other trials needed before any comparison.
        min_time_slice: Accepted for compatibility with Ray.
        hard_stop: Accepted for compatibility with Ray (trials are always stopped, not paused).
    """

    def __init__(
        self,
        time_attr: str = "time_total_s",
        metric: str | None = None,
        mode: str | None = None,
        grace_period: float = 60.0,
        min_samples_required: int = 3,
        min_time_slice: float = 0,
        hard_stop: bool = True,
    ) -> None:
        super().__init__(metric, mode)
        self.time_attr = time_attr
        self.grace_period = grace_period
        self.min_samples_required = min_samples_required
        self._history: dict[str, list[tuple[float, float]]] = {}

    def on_trial_add(self, trial_id: str) -> None:
        self._require(type(self).__name__)
        self._history[trial_id] = []

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> str:
        t, score = result.get(self.time_attr), self._score(result)
        if t is None or score is None:
            return self.CONTINUE
        own = self._history.setdefault(trial_id, [])
        own.append((float(t), score))
        if t < self.grace_period:
            return self.CONTINUE
        averages = []
        for other, points in self._history.items():
            upto = [s for when, s in points if when <= t]
            if other != trial_id and upto:
                averages.append(sum(upto) / len(upto))
        if len(averages) < self.min_samples_required:
            return self.CONTINUE
        best = max(s for _, s in own)
        return self.STOP if best < float(np.median(averages)) else self.CONTINUE
