"""``XGBoostTrainer``: a DataParallelTrainer whose workers form one XGBoost collective."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.config import DataConfig, RunConfig, ScalingConfig
from ddptrain.data_parallel_trainer import DataParallelTrainer
from ddptrain.errors import ConfigError
from ddptrain.xgboost.config import XGBoostConfig

__all__ = ["XGBoostTrainer"]


class XGBoostTrainer(DataParallelTrainer):
    """Data-parallel XGBoost (Ray Train V2's ``XGBoostTrainer``): every worker runs
    ``train_loop_per_worker`` inside XGBoost's collective, so ``xgboost.train`` on each
    worker's rows builds one model from all of them.

    The training function builds its ``DMatrix`` from its shard
    (``ddptrain.get_dataset_shard("train").materialize().to_pandas()``), calls
    ``xgboost.train`` with :class:`~ddptrain.xgboost.RayTrainReportCallback`, and resumes from
    ``ddptrain.get_checkpoint()`` after a restart. Eval metrics cover the eval rows of all
    workers, split or not.

    Args:
        train_loop_per_worker: The training function (no argument, or the config dict).
        train_loop_config: Passed to the training function.
        xgboost_config: The collective's settings (default ``XGBoostConfig()``).
        scaling_config: Number of workers and hosts (XGBoost threads per worker follow
            ``OMP_NUM_THREADS``, 1 unless set, or ``nthread`` in the params).
        run_config: Name, storage and policies of the run.
        datasets: Named datasets for ``get_dataset_shard``.
        dataset_config: Which datasets are split (default: all).
        resume_from_checkpoint: A checkpoint the run starts from (``get_checkpoint()``).
        metadata: Not supported (as in Ray Train V2).

    Example:
        >>> def train_fn(config):
        ...     df = ddptrain.get_dataset_shard("train").materialize().to_pandas()
        ...     dtrain = xgboost.DMatrix(df.drop(columns="y"), label=df["y"])
        ...     xgboost.train(config["params"], dtrain, num_boost_round=50,
        ...                   evals=[(dtrain, "train")], callbacks=[RayTrainReportCallback()])
        >>> result = XGBoostTrainer(train_fn, train_loop_config={"params": params},
        ...                         datasets={"train": ds},
        ...                         scaling_config=ddptrain.ScalingConfig(num_workers=2)).fit()
        >>> booster = RayTrainReportCallback.get_model(result.checkpoint)
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        xgboost_config: XGBoostConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        xgboost_config = xgboost_config if xgboost_config is not None else XGBoostConfig()
        if not isinstance(xgboost_config, XGBoostConfig):
            raise ConfigError(f"`xgboost_config` must be a ddptrain.xgboost.XGBoostConfig, got {xgboost_config!r}.")
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=xgboost_config,
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            resume_from_checkpoint=resume_from_checkpoint,
            metadata=metadata,
        )
