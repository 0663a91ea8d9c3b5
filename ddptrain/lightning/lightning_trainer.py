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
import importlib
import logging
import os
import shutil
import tempfile
from functools import lru_cache
from inspect import isclass
from pathlib import Path
from typing import Any

from ddptrain import context
from ddptrain.checkpoint import Checkpoint
from ddptrain.config import CheckpointConfig, DataConfig, RunConfig, ScalingConfig
from ddptrain.errors import ConfigError
from ddptrain.lightning._impl import PACKAGES
from ddptrain.torch.config import TorchConfig
from ddptrain.torch.torch_trainer import TorchTrainer

__all__ = ["LightningConfigBuilder", "LightningTrainer", "MODEL_KEY"]

_logger = logging.getLogger(__name__)

MODEL_KEY = "model"  # the Lightning checkpoint file (or folder) in a reported checkpoint, as in Ray
REPORT_STAGE_KEY = "_report_on"  # the hook that reported: train_batch_end, train_epoch_end, ...
_STRATEGIES = ("ddp", "fsdp", "deepspeed")
_KEYS = (
    "_module_class",
    "_module_init_config",
    "_trainer_init_config",
    "_trainer_fit_params",
    "_strategy_config",
    "_model_checkpoint_config",
)


def _module_package(cls: Any) -> str | None:
    """``"lightning"`` or ``"pytorch_lightning"``: the package whose ``LightningModule`` ``cls``
    subclasses; ``None`` when it is not a ``LightningModule`` class."""
    if not isclass(cls):
        return None
    for base in cls.__mro__:
        if base.__name__ == "LightningModule":
            for package in ("pytorch_lightning", "lightning"):
                if base.__module__.startswith(package + "."):
                    return package
    return None


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
            _check_module_class(self._module_class)
        return config


def _check_module_class(cls: Any) -> str:
    if not isclass(cls):
        raise ConfigError(
            f"`LightningConfigBuilder.module(cls=...)` takes the LightningModule class, not an instance; "
            f"got {cls!r}. Pass `cls=MyModule` and its arguments as keywords: `.module(cls=MyModule, lr=0.1)`."
        )
    package = _module_package(cls)
    if package is None:
        raise ConfigError(
            f"`LightningConfigBuilder.module(cls=...)` must be a subclass of `LightningModule` "
            f"(lightning.pytorch or pytorch_lightning), got {cls.__module__}.{cls.__qualname__}."
        )
    return package


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
        preprocessor: Not supported (Ray removed preprocessors from trainers in 2.7): transform
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
        if preprocessor is not None:
            raise ConfigError(
                "`LightningTrainer(preprocessor=...)` is not supported: apply the preprocessing to the "
                "datasets before (`dataset.map_batches(...)`)."
            )
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
            checkpoint_config = _checkpoint_config(config["_model_checkpoint_config"], run_config.checkpoint_config)
            run_config = dataclasses.replace(run_config, checkpoint_config=checkpoint_config)
        super().__init__(
            _lightning_train_loop_per_worker,
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
        raise ConfigError(f"`lightning_config` must be what `LightningConfigBuilder().build()` returns, got {config!r}.")
    if config.get("_module_class") is None:
        raise ConfigError(
            "The `lightning_config` has no LightningModule: call `.module(cls=MyModule, **init_kwargs)` on the "
            "LightningConfigBuilder before `.build()`."
        )
    _check_module_class(config["_module_class"])
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


def _metric(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.detach().cpu().tolist()
    return value


@lru_cache(maxsize=None)
def _worker_classes(package: str) -> dict[str, Any]:
    """The ModelCheckpoint that reports, and the datamodule over dataset shards, for ``package``."""
    pl: Any = importlib.import_module(PACKAGES[package])
    import torch

    class RayModelCheckpoint(pl.callbacks.ModelCheckpoint):
        """Lightning's ``ModelCheckpoint`` that reports each time it saves its last checkpoint."""

        _ddptrain_saved = False

        def _save_last_checkpoint(self, trainer: Any, monitor_candidates: Any) -> None:
            super()._save_last_checkpoint(trainer, monitor_candidates)
            self._ddptrain_saved = True

        def _report(self, trainer: Any, stage: str) -> None:
            if not self._ddptrain_saved:
                return
            self._ddptrain_saved = False
            metrics: dict[str, Any] = {REPORT_STAGE_KEY: stage}
            metrics.update({key: _metric(value) for key, value in self._monitor_candidates(trainer).items()})
            trainer.strategy.barrier()  # every rank's file is written
            source = Path(os.path.expanduser(self.last_model_path))
            with tempfile.TemporaryDirectory(prefix="ddptrain_lightning_") as folder:
                target = Path(folder, MODEL_KEY)
                if source.is_dir() and context.get_context().get_local_rank() == 0:  # DeepSpeed: this host's shards
                    shutil.copytree(source, target)
                elif source.is_file() and trainer.global_rank == 0:  # DDP, FSDP: rank 0 wrote the whole model
                    shutil.copy(source, target)
                checkpoint = Checkpoint.from_directory(folder) if target.exists() else None
                context.report(metrics, checkpoint=checkpoint)

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            super().on_train_batch_end(trainer, *args, **kwargs)
            self._report(trainer, "train_batch_end")

        def on_train_epoch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            super().on_train_epoch_end(trainer, *args, **kwargs)
            self._report(trainer, "train_epoch_end")

        def on_validation_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            super().on_validation_end(trainer, *args, **kwargs)
            self._report(trainer, "validation_end")

        def on_train_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            super().on_train_end(trainer, *args, **kwargs)
            self._report(trainer, "train_end")

    class _Batches(torch.utils.data.IterableDataset):  # type: ignore[misc]
        def __init__(self, batches: Any) -> None:
            super().__init__()
            self._batches = batches

        def __iter__(self) -> Any:
            return iter(self._batches)

    def _loader(shard: Any, iter_config: dict[str, Any]) -> Any:
        return torch.utils.data.DataLoader(_Batches(shard.iter_torch_batches(**iter_config)), batch_size=None)

    class RayDataModule(pl.LightningDataModule):
        """This worker's shards of the ``"train"`` and ``"val"`` datasets, read with ``iter_torch_batches``."""

        def __init__(self, iter_config: dict[str, Any], train: Any, val: Any) -> None:
            super().__init__()
            self._train = _loader(train, iter_config)
            if val is not None:  # Lightning runs validation only when val_dataloader is overridden
                self.val_dataloader = lambda: _loader(val, iter_config)

        def train_dataloader(self) -> Any:
            return self._train

    return {"RayModelCheckpoint": RayModelCheckpoint, "RayDataModule": RayDataModule}


def _shard(name: str) -> Any:
    try:
        return context.get_dataset_shard(name)
    except KeyError:
        return None


def _lightning_train_loop_per_worker(config: dict[str, Any]) -> None:
    """Each worker: build the module and the Trainer from the config, then ``fit``."""
    lightning_config = copy.deepcopy(config["lightning_config"])
    iter_config = dict(config.get("datasets_iter_config") or {})
    module_class = lightning_config["_module_class"]
    package = _check_module_class(module_class)
    pl: Any = importlib.import_module(PACKAGES[package])
    ray_classes: Any = importlib.import_module(f"ddptrain.lightning.{package}")
    worker_classes = _worker_classes(package)

    trainer_config = dict(lightning_config["_trainer_init_config"])
    fit_params = dict(lightning_config["_trainer_fit_params"])
    fit_params.pop("model", None)
    strategy_config = dict(lightning_config["_strategy_config"])
    strategy_name = strategy_config.pop("_strategy_name", "ddp")
    checkpoint_config = dict(lightning_config["_model_checkpoint_config"])

    train_shard, val_shard = _shard("train"), _shard("val")
    if train_shard is not None:
        if fit_params.pop("datamodule", None) is not None:
            _logger.warning("LightningTrainer: `datasets['train']` is given, so the `datamodule` of fit_params is ignored.")
        for key in ("train_dataloaders", "val_dataloaders"):
            fit_params.pop(key, None)
        fit_params["datamodule"] = worker_classes["RayDataModule"](iter_config, train_shard, val_shard)
    elif not (fit_params.get("train_dataloaders") or fit_params.get("datamodule")):
        raise ConfigError(
            "LightningTrainer has no training data: pass `datasets={'train': ...}` to the trainer, or "
            "`train_dataloaders=` or `datamodule=` to `LightningConfigBuilder.fit_params()`."
        )

    if "strategy" in trainer_config:
        _logger.warning(
            "LightningTrainer: `.trainer(strategy=...)` is ignored; the strategy comes from "
            "`LightningConfigBuilder.strategy()` (ddp by default)."
        )
    strategy_class = {
        "ddp": ray_classes.RayDDPStrategy,
        "fsdp": ray_classes.RayFSDPStrategy,
        "deepspeed": ray_classes.RayDeepSpeedStrategy,
    }[strategy_name]
    trainer_config["strategy"] = strategy_class(**strategy_config)
    trainer_config["devices"] = "auto"
    trainer_config["plugins"] = [*trainer_config.get("plugins", []), ray_classes.RayLightningEnvironment()]
    trainer_config["enable_checkpointing"] = True
    checkpoint_config["save_last"] = True
    trainer_config["callbacks"] = [
        *trainer_config.get("callbacks", []),
        worker_classes["RayModelCheckpoint"](**checkpoint_config),
    ]
    own_root = None
    if "default_root_dir" not in trainer_config:
        own_root = tempfile.mkdtemp(prefix="ddptrain_lightning_root_")
        trainer_config["default_root_dir"] = own_root
    try:
        module = module_class(**lightning_config["_module_init_config"])
        trainer = pl.Trainer(**trainer_config)
        checkpoint = context.get_checkpoint()
        if checkpoint is not None:
            if "ckpt_path" in fit_params:
                _logger.info("LightningTrainer resumes from %s; `fit_params(ckpt_path=...)` is ignored.", checkpoint.path)
            with checkpoint.as_directory() as folder:
                fit_params["ckpt_path"] = os.path.join(folder, MODEL_KEY)
                trainer.fit(module, **fit_params)
        else:
            trainer.fit(module, **fit_params)
    finally:
        if own_root is not None:
            shutil.rmtree(own_root, ignore_errors=True)
