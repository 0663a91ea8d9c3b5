"""``Result``: what ``fit()`` returns, also rebuilt from a run directory (driver side)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.checkpoint_manager import CheckpointManager

__all__ = ["Result", "read_metrics", "read_metric_lines"]

METRICS_FILE = "metrics.jsonl"


def _lookup(metrics: dict[str, Any], metric: str) -> Any:
    if metric in metrics:
        return metrics[metric]
    value: Any = metrics
    for part in metric.split("/"):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(metric)
        value = value[part]
    return value


@dataclass
class Result:
    """The outcome of a training run.

    Attributes:
        metrics: Rank 0's metrics of the last ``report()`` (every report is kept, see
            ``metrics_history``).
        checkpoint: The latest committed checkpoint, or ``None``.
        error: The error the run failed with (``fit()`` raises it; set on results rebuilt
            with :meth:`from_path` never).
        path: The run directory (``None`` in local mode).
        metrics_history: Rank 0's metrics of every report, oldest first.
        best_checkpoints: The ``CheckpointConfig.num_to_keep`` best checkpoints (all kept
            ones without ``num_to_keep``) with their metrics, worst first and best last by
            the score (oldest first without a score attribute). As in Ray Train, the latest
            checkpoint is kept on disk even when it is not among them, and then not listed.
        return_value: Rank 0's return value of the training function.
        return_values: Every rank's return value, by rank.
    """

    metrics: dict[str, Any] | None
    checkpoint: Checkpoint | None
    error: BaseException | None = None
    path: str | None = None
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    return_value: Any = None
    return_values: list[Any] = field(default_factory=list)

    @property
    def metrics_dataframe(self) -> Any:
        """Every report's metrics as a ``pandas.DataFrame`` (needs pandas)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError(
                "`Result.metrics_dataframe` needs pandas: `pip install pandas`. "
                "`Result.metrics_history` has the same data as a list of dicts."
            ) from None
        return pd.DataFrame(self.metrics_history)

    @property
    def filesystem(self) -> None:
        """Always ``None``: results live on the local file system."""
        return None

    def get_best_checkpoint(self, metric: str, mode: str) -> Checkpoint | None:
        """The kept checkpoint with the best ``metric`` (``"a/b"`` reaches nested dicts).

        Args:
            metric: Metric name.
            mode: ``"max"`` or ``"min"``.

        Raises:
            ValueError: ``mode`` is not ``"max"`` or ``"min"``.
            RuntimeError: No checkpoint was reported, or none has ``metric``.
        """
        if mode not in ("max", "min"):
            raise ValueError(f"`mode` must be 'max' or 'min', got {mode!r}.")
        if not self.best_checkpoints:
            raise RuntimeError("No checkpoint was reported in this run.")
        scored = []
        for checkpoint, metrics in self.best_checkpoints:
            try:
                scored.append((_lookup(metrics, metric), checkpoint))
            except KeyError:
                continue
        if not scored:
            raise RuntimeError(f"No checkpoint of this run has the metric {metric!r}.")
        pick = max if mode == "max" else min
        return pick(scored, key=lambda item: item[0])[1]

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> Result:
        """Rebuild the result of a finished, failed or interrupted run from its directory.

        Raises:
            RuntimeError: ``path`` is not a ddptrain run directory, or its checkpoint index
                cannot be read.
        """

        run_dir = os.path.abspath(os.path.expanduser(os.fspath(path)))
        if not os.path.exists(os.path.join(run_dir, "run.json")):
            raise RuntimeError(f"{run_dir} is not a ddptrain run directory (it has no run.json).")
        history = read_metrics(run_dir)
        manager = CheckpointManager.from_run_dir(run_dir)
        return cls(
            metrics=history[-1] if history else None,
            checkpoint=manager.latest,
            path=run_dir,
            metrics_history=history,
            best_checkpoints=manager.best_checkpoints(),
        )


def read_metric_lines(run_dir: str) -> list[dict[str, Any]]:
    """Every line of ``run_dir/metrics.jsonl`` (``{"time", "attempt", "metrics"}``), oldest first.

    A line cut short by a crash is skipped.
    """
    lines: list[dict[str, Any]] = []
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(path):
        return lines
    with open(path) as f:
        for text in f:
            text = text.strip()
            if not text:
                continue
            try:
                line = json.loads(text)
                line["metrics"]  # noqa: B018 (a line without metrics is a cut one)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash
            lines.append(line)
    return lines


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """Rank 0's metrics of every report in ``run_dir/metrics.jsonl``, oldest first.

    A line cut short by a crash is skipped.
    """
    return [line["metrics"] for line in read_metric_lines(run_dir)]
