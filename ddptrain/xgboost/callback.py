"""``RayTrainReportCallback`` for ``xgboost.train``: report each round, checkpoint the booster."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import xgboost
from xgboost.callback import TrainingCallback

from ddptrain import _gbdt
from ddptrain.checkpoint import Checkpoint

__all__ = ["RayTrainReportCallback"]


class RayTrainReportCallback(TrainingCallback):
    """Reports XGBoost's eval metrics after every round and checkpoints the booster (Ray Train's
    ``ray.train.xgboost.RayTrainReportCallback``).

    Every worker reports every round (as ``ddptrain.report`` requires); rank 0 adds the
    checkpoint, a folder holding the booster as ``filename``. Metrics are flattened to
    ``"<eval name>-<metric>"`` (e.g. ``"valid-logloss"``); in an ``XGBoostTrainer`` they cover
    the eval rows of all workers, as XGBoost combines them.

    Args:
        metrics: Metrics to report: ``None`` for all; a name or a list of names; or a dict
            ``{reported name: XGBoost key}`` to rename them (``{"loss": "valid-logloss"}``).
        filename: The booster's file in the checkpoint; its suffix picks the format
            (``.ubj`` binary JSON, ``.json``).
        frequency: Checkpoint every ``frequency`` rounds (rounds counted from 1 over the whole
            model, resumed rounds included); 0: no periodic checkpoints.
        checkpoint_at_end: Also checkpoint when training ends (early stopping included),
            unless that round was just checkpointed.
        results_postprocessing_fn: Turns the metrics dict into the one reported (e.g. to
            average ``xgboost.cv`` folds).

    Example:
        >>> booster = xgboost.train(params, dtrain, evals=[(dvalid, "valid")],
        ...                         callbacks=[RayTrainReportCallback(frequency=10)])
        >>> # on the driver, after fit():
        >>> booster = RayTrainReportCallback.get_model(result.checkpoint)
    """

    CHECKPOINT_NAME = "model.ubj"

    def __init__(
        self,
        metrics: str | list[str] | dict[str, str] | None = None,
        filename: str = CHECKPOINT_NAME,
        frequency: int = 0,
        checkpoint_at_end: bool = True,
        results_postprocessing_fn: Callable[[dict[str, float]], dict[str, float]] | None = None,
    ) -> None:
        super().__init__()
        self._metrics = _gbdt.metrics_arg(metrics)
        self._filename = filename
        self._frequency = _gbdt.check_frequency(frequency)
        self._checkpoint_at_end = checkpoint_at_end
        self._postprocess = results_postprocessing_fn
        self._last_results: dict[str, float] = {}
        self._last_checkpoint_round: int | None = None

    @classmethod
    def get_model(cls, checkpoint: Checkpoint, filename: str = CHECKPOINT_NAME) -> xgboost.Booster:
        """The booster saved in ``checkpoint`` by this callback.

        Args:
            checkpoint: A checkpoint reported by this callback (e.g. ``result.checkpoint``).
            filename: The callback's ``filename``.
        """
        with checkpoint.as_directory() as folder:
            path = Path(folder, filename)
            if not path.is_file():
                found = sorted(p.name for p in Path(folder).iterdir())
                raise FileNotFoundError(
                    f"No XGBoost model {filename!r} in checkpoint {checkpoint.path}: it holds {found}. "
                    "Pass the `filename` the callback was given."
                )
            booster = xgboost.Booster()
            booster.load_model(str(path))
            return booster

    def _report(self, model: xgboost.Booster, checkpoint: bool) -> None:
        metrics = _gbdt.select_metrics(self._last_results, self._metrics)
        if self._postprocess is not None:
            metrics = self._postprocess(metrics)

        def save(folder: str) -> None:
            model.save_model(str(Path(folder, self._filename)))

        _gbdt.report_round(metrics, save if checkpoint else None)

    def after_iteration(self, model: xgboost.Booster, epoch: int, evals_log: dict[str, dict[str, Any]]) -> bool:
        """Report round ``epoch`` (0-based, counting resumed rounds); never stops training."""
        self._last_results = {
            f"{data}-{metric}": _last(values)
            for data, per_metric in evals_log.items()
            for metric, values in per_metric.items()
        }
        checkpoint = self._frequency > 0 and (epoch + 1) % self._frequency == 0
        if checkpoint:
            self._last_checkpoint_round = epoch
        self._report(model, checkpoint)
        return False

    def after_training(self, model: xgboost.Booster) -> xgboost.Booster:
        """Checkpoint the final booster (``checkpoint_at_end``)."""
        if self._checkpoint_at_end and self._last_checkpoint_round != model.num_boosted_rounds() - 1:
            self._report(model, True)
        return model


def _last(values: Any) -> float:
    last = values[-1]
    return float(last[0] if isinstance(last, tuple) else last)  # xgboost.cv logs (mean, std)
