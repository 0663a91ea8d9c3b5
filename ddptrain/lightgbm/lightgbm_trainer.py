"""``LightGBMTrainer``: a DataParallelTrainer whose workers form one LightGBM network."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.config import DataConfig, RunConfig, ScalingConfig
from ddptrain.data_parallel_trainer import DataParallelTrainer
from ddptrain.errors import ConfigError
from ddptrain.lightgbm.config import LightGBMConfig

__all__ = ["LightGBMTrainer"]


class LightGBMTrainer(DataParallelTrainer):
    """Data-parallel LightGBM (Ray Train V2's ``LightGBMTrainer``): every worker runs
    ``train_loop_per_worker`` with LightGBM's network set up, so ``lightgbm.train`` with
    :func:`~ddptrain.lightgbm.get_network_params` in its parameters builds one model from all
    workers' rows.

    LightGBM does not combine eval metrics across workers: pass the validation set unsplit,
    ``dataset_config=DataConfig(datasets_to_split=["train"])``, so that every worker (rank 0's
    metrics are the run's) evaluates all of it.

    Args:
        train_loop_per_worker: The training function (no argument, or the config dict).
        train_loop_config: Passed to the training function.
        lightgbm_config: Ports and tree learner (default ``LightGBMConfig()``).
        scaling_config: Number of workers and hosts (LightGBM threads per worker follow
            ``OMP_NUM_THREADS``, 1 unless set, or ``num_threads`` in the params).
        run_config: Name, storage and policies of the run.
        datasets: Named datasets for ``get_dataset_shard``.
        dataset_config: Which datasets are split (default: all).
        resume_from_checkpoint: A checkpoint the run starts from (``get_checkpoint()``).
        metadata: Not supported (as in Ray Train V2).

    Example:
        >>> def train_fn(config):
        ...     df = ddptrain.get_dataset_shard("train").materialize().to_pandas()
        ...     train_set = lightgbm.Dataset(df.drop(columns="y"), label=df["y"])
        ...     params = {**config, **ddptrain.lightgbm.get_network_params()}
        ...     lightgbm.train(params, train_set, num_boost_round=50,
        ...                    callbacks=[RayTrainReportCallback()])
        >>> result = LightGBMTrainer(train_fn, train_loop_config={"objective": "binary"},
        ...                          datasets={"train": ds},
        ...                          scaling_config=ddptrain.ScalingConfig(num_workers=2)).fit()
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        lightgbm_config: LightGBMConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        lightgbm_config = lightgbm_config if lightgbm_config is not None else LightGBMConfig()
        if not isinstance(lightgbm_config, LightGBMConfig):
            raise ConfigError(f"`lightgbm_config` must be a ddptrain.lightgbm.LightGBMConfig, got {lightgbm_config!r}.")
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=lightgbm_config,
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            resume_from_checkpoint=resume_from_checkpoint,
            metadata=metadata,
        )
