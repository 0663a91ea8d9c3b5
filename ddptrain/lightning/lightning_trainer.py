"""``LightningTrainer`` and ``LightningConfigBuilder``: Ray 2.6's Lightning trainer.

Ray 2.6 trained a ``LightningModule`` from a config: the module class and its arguments, the
``Trainer``'s and ``fit()``'s arguments, the strategy and ``ModelCheckpoint``'s arguments, all
put together by :class:`LightningConfigBuilder`. Ray 2.8 removed it for ``TorchTrainer`` with
``prepare_trainer``; scripts written for 2.4-2.7 run here unchanged (imports swapped)::

    from ddptrain.lightning import LightningConfigBuilder, LightningTrainer

    config = (LightningConfigBuilder()
              .module(cls=MNISTClassifier, lr=1e-3, feature_dim=128)
              .trainer(max_epochs=3, accelerator="cpu")
              .fit_params(train_dataloaders=train_loader, val_dataloaders=val_loader)
              .checkpointing(monitor="val_loss", save_top_k=2, mode="min")
              .build())
    result = LightningTrainer(lightning_config=config,
                              scaling_config=ScalingConfig(num_workers=2)).fit()

Each worker builds the module, a ``Trainer`` with the ddptrain strategy and cluster environment,
and a ``ModelCheckpoint`` from ``.checkpointing()`` that reports every checkpoint Lightning saves
(its ``last.ckpt``, as ``MODEL_KEY`` = ``"model"`` in the reported checkpoint) with the metrics.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

from ddptrain.base_trainer import PREPROCESSOR_DEPRECATION_MESSAGE
from ddptrain.checkpoint import Checkpoint
from ddptrain.config import CheckpointConfig, DataConfig, RunConfig, ScalingConfig
from ddptrain.errors import ConfigError
from ddptrain.lightning._trainer_worker import MODEL_KEY, check_module_class, lightning_train_loop_per_worker
from ddptrain.torch.config import TorchConfig
from ddptrain.torch.torch_trainer import TorchTrainer

__all__ = ["LightningConfigBuilder", "LightningTrainer", "MODEL_KEY"]

_logger = logging.getLogger(__name__)

_STRATEGIES = ("ddp", "fsdp", "deepspeed")
_KEYS = (
    "_module_class",
    "_module_init_config",
    "_trainer_init_config",
    "_trainer_fit_params",
    "_strategy_config",
    "_model_checkpoint_config",
)


class LightningConfigBuilder:
    """Builds the ``lightning_config`` of :class:`LightningTrainer` (Ray 2.6's API).

    Every method returns the builder, so calls chain; keyword arguments of repeated calls are
    merged. ``.module()`` is required (at the latest when the trainer is made: a config built
    without it may be a Tune ``param_space`` merged into a full one).

    Example:
        >>> config = (LightningConfigBuilder()
        ...           .module(cls=LinearModule, input_dim=32, output_dim=4)
        ...           .trainer(max_epochs=5, accelerator="cpu")
        ...           .fit_params(datamodule=MyDataModule())
        ...           .strategy(name="ddp")
        ...           .checkpointing(monitor="loss", save_top_k=2, mode="min")
        ...           .build())
    """

    def __init__(self) -> None:
        self._module_class: Any = None
        self._module_init_config: dict[str, Any] = {}
        self._trainer_init_config: dict[str, Any] = {}
        self._trainer_fit_params: dict[str, Any] = {}
        self._strategy_config: dict[str, Any] = {}
        self._model_checkpoint_config: dict[str, Any] = {}

    def module(self, cls: Any = None, **kwargs: Any) -> LightningConfigBuilder:
        """The ``LightningModule`` subclass (the class, not an instance) and its ``__init__`` arguments.

        Each worker builds its own instance: ``cls(**kwargs)``.
        """
        if cls is not None:
            self._module_class = cls
        self._module_init_config.update(kwargs)
        return self

    def trainer(self, **kwargs: Any) -> LightningConfigBuilder:
        """Arguments of ``Trainer(...)``. ``strategy``, ``devices`` and the cluster environment are
        set by ddptrain (``strategy`` is ignored with a warning: use :meth:`strategy`)."""
        self._trainer_init_config.update(kwargs)
        return self

    def fit_params(self, **kwargs: Any) -> LightningConfigBuilder:
        """Arguments of ``Trainer.fit(...)`` (``train_dataloaders``, ``val_dataloaders``,
        ``datamodule``, ``ckpt_path``); the model is the one :meth:`module` describes."""
        if "model" in kwargs:
            _logger.warning(
                "`LightningConfigBuilder.fit_params(model=...)` is ignored: LightningTrainer builds the "
                "model from `.module(cls, **kwargs)` in each worker."
            )
        self._trainer_fit_params.update(kwargs)
        return self

    def strategy(self, name: str = "ddp", **kwargs: Any) -> LightningConfigBuilder:
        """The distributed strategy: ``"ddp"`` (default), ``"fsdp"`` or ``"deepspeed"``, with the
        arguments of Lightning's ``DDPStrategy``/``FSDPStrategy``/``DeepSpeedStrategy``."""
        if name not in _STRATEGIES:
            raise ConfigError(
                f"`LightningConfigBuilder.strategy(name=...)` must be one of {', '.join(map(repr, _STRATEGIES))}, "
                f"got {name!r}."
            )
        self._strategy_config["_strategy_name"] = name
        self._strategy_config.update(kwargs)
        return self

    def checkpointing(self, **kwargs: Any) -> LightningConfigBuilder:
        """Arguments of Lightning's ``ModelCheckpoint`` (``monitor``, ``mode``, ``save_top_k``,
        ``every_n_epochs``, ``every_n_train_steps``, ...).

        Whenever this callback saves, the workers report the metrics with a checkpoint, so a
        checkpoint is reported exactly as often as Lightning checkpoints. Unless the run's
        ``CheckpointConfig`` is set, it is made from these: ``num_to_keep=save_top_k`` (all for
        ``-1``), ranked by ``monitor`` in ``mode`` (default ``"min"``).
        """
        self._model_checkpoint_config.update(kwargs)
        return self

    def build(self) -> dict[str, Any]:
        """The config dict for ``LightningTrainer(lightning_config=...)``.

        Raises:
            ConfigError: ``.module()`` got something that is not a ``LightningModule`` class.
        """
        config = copy.copy(self.__dict__)
        for key in _KEYS[1:]:
            config[key] = dict(config[key])
        if self._module_class is None:
            config.pop("_module_class")  # a partial config (a Tune param_space) leaves it unset
        else:
            check_module_class(self._module_class)
        return config


class LightningTrainer(TorchTrainer):
    """Data-parallel PyTorch Lightning training from a :class:`LightningConfigBuilder` config
    (Ray 2.6's ``LightningTrainer``).

    Each worker builds the ``LightningModule`` from ``.module()``, a ``Trainer`` from
    ``.trainer()`` with ddptrain's strategy (``.strategy()``, DDP by default), cluster
    environment and ``devices="auto"``, and a ``ModelCheckpoint`` from ``.checkpointing()``
    (``save_last=True``), then calls ``Trainer.fit(module, **fit_params)``. Every time that
    callback saves, each worker calls :func:`ddptrain.report` with ``trainer.callback_metrics``
    (plus ``epoch``, ``step`` and ``_report_on``, the hook), rank 0 with a checkpoint holding
    Lightning's ``last.ckpt`` as ``MODEL_KEY`` (``"model"``). A restarted or resumed run fits with
    ``ckpt_path`` set to that file (a ``ckpt_path`` in ``fit_params`` is then ignored).

    Data: the dataloaders or datamodule of ``.fit_params()`` (Lightning shards map-style datasets
    with its distributed sampler), or ``datasets={"train": ..., "val": ...}``: each worker reads
    its shard with ``iter_torch_batches(**datasets_iter_config)`` (then the ``datamodule`` of
    ``fit_params`` is ignored). Lightning's own files (logs, ``ModelCheckpoint``'s folder) go to
    ``Trainer(default_root_dir=...)``, by default a temporary folder per worker and attempt.

    Args:
        lightning_config: ``LightningConfigBuilder(...).build()``.
        torch_config: Process-group settings, as for ``TorchTrainer``.
        scaling_config: Number of workers and devices.
        dataset_config: Which datasets are split (all by default).
        run_config: Name, storage and policies of the run.
        datasets: ``"train"`` (and optionally ``"val"``) datasets.
        datasets_iter_config: Keyword arguments of ``iter_torch_batches`` (``batch_size``,
            ``collate_fn``, ...); required with ``datasets``.
        preprocessor: Raises Ray's deprecation (Ray removed preprocessors from trainers in 2.7): transform
            the datasets before.
        resume_from_checkpoint: A checkpoint of a LightningTrainer run to continue from.

    Raises:
        ConfigError: No ``.module()`` in the config, ``datasets`` without ``datasets_iter_config``.
    """

    def __init__(
        self,
        lightning_config: dict[str, Any] | None = None,
        *,
        torch_config: TorchConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        dataset_config: DataConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        datasets_iter_config: dict[str, Any] | None = None,
        preprocessor: Any = None,
        resume_from_checkpoint: Checkpoint | None = None,
    ) -> None:
        if preprocessor is not None:  # as every trainer (Ray 2.7 removed them)
            raise DeprecationWarning(PREPROCESSOR_DEPRECATION_MESSAGE)
        config = _check_config(lightning_config)
        if datasets and not datasets_iter_config:
            raise ConfigError(
                "`LightningTrainer(datasets=...)` needs `datasets_iter_config`: the keyword arguments of "
                "`iter_torch_batches` each worker reads its shard with, e.g. "
                "`datasets_iter_config={'batch_size': 32}`."
            )
        if datasets_iter_config is not None and not isinstance(datasets_iter_config, dict):
            raise ConfigError(f"`datasets_iter_config` must be a dict, got {datasets_iter_config!r}.")
        run_config = run_config if run_config is not None else RunConfig()
        if isinstance(run_config, RunConfig):
            checkpoint_config = _checkpoint_config(
                config["_model_checkpoint_config"], run_config.checkpoint_config or CheckpointConfig()
            )
            run_config = dataclasses.replace(run_config, checkpoint_config=checkpoint_config)
        super().__init__(
            lightning_train_loop_per_worker,
            train_loop_config={"lightning_config": config, "datasets_iter_config": datasets_iter_config},
            torch_config=torch_config,
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            resume_from_checkpoint=resume_from_checkpoint,
        )


def _check_config(config: Any) -> dict[str, Any]:
    if config is None:
        raise ConfigError(
            "`LightningTrainer` needs `lightning_config=LightningConfigBuilder().module(cls=MyModule, ...)"
            ".trainer(...).build()`."
        )
    if isinstance(config, LightningConfigBuilder):
        raise ConfigError("Pass `lightning_config=builder.build()`, not the LightningConfigBuilder itself.")
    if not isinstance(config, dict) or not set(_KEYS[1:]) <= set(config):
        raise ConfigError(
            f"`lightning_config` must be what `LightningConfigBuilder().build()` returns, got {config!r}."
        )
    if config.get("_module_class") is None:
        raise ConfigError(
            "The `lightning_config` has no LightningModule: call `.module(cls=MyModule, **init_kwargs)` on the "
            "LightningConfigBuilder before `.build()`."
        )
    check_module_class(config["_module_class"])
    return config


def _checkpoint_config(lightning: dict[str, Any], given: CheckpointConfig) -> CheckpointConfig:
    """The run's CheckpointConfig: ``given`` when set, else Lightning's ``save_top_k`` and ``monitor``."""
    monitor = lightning.get("monitor")
    if monitor and given.checkpoint_score_attribute and monitor != given.checkpoint_score_attribute:
        _logger.warning(
            "`CheckpointConfig(checkpoint_score_attribute=%r)` and `.checkpointing(monitor=%r)` rank by different "
            "metrics: log both before Lightning saves a checkpoint.",
            given.checkpoint_score_attribute,
            monitor,
        )
    if given != CheckpointConfig():
        return given
    save_top_k = lightning.get("save_top_k", 1)
    num_to_keep = None if save_top_k == -1 else max(int(save_top_k), 1)
    return CheckpointConfig(
        num_to_keep=num_to_keep, checkpoint_score_attribute=monitor, checkpoint_score_order=lightning.get("mode", "min")
    )
