"""``RayTrainReportCallback`` for ``lightgbm.train``: report each round, checkpoint the booster."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightgbm

from ddptrain import _gbdt
from ddptrain.checkpoint import Checkpoint

__all__ = ["RayTrainReportCallback"]


class RayTrainReportCallback:
    """Reports LightGBM's eval metrics after every round and checkpoints the booster (Ray
    Train's ``ray.train.lightgbm.RayTrainReportCallback``).

    Every worker reports every round (as ``ddptrain.report`` requires); rank 0 adds the
    checkpoint, a folder holding the booster as ``filename`` (LightGBM's text format).
    Metrics are flattened to ``"<valid name>-<metric>"`` (e.g. ``"valid-binary_logloss"``).
    LightGBM evaluates each worker's own rows only: give every worker the whole validation set
    (``DataConfig(datasets_to_split=["train"])``) for metrics that cover it.

    Args:
        metrics: Metrics to report: ``None`` for all; a name or a list of names; or a dict
            ``{reported name: LightGBM key}`` to rename them.
        filename: The booster's file in the checkpoint.
        frequency: Checkpoint every ``frequency`` rounds (counted from 1 over the whole
            model, resumed rounds included); 0: no periodic checkpoints.
        checkpoint_at_end: Also checkpoint the last round of ``num_boost_round``. LightGBM
            ends an early-stopped run from inside its own callback, after this one ran, so
            with early stopping use ``frequency`` (as in Ray).
        results_postprocessing_fn: Turns the metrics dict into the one reported.

    Example:
        >>> booster = lightgbm.train(params, train_set, valid_sets=[valid_set], valid_names=["valid"],
        ...                          callbacks=[RayTrainReportCallback(frequency=10)])
        >>> # on the driver, after fit():
        >>> booster = RayTrainReportCallback.get_model(result.checkpoint)
    """

    CHECKPOINT_NAME = "model.txt"

    def __init__(
        self,
        metrics: str | list[str] | dict[str, str] | None = None,
        filename: str = CHECKPOINT_NAME,
        frequency: int = 0,
        checkpoint_at_end: bool = True,
        results_postprocessing_fn: Callable[[dict[str, float]], dict[str, float]] | None = None,
    ) -> None:
        self._metrics = _gbdt.metrics_arg(metrics)
        self._filename = filename
        self._frequency = _gbdt.check_frequency(frequency)
        self._checkpoint_at_end = checkpoint_at_end
        self._postprocess = results_postprocessing_fn

    @classmethod
    def get_model(cls, checkpoint: Checkpoint, filename: str = CHECKPOINT_NAME) -> lightgbm.Booster:
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
                    f"No LightGBM model {filename!r} in checkpoint {checkpoint.path}: it holds {found}. "
                    "Pass the `filename` the callback was given."
                )
            return lightgbm.Booster(model_file=str(path))

    def __call__(self, env: Any) -> None:
        """Report round ``env.iteration`` (LightGBM calls this after every round)."""
        results: dict[str, float] = {}
        for entry in env.evaluation_result_list or []:
            data_name, metric_name, value = entry[0], entry[1], entry[2]
            if len(entry) > 4:  # lightgbm.cv: (name, metric, mean, higher_better, stdv)
                results[f"{data_name}-{metric_name}-mean"] = float(value)
                results[f"{data_name}-{metric_name}-stdv"] = float(entry[4])
            else:
                results[f"{data_name}-{metric_name}"] = float(value)
        metrics = _gbdt.select_metrics(results, self._metrics)
        if self._postprocess is not None:
            metrics = self._postprocess(metrics)
        last = env.iteration == env.end_iteration - 1
        checkpoint = (self._checkpoint_at_end and last) or (
            self._frequency > 0 and (env.iteration + 1) % self._frequency == 0
        )
        model = env.model

        def save(folder: str) -> None:
            model.save_model(str(Path(folder, self._filename)))

        _gbdt.report_round(metrics, save if checkpoint else None)
