"""``BaseTrainer``: what every trainer is (Ray 2.x's ``ray.train.base_trainer.BaseTrainer``).

It holds no training logic: ``DataParallelTrainer`` (and so ``TorchTrainer`` and every other
trainer) implements it. Sweeps (``ddptrain.tune``) accept any ``BaseTrainer``, and use only what
is declared here, so they need not import the trainers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddptrain.config import RunConfig, ScalingConfig
    from ddptrain.result import Result

__all__ = ["BaseTrainer", "PREPROCESSOR_DEPRECATION_MESSAGE"]

# Ray 2.x's text, word for word (ray.train.base_trainer), raised for `preprocessor=`.
PREPROCESSOR_DEPRECATION_MESSAGE = (
    "The `preprocessor` argument to Trainers is deprecated as of Ray 2.7. "
    "Instead, use the Preprocessor `fit` and `transform` APIs directly on the Ray "
    "Dataset. For any state that needs to be saved to the trained checkpoint, pass it "
    "in using the `metadata` argument of the `Trainer`. "
    "For a full example, see "
    "https://docs.ray.io/en/master/train/user-guides/data-loading-preprocessing.html#preprocessing-structured-data "
)


class BaseTrainer:
    """The base class of ddptrain's trainers.

    To write a trainer, subclass :class:`~ddptrain.DataParallelTrainer` (or ``TorchTrainer``):
    it starts the workers and runs a function on each. A direct subclass of ``BaseTrainer``
    must set the attributes below and implement :meth:`fit`.

    Attributes:
        scaling_config: How many workers, and their resources.
        run_config: Name, storage, failure and checkpoint settings of the run.
        train_loop_config: The config a sweep's trial overrides (``None``: none).
        datasets: The datasets, by name, to shard between the workers.
    """

    scaling_config: ScalingConfig
    run_config: RunConfig
    train_loop_config: dict[str, Any] | None
    datasets: dict[str, Any]

    def fit(self) -> Result:
        """Run the training; the run's :class:`~ddptrain.Result`."""
        raise NotImplementedError(f"{type(self).__name__} must implement fit()")
