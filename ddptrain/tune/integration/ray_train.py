"""``TuneReportCallback``: forward a training run's reports to the sweep (Ray V2's pattern).

Use it in a function trainable that builds and fits a ddptrain trainer::

    def trial(config):
        trainer = TorchTrainer(train_func, train_loop_config=config,
                               run_config=RunConfig(callbacks=[TuneReportCallback()], ...))
        trainer.fit()

Rank 0's metrics of every report become one report of the trial; a checkpoint's path is
added as ``metrics["checkpoint_path"]``, as Ray does. When the sweep stops the trial (a
scheduler, ``stop=``), the callback raises in the trainer's driver loop, which tears the
worker group down at once.
"""

from __future__ import annotations

import logging
from typing import Any

from ddptrain.callbacks import TrainRunContext, UserCallback
from ddptrain.checkpoint import Checkpoint
from ddptrain.tune import session as _session

__all__ = ["TuneReportCallback"]

_logger = logging.getLogger(__name__)


class TuneReportCallback(UserCallback):
    """A :class:`~ddptrain.UserCallback` reporting rank 0's metrics of each report to the sweep.

    Args:
        metrics: Metric names to forward (default: all), or a dict renaming them
            (``{"sweep_name": "train_name"}``).
        add_checkpoint_path: Add ``checkpoint_path`` to the metrics of reports with a checkpoint.
    """

    def __init__(
        self, metrics: str | list[str] | dict[str, str] | None = None, add_checkpoint_path: bool = True
    ) -> None:
        if isinstance(metrics, str):
            metrics = [metrics]
        self._metrics = metrics
        self._add_path = add_checkpoint_path
        self._warned = False

    def _select(self, metrics: dict[str, Any]) -> dict[str, Any]:
        if self._metrics is None:
            return dict(metrics)
        if isinstance(self._metrics, dict):
            return {new: metrics[old] for new, old in self._metrics.items() if old in metrics}
        return {name: metrics[name] for name in self._metrics if name in metrics}

    def after_report(
        self,
        run_context: TrainRunContext,
        metrics: list[dict[str, Any]],
        checkpoint: Checkpoint | None,
    ) -> None:
        session = _session._get_session()
        if session is None:
            if not self._warned:
                _logger.warning("ddptrain: TuneReportCallback is used outside a sweep trial; reports are not forwarded")
                self._warned = True
            return
        forwarded = self._select(metrics[0] if metrics else {})
        if checkpoint is not None and self._add_path:
            forwarded["checkpoint_path"] = checkpoint.path
        session.report(forwarded, checkpoint, persisted=True)
