"""``Result``: what ``fit()`` returns, also rebuilt from a run directory (driver side)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.storage import remote
from ddptrain.storage.checkpoint_manager import lookup_metric
from ddptrain.storage.read import open_result_run, read_metric_lines, read_metrics

__all__ = ["Result", "read_metrics", "read_metric_lines"]  # the readers: ddptrain.storage.read


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
        metrics_history: Rank 0's metrics of every report, oldest first, as reported (ddptrain
            adds no keys to them, as Ray Train V2).
        report_world_sizes: The world size of each report of ``metrics_history`` (same order):
            an elastic run's attempts may run on fewer or more workers (``metrics.jsonl`` has
            it as each line's ``world_size``).
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
    report_world_sizes: list[int] = field(default_factory=list)
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    return_value: Any = None
    return_values: list[Any] = field(default_factory=list)
    _storage_filesystem: Any = field(default=None, repr=False)

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
    def filesystem(self) -> Any:
        """The file system ``path`` is on: ``None`` for a local run; for remote storage a
        ``pyarrow.fs.FileSystem`` when pyarrow is installed, else the fsspec file system."""
        if self._storage_filesystem is None:
            return None
        return remote.to_pyarrow(self._storage_filesystem, uri_paths=remote.is_uri(self.path or ""))

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
                scored.append((lookup_metric(metrics, metric), checkpoint))
            except KeyError:
                continue
        if not scored:
            raise RuntimeError(f"No checkpoint of this run has the metric {metric!r}.")
        pick = max if mode == "max" else min
        return pick(scored, key=lambda item: item[0])[1]

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], storage_filesystem: Any = None) -> Result:
        """Rebuild the result of a finished, failed or interrupted run from its directory.

        Args:
            path: The run directory: a local path, a URI (``s3://bucket/prefix/name``), or a
                path on ``storage_filesystem``.
            storage_filesystem: An fsspec or ``pyarrow.fs`` file system ``path`` is on.

        Raises:
            RuntimeError: ``path`` is not a ddptrain run directory, or its checkpoint index
                cannot be read.
        """
        with open_result_run(os.fspath(path), storage_filesystem) as view:
            lines = list(view.metric_lines())
            history = [line["metrics"] for line in lines]
            world_sizes = [int(line.get("world_size", 1)) for line in lines]
            manager = view.checkpoints()
        return cls(
            metrics=history[-1] if history else None,
            checkpoint=manager.latest,
            path=view.shown,
            metrics_history=history,
            report_world_sizes=world_sizes,
            best_checkpoints=manager.best_checkpoints(),
            _storage_filesystem=None if view.remote is None else view.remote.fs,
        )
