"""``TensorflowTrainer``: a DataParallelTrainer whose workers form a TensorFlow cluster."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.config import DataConfig, RunConfig, ScalingConfig
from ddptrain.data_parallel_trainer import DataParallelTrainer
from ddptrain.errors import ConfigError
from ddptrain.tensorflow.config import LEGACY_KERAS_VAR, TensorflowConfig, _missing_packages

__all__ = ["TensorflowTrainer"]


def _with_legacy_keras(run_config: RunConfig | None) -> RunConfig:
    """A copy of ``run_config`` whose workers start with ``TF_USE_LEGACY_KERAS=1`` (unless it
    sets the variable): set from the process's start, it is there before the training
    function is unpickled, which may import TensorFlow."""
    run_config = copy.copy(run_config) if run_config is not None else RunConfig()
    runtime_env = dict(run_config.worker_runtime_env or {})
    env_vars = runtime_env.get("env_vars")
    if env_vars is not None and not isinstance(env_vars, dict):
        return run_config  # the trainer's validation names the problem
    runtime_env["env_vars"] = {LEGACY_KERAS_VAR: "1", **(env_vars or {})}
    run_config.worker_runtime_env = runtime_env
    return run_config


class TensorflowTrainer(DataParallelTrainer):
    """Data-parallel TensorFlow training (Ray's ``TensorflowTrainer``).

    Each worker gets ``TF_CONFIG`` for ``tf.distribute.MultiWorkerMirroredStrategy`` and
    ``TF_USE_LEGACY_KERAS=1`` (see :class:`TensorflowConfig`); the training function creates
    the strategy and builds the model in its scope. Feed Keras from this worker's dataset
    shard with ``ddptrain.get_dataset_shard("train").to_tf(...)``, and report with
    :class:`ddptrain.tensorflow.keras.ReportCheckpointCallback`. The driver does not import
    TensorFlow.

    Args:
        train_loop_per_worker: The training function (no argument, or the config dict).
        train_loop_config: Passed to the training function.
        tensorflow_config: Cluster settings (default: a free port per worker).
        scaling_config: Number of workers.
        run_config: Name, storage and policies of the run.
        datasets: Named datasets for ``get_dataset_shard``.
        dataset_config: Which datasets are split.
        resume_from_checkpoint: A checkpoint the run starts from.
        metadata: Not supported (as in Ray Train V2).

    Raises:
        ImportError: TensorFlow or tf-keras cannot be imported here (naming ``ddptrain[tensorflow]``),
            even when the training function would not import them.

    Example:
        >>> def train_func(config):
        ...     import tensorflow as tf
        ...     from ddptrain.tensorflow.keras import ReportCheckpointCallback
        ...     strategy = tf.distribute.MultiWorkerMirroredStrategy()
        ...     with strategy.scope():
        ...         model = build_model()
        ...     data = ddptrain.get_dataset_shard("train").to_tf("x", "y", batch_size=32)
        ...     model.fit(data, epochs=config["epochs"], callbacks=[ReportCheckpointCallback()])
        >>> trainer = TensorflowTrainer(train_func, train_loop_config={"epochs": 3},
        ...                             scaling_config=ScalingConfig(num_workers=2),
        ...                             datasets={"train": dataset})
        >>> result = trainer.fit()
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        tensorflow_config: TensorflowConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        missing = _missing_packages()  # checked here too: the function may never import TensorFlow
        if missing:
            raise ImportError(
                f"TensorflowTrainer needs {' and '.join(missing)}, which this Python cannot import: "
                "`pip install ddptrain[tensorflow]` (TensorFlow with tf-keras)."
            )
        tensorflow_config = tensorflow_config if tensorflow_config is not None else TensorflowConfig()
        if not isinstance(tensorflow_config, TensorflowConfig):
            raise ConfigError(
                f"`tensorflow_config` must be a ddptrain.tensorflow.TensorflowConfig, got {tensorflow_config!r}."
            )
        if run_config is not None and not isinstance(run_config, RunConfig):
            raise ConfigError(f"`run_config` must be a ddptrain.RunConfig, got {run_config!r}.")
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=tensorflow_config,
            scaling_config=scaling_config,
            run_config=_with_legacy_keras(run_config),
            datasets=datasets,
            dataset_config=dataset_config,
            resume_from_checkpoint=resume_from_checkpoint,
            metadata=metadata,
        )
