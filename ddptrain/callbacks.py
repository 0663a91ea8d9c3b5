"""``UserCallback``: hooks that run in the driver when workers report or fail."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddptrain.checkpoint import Checkpoint
    from ddptrain.config import DataConfig, RunConfig, ScalingConfig

__all__ = ["UserCallback", "TrainRunContext"]


@dataclass(frozen=True)
class TrainRunContext:
    """The run a callback is called for.

    Attributes:
        run_id: Unique id of this ``fit()`` call.
        run_config: The run's :class:`~ddptrain.RunConfig`.
        train_loop_config: The config passed to the training function.
        scaling_config: The run's :class:`~ddptrain.ScalingConfig`.
        backend_config: The backend's config.
        dataset_config: The :class:`~ddptrain.DataConfig`.
    """

    run_id: str
    run_config: RunConfig
    train_loop_config: dict[str, Any] | None
    scaling_config: ScalingConfig
    backend_config: Any
    dataset_config: DataConfig

    def get_run_config(self) -> RunConfig:
        """The run's :class:`~ddptrain.RunConfig`."""
        return self.run_config


class UserCallback:
    """Subclass and pass in ``RunConfig(callbacks=[...])``. Hooks run in the driver process.

    An exception raised by a hook fails the run.
    """

    def after_report(
        self,
        run_context: TrainRunContext,
        metrics: list[dict[str, Any]],
        checkpoint: Checkpoint | None,
    ) -> None:
        """Called once every rank made a report: ``metrics[i]`` is rank ``i``'s metrics."""

    def after_exception(self, run_context: TrainRunContext, worker_exceptions: dict[int, Exception]) -> None:
        """Called when workers failed: world rank to the exception."""
