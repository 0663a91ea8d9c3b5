"""``ReportCheckpointCallback``: Keras reports metrics and checkpoints to ddptrain (Ray's
``ray.train.tensorflow.keras``).

Importing this module imports the workers' Keras (``tf-keras``, see
:class:`~ddptrain.tensorflow.TensorflowConfig`); import it inside the training function or
after ``ddptrain.tensorflow``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

import ddptrain
from ddptrain.errors import ConfigError
from ddptrain.tensorflow._keras import keras_module
from ddptrain.tensorflow.tensorflow_checkpoint import TensorflowCheckpoint

__all__ = ["ReportCheckpointCallback"]

_keras = keras_module()

# Keras hooks, less the ``on_``; those in the first group get an epoch or batch index first.
_INDEXED = (
    "epoch_begin",
    "epoch_end",
    "train_batch_begin",
    "train_batch_end",
    "test_batch_begin",
    "test_batch_end",
    "predict_batch_begin",
    "predict_batch_end",
)
_WHOLE = ("train_begin", "train_end", "test_begin", "test_end", "predict_begin", "predict_end")
_ALLOWED = _INDEXED + _WHOLE

Metrics = str | list[str] | dict[str, str] | None


def _triggers(name: str, value: str | list[str]) -> list[str]:
    triggers = [value] if isinstance(value, str) else list(value)
    bad = [t for t in triggers if t not in _ALLOWED]
    if bad or not triggers:
        raise ConfigError(
            f"`{name}` must be one or more Keras hooks less the `on_`, got {value!r}. "
            f"Choose from: {', '.join(_ALLOWED)}."
        )
    return triggers


def _plain(value: Any) -> Any:
    """A Keras log value as a Python number where it is one (tensors and numpy scalars)."""
    if hasattr(value, "numpy"):
        value = value.numpy()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, np.generic):
        return value.item()
    return value


class ReportCheckpointCallback(_keras.callbacks.Callback):  # type: ignore[name-defined]
    """Report Keras logs, and checkpoints of the model, with :func:`ddptrain.report`.

    Every worker must use it with the same settings (``report`` is called the same number of
    times on every worker). Metrics are the Keras logs of each worker (rank 0's become the
    run's metrics); under ``MultiWorkerMirroredStrategy`` the training metrics are already
    averaged over the workers. A checkpoint is a :class:`~ddptrain.tensorflow.TensorflowCheckpoint`
    (``model.keras``: architecture, weights and optimizer state): every worker saves the model
    (saving may involve the strategy's collectives), rank 0's copy is persisted. Metrics are
    always reported with a checkpoint, even on a hook that is not in ``report_metrics_on``.

    Args:
        checkpoint_on: When to checkpoint: a Keras hook less the ``on_`` (``"epoch_end"``,
            ``"train_end"``, ``"train_batch_end"``...), or a list of them.
        report_metrics_on: When to report metrics, in the same terms.
        metrics: ``None`` reports all Keras logs; a name or list of names reports those logs;
            a dict ``{reported_name: keras_log_name}`` renames them.

    Example:
        >>> model.fit(data, epochs=3, callbacks=[ReportCheckpointCallback(metrics={"loss": "loss"})])
    """

    def __init__(
        self,
        checkpoint_on: str | list[str] = "epoch_end",
        report_metrics_on: str | list[str] = "epoch_end",
        metrics: Metrics = None,
    ) -> None:
        super().__init__()
        if metrics is not None and not isinstance(metrics, (str, list, dict)):
            raise ConfigError(f"`metrics` must be None, a log name, a list or a dict of names, got {metrics!r}.")
        self._checkpoint_on = _triggers("checkpoint_on", checkpoint_on)
        self._report_metrics_on = _triggers("report_metrics_on", report_metrics_on)
        self._metrics = metrics
        # Only the hooks in use are overridden: Keras syncs every batch's logs to the host for a
        # callback that implements batch hooks.
        for when in dict.fromkeys(self._checkpoint_on + self._report_metrics_on):
            setattr(self, f"on_{when}", self._hook(when))

    def _hook(self, when: str) -> Callable[..., None]:
        if when in _INDEXED:

            def indexed(index: int, logs: Mapping[str, Any] | None = None) -> None:
                self._handle(logs, when)

            return indexed

        def whole(logs: Mapping[str, Any] | None = None) -> None:
            self._handle(logs, when)

        return whole

    def _get_reported_metrics(self, logs: Mapping[str, Any] | None) -> dict[str, Any]:
        logs = dict(logs or {})
        if self._metrics is None:
            chosen = logs
        else:
            wanted = self._metrics
            if isinstance(wanted, str):
                wanted = [wanted]
            names = {name: name for name in wanted} if isinstance(wanted, list) else wanted
            missing = [log for log in names.values() if log not in logs]
            if missing:
                raise KeyError(
                    f"ReportCheckpointCallback: Keras logged no {', '.join(map(repr, missing))}; "
                    f"it logged {sorted(logs)}. Fix `metrics=`."
                )
            chosen = {key: logs[log] for key, log in names.items()}
        return {key: _plain(value) for key, value in chosen.items()}

    def _handle(self, logs: Mapping[str, Any] | None, when: str) -> None:
        metrics = self._get_reported_metrics(logs)
        if when not in self._checkpoint_on:
            ddptrain.report(metrics)
            return
        checkpoint = TensorflowCheckpoint.from_model(self.model)
        try:
            first = ddptrain.get_context().get_world_rank() == 0
            ddptrain.report(metrics, checkpoint=checkpoint if first else None)
        finally:
            shutil.rmtree(checkpoint.path, ignore_errors=True)
