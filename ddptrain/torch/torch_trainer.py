"""``TorchTrainer``: a DataParallelTrainer whose workers form a torch process group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddptrain.base_trainer import PREPROCESSOR_DEPRECATION_MESSAGE
from ddptrain.checkpoint import Checkpoint
from ddptrain.config import DataConfig, RunConfig, ScalingConfig
from ddptrain.data_parallel_trainer import DataParallelTrainer
from ddptrain.errors import ConfigError
from ddptrain.torch.config import TorchConfig

__all__ = ["TorchTrainer"]


class TorchTrainer(DataParallelTrainer):
    """Data-parallel PyTorch training: each worker joins ``torch.distributed`` before the
    training function runs (gloo on CPU, nccl with ``use_gpu``).

    Args:
        train_loop_per_worker: The training function (no argument, or the config dict).
        train_loop_config: Passed to the training function.
        torch_config: Process-group settings; the backend defaults to nccl/gloo.
        scaling_config: Number of workers and devices.
        run_config: Name, storage and policies of the run.
        datasets: Named datasets for ``get_dataset_shard``.
        dataset_config: Which datasets are split.
        resume_from_checkpoint: A checkpoint the run starts from.

    Example:
        >>> trainer = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2))
        >>> result = trainer.fit()
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        torch_config: TorchConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        metadata: dict[str, Any] | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        validation_config: Any = None,
        preprocessor: Any = None,
    ) -> None:
        if preprocessor is not None:
            raise DeprecationWarning(PREPROCESSOR_DEPRECATION_MESSAGE)
        torch_config = torch_config if torch_config is not None else TorchConfig()
        if not isinstance(torch_config, TorchConfig):
            raise ConfigError(f"`torch_config` must be a ddptrain.torch.TorchConfig, got {torch_config!r}.")
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=torch_config,
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            resume_from_checkpoint=resume_from_checkpoint,
            metadata=metadata,
            validation_config=validation_config,
        )
