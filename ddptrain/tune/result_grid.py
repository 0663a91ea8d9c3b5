"""``ResultGrid``: the results of every trial of a sweep (driver side)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ddptrain.errors import DdpTrainError
from ddptrain.result import Result
from ddptrain.tune.progress import _flatten
from ddptrain.tune.trial import Trial

__all__ = ["ResultGrid", "TuneResult", "TuneError", "best_trial"]


class TuneError(DdpTrainError):
    """A sweep failed (a trial's error re-raised by ``tune.run(raise_on_failed_trial=True)``, or a
    trial's error read back from disk after a restore)."""


@dataclass
class TuneResult(Result):
    """A trial's :class:`~ddptrain.Result`, with its ``config`` (as Ray Tune's ``Result``)."""

    config: dict[str, Any] = field(default_factory=dict)


def _value(result: dict[str, Any], metric: str) -> float | None:
    value = result.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        return None
    return float(value)


def best_trial(trials: list[Trial], metric: str, mode: str, scope: str = "last") -> Trial | None:
    """The trial with the best ``metric``: of its last report (``scope="last"``), or of all its
    reports (``"all"``); ``"last-5-avg"`` and ``"last-10-avg"`` average the last reports."""
    if mode not in ("min", "max"):
        raise ValueError(f"`mode` must be 'min' or 'max', got {mode!r}.")
    if scope not in ("last", "all", "last-5-avg", "last-10-avg", "avg"):
        raise ValueError(f"`scope` must be 'last', 'all', 'avg', 'last-5-avg' or 'last-10-avg', got {scope!r}.")
    scored = []
    for trial in trials:
        if scope == "last":
            values = [_value(trial.last_result, metric)]
        else:
            history = [v for r in trial.read_results() if (v := _value(r, metric)) is not None]
            if not history:
                continue
            if scope == "all":
                values = [max(history) if mode == "max" else min(history)]
            else:
                tail = history if scope == "avg" else history[-int(scope.split("-")[1]) :]
                values = [sum(tail) / len(tail)]
        if values[0] is not None:
            scored.append((values[0], trial))
    if not scored:
        return None
    pick = max if mode == "max" else min
    return pick(scored, key=lambda item: item[0])[1]


def trial_result(trial: Trial) -> TuneResult:
    error = trial.error
    if error is None and trial.status == "ERROR":
        error = TuneError(trial.error_msg or "the trial failed")
    return TuneResult(
        metrics=dict(trial.last_result) if trial.last_result else None,
        checkpoint=trial.checkpoint,
        error=error,
        path=trial.path,
        metrics_history=trial.read_results(),
        best_checkpoints=list(trial.best_checkpoints),
        return_value=trial.return_value,
        return_values=[trial.return_value],
        config=trial.config,
    )


class ResultGrid:
    """The results of a sweep, one :class:`~ddptrain.Result` (with ``config``) per trial, in the
    order the trials were created (the grid's order).

    Example:
        >>> results = tuner.fit()
        >>> best = results.get_best_result(metric="loss", mode="min")
        >>> best.config, best.metrics["loss"], best.checkpoint
    """

    def __init__(self, trials: list[Trial], path: str, metric: str | None = None, mode: str | None = None) -> None:
        self._trials = list(trials)
        self._results = [trial_result(t) for t in self._trials]
        self.experiment_path = path
        self._metric = metric
        self._mode = mode

    def __len__(self) -> int:
        return len(self._results)

    def __getitem__(self, index: int) -> TuneResult:
        return self._results[index]

    def __iter__(self) -> Iterator[TuneResult]:
        return iter(self._results)

    def __repr__(self) -> str:
        return f"ResultGrid<{len(self)} results, {self.num_errors} errors, path={self.experiment_path!r}>"

    @property
    def errors(self) -> list[BaseException]:
        """The errors of the failed trials."""
        return [r.error for r in self._results if r.error is not None]

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    @property
    def num_terminated(self) -> int:
        """Trials that ended without an error (finished, or stopped by a scheduler or ``stop=``)."""
        return sum(1 for t in self._trials if t.status == "TERMINATED")

    def get_best_result(
        self,
        metric: str | None = None,
        mode: str | None = None,
        scope: str = "last",
        filter_nan_and_inf: bool = True,
    ) -> TuneResult:
        """The result of the best trial by ``metric`` (default: ``TuneConfig.metric``/``mode``).

        Args:
            scope: ``"last"``: each trial's last report; ``"all"``: its best report;
                ``"avg"``, ``"last-5-avg"``, ``"last-10-avg"``: averages.

        Raises:
            ValueError: No metric/mode, or no trial reported ``metric``.
        """
        metric, mode = metric or self._metric, mode or self._mode
        if metric is None or mode is None:
            raise ValueError(
                "`get_best_result` needs a metric and a mode: pass them, or set `TuneConfig(metric=..., mode=...)`."
            )
        best = best_trial(self._trials, metric, mode, scope)
        if best is None:
            reported = sorted({key for trial in self._trials for key in (trial.last_result or {})})
            raise ValueError(
                f"No trial reported the metric {metric!r} (as a finite number); the trials' last reports have: "
                f"{', '.join(reported) or 'no metrics'}."
            )
        return self._results[self._trials.index(best)]

    def get_dataframe(self, filter_metric: str | None = None, filter_mode: str | None = None) -> Any:
        """One row per trial: its last report (or, with ``filter_metric``/``filter_mode``, its
        best report by that metric), with ``config/<key>`` columns and ``logdir`` (needs pandas)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("`get_dataframe()` needs pandas: `pip install pandas`.") from None
        rows = []
        for trial in self._trials:
            row = dict(trial.last_result)
            if filter_metric and filter_mode:
                history = [r for r in trial.read_results() if _value(r, filter_metric) is not None]
                if history:
                    values = [_value(r, filter_metric) or 0.0 for r in history]
                    best = values.index(max(values) if filter_mode == "max" else min(values))
                    row = dict(history[best])
            row.update({f"config/{k}": v for k, v in _flatten(trial.config).items()})
            row["trial_id"] = trial.trial_id
            row["logdir"] = trial.path
            rows.append(row)
        return pd.DataFrame(rows)
