"""The worker side of ``LightningTrainer``: the module class's package, the ``ModelCheckpoint``
that reports each save, the datamodule over dataset shards, and the per-worker loop."""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import tempfile
from functools import cache
from inspect import isclass
from pathlib import Path
from typing import Any

from ddptrain import context
from ddptrain.checkpoint import Checkpoint
from ddptrain.errors import ConfigError
from ddptrain.lightning._impl import PACKAGES

__all__ = ["MODEL_KEY", "REPORT_STAGE_KEY", "check_module_class", "lightning_train_loop_per_worker"]

_logger = logging.getLogger(__name__)

MODEL_KEY = "model"  # the Lightning checkpoint file (or folder) in a reported checkpoint, as in Ray
REPORT_STAGE_KEY = "_report_on"  # the hook that reported: train_batch_end, train_epoch_end, ...


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


def check_module_class(cls: Any) -> str:
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


def _metric(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.detach().cpu().tolist()
    return value


@cache
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

    class _Batches(torch.utils.data.IterableDataset):
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


def lightning_train_loop_per_worker(config: dict[str, Any]) -> None:
    """Each worker: build the module and the Trainer from the config, then ``fit``."""
    lightning_config = config["lightning_config"]  # read only: every part used is copied below
    iter_config = dict(config.get("datasets_iter_config") or {})
    module_class = lightning_config["_module_class"]
    package = check_module_class(module_class)
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
    own_loaders = getattr(module_class, "train_dataloader", None) is not pl.LightningModule.train_dataloader
    if train_shard is not None:
        ignored = [key for key in ("datamodule", "train_dataloaders", "val_dataloaders") if fit_params.pop(key, None)]
        if ignored:
            _logger.warning(
                "LightningTrainer: `datasets['train']` is given, so `%s` of fit_params is ignored.",
                "`, `".join(ignored),
            )
        fit_params["datamodule"] = worker_classes["RayDataModule"](iter_config, train_shard, val_shard)
    elif not (fit_params.get("train_dataloaders") or fit_params.get("datamodule") or own_loaders):
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
                _logger.info(
                    "LightningTrainer resumes from %s; `fit_params(ckpt_path=...)` is ignored.", checkpoint.path
                )
            with checkpoint.as_directory() as folder:
                fit_params["ckpt_path"] = os.path.join(folder, MODEL_KEY)
                trainer.fit(module, **fit_params)
        else:
            trainer.fit(module, **fit_params)
    finally:
        if own_root is not None:
            shutil.rmtree(own_root, ignore_errors=True)
