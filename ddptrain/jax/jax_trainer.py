"""``JaxTrainer``: a DataParallelTrainer whose workers form one multi-process JAX runtime."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.config import DataConfig, RunConfig, ScalingConfig
from ddptrain.data_parallel_trainer import DataParallelTrainer
from ddptrain.errors import ConfigError
from ddptrain.jax.config import JaxConfig

__all__ = ["JaxTrainer"]


class JaxTrainer(DataParallelTrainer):
    """Data-parallel (SPMD) JAX training (Ray Train V2's ``JaxTrainer``).

    Every worker joins one ``jax.distributed`` runtime before the training function runs (on
    CPUs too, with gloo collectives; see :class:`JaxConfig`): ``jax.devices()`` lists the
    devices of all workers, ``jax.local_devices()`` this worker's. Build global arrays from
    each worker's batch with ``jax.make_array_from_process_local_data`` and let ``jit`` or
    ``shard_map`` with ``jax.lax.psum``/``pmean`` combine them. Read this worker's rows with
    ``ddptrain.get_dataset_shard("train").iter_batches(batch_format="numpy")``; report and
    checkpoint with ``ddptrain.report`` as with any trainer.

    Contract: the training function (and what it imports) must not call JAX before it runs:
    ``jax.distributed.initialize`` has to come first (importing ``jax`` at module level is
    fine, computing with it is not, and fails the run with an error naming the module).
    Every worker must run the same sequence of collectives. The driver does not import JAX.

    Args:
        train_loop_per_worker: The training function (no argument, or the config dict).
        train_loop_config: Passed to the training function.
        jax_config: Backend settings (default: ``JaxConfig(use_gpu=scaling_config.use_gpu)``).
        scaling_config: Number of workers and whether each gets GPUs.
        run_config: Name, storage and policies of the run.
        datasets: Named datasets for ``get_dataset_shard``.
        dataset_config: Which datasets are split.
        resume_from_checkpoint: A checkpoint the run starts from (``get_checkpoint()``).

    Example:
        >>> def train_func(config):
        ...     import jax, numpy as np
        ...     from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        ...     mesh = Mesh(np.array(jax.devices()), ("batch",))
        ...     for batch in ddptrain.get_dataset_shard("train").iter_batches(batch_size=32,
        ...                                                                    batch_format="numpy"):
        ...         x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("batch")), batch["x"])
        ...         ...  # a jitted step on the global batch
        ...     ddptrain.report({"loss": float(loss)})
        >>> result = JaxTrainer(train_func, scaling_config=ddptrain.ScalingConfig(num_workers=2),
        ...                     datasets={"train": dataset}).fit()
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        jax_config: JaxConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
    ) -> None:
        if jax_config is None:
            use_gpu = scaling_config.use_gpu if isinstance(scaling_config, ScalingConfig) else False
            jax_config = JaxConfig(use_gpu=use_gpu)
        if not isinstance(jax_config, JaxConfig):
            raise ConfigError(f"`jax_config` must be a ddptrain.jax.JaxConfig, got {jax_config!r}.")
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=jax_config,
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            resume_from_checkpoint=resume_from_checkpoint,
        )
