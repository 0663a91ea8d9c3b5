"""``Result``: what ``fit()`` returns, also rebuilt from a run directory (driver side)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.storage import metrics as run_metrics
from ddptrain.storage import remote
from ddptrain.storage.checkpoint_manager import CheckpointManager
from ddptrain.storage.layout import RunLayout
from ddptrain.storage.remote_checkpoints import RemoteCheckpointManager

__all__ = ["Result", "read_metrics", "read_metric_lines"]


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
                scored.append((_lookup(metrics, metric), checkpoint))
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
        text = os.fspath(path)
        root = remote.resolve(text, storage_filesystem)
        if root is not None:
            return cls._from_remote(root)
        run_dir = os.path.abspath(os.path.expanduser(text.removeprefix("file://")))
        if not RunLayout(run_dir).run_json.exists():
            raise RuntimeError(f"{run_dir} is not a ddptrain run directory (it has no {RunLayout.RUN_JSON}).")
        history = read_metrics(run_dir)
        manager = CheckpointManager.from_run_dir(run_dir)
        return cls(
            metrics=history[-1] if history else None,
            checkpoint=manager.latest,
            path=run_dir,
            metrics_history=history,
            best_checkpoints=manager.best_checkpoints(),
        )

    @classmethod
    def _from_remote(cls, root: remote.RemoteRoot) -> Result:
        with tempfile.TemporaryDirectory(prefix="ddptrain_result_") as local:
            if not root.pull_run(root.root, local):
                raise RuntimeError(
                    f"{root.display()} is not a ddptrain run directory (it has no {RunLayout.RUN_JSON})."
                )
            history = read_metrics(local)
            manager = RemoteCheckpointManager.from_copy(local, root, root.root)
        return cls(
            metrics=history[-1] if history else None,
            checkpoint=manager.latest,
            path=root.display(),
            metrics_history=history,
            best_checkpoints=manager.best_checkpoints(),
            _storage_filesystem=root.fs,
        )


def read_metric_lines(run_dir: str) -> list[dict[str, Any]]:
    """Every line of ``run_dir/metrics.jsonl`` (``{"time", "attempt", "metrics"}``), oldest first.

    A line cut short by a crash is skipped.

    Raises:
        RunFileError: ``metrics.jsonl`` is not a regular file of the run folder (a link, a FIFO...).
    """
    return list(run_metrics.iter_metric_lines(run_dir))


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """Rank 0's metrics of every report in ``run_dir/metrics.jsonl``, oldest first.

    A line cut short by a crash is skipped.
    """
    return [line["metrics"] for line in read_metric_lines(run_dir)]
