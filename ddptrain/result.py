"""``Result``: what ``fit()`` returns, also rebuilt from a run directory (driver side)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ddptrain.checkpoint import Checkpoint

__all__ = ["Result"]

METRICS_FILE = "metrics.jsonl"
CHECKPOINT_INDEX = "checkpoints.json"


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
        best_checkpoints: Kept checkpoints with their metrics, best last by the
            ``CheckpointConfig`` score (oldest first without a score attribute).
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
            RuntimeError: ``path`` is not a ddptrain run directory.
        """
        run_dir = os.path.abspath(os.path.expanduser(os.fspath(path)))
        metrics_file = os.path.join(run_dir, METRICS_FILE)
        index_file = os.path.join(run_dir, CHECKPOINT_INDEX)
        if not os.path.isdir(run_dir) or not (
            os.path.exists(metrics_file)
            or os.path.exists(index_file)
            or os.path.exists(os.path.join(run_dir, "run.json"))
        ):
            raise RuntimeError(f"{run_dir} is not a ddptrain run directory (no run.json or metrics.jsonl).")
        history: list[dict[str, Any]] = []
        if os.path.exists(metrics_file):
            with open(metrics_file) as f:
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        history.append(json.loads(line)["metrics"])
                    except (ValueError, KeyError):
                        break  # a line cut short by a crash ends the history
        kept: list[tuple[Checkpoint, dict[str, Any]]] = []
        latest = None
        if os.path.exists(index_file):
            with open(index_file) as f:
                index = json.load(f)
            for entry in index.get("checkpoints", []):
                kept.append((Checkpoint(os.path.join(run_dir, entry["dir_name"])), entry.get("metrics", {})))
            if index.get("latest"):
                latest = Checkpoint(os.path.join(run_dir, index["latest"]))
        return cls(
            metrics=history[-1] if history else None,
            checkpoint=latest,
            path=run_dir,
            metrics_history=history,
            best_checkpoints=kept,
        )
