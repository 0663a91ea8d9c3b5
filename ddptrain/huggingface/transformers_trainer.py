"""``TransformersTrainer``: Ray 2.6's trainer for a Hugging Face ``transformers.Trainer``.

Ray 2.8 replaced it with ``TorchTrainer`` plus ``prepare_trainer``; scripts written for Ray
2.1-2.7 run here with ``ray.train.huggingface`` changed to ``ddptrain.huggingface``::

    def trainer_init_per_worker(train_dataset, eval_dataset, **config):
        args = transformers.TrainingArguments(output_dir="out", save_strategy="epoch", ...)
        return transformers.Trainer(model=model, args=args, train_dataset=train_dataset,
                                    eval_dataset=eval_dataset)

    trainer = TransformersTrainer(trainer_init_per_worker, scaling_config=ScalingConfig(num_workers=2),
                                  datasets={"train": train_ds, "evaluation": eval_ds})
    result = trainer.fit()

This module does not import ``transformers``: the trainer checks at construction that it is
installed, and the workers import it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from ddptrain import context
from ddptrain.base_trainer import PREPROCESSOR_DEPRECATION_MESSAGE
from ddptrain.checkpoint import Checkpoint
from ddptrain.config import DataConfig, RunConfig, ScalingConfig
from ddptrain.errors import ConfigError
from ddptrain.torch.config import TorchConfig
from ddptrain.torch.torch_trainer import TorchTrainer

__all__ = ["TransformersTrainer"]

TRAINER_INIT_FN_KEY = "_trainer_init_per_worker"


def _transformers_installed() -> bool:
    if "transformers" in sys.modules:
        return sys.modules["transformers"] is not None
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        return False


class TransformersTrainer(TorchTrainer):
    """Data-parallel training of a Hugging Face ``transformers.Trainer`` (Ray 2.6's
    ``TransformersTrainer``).

    Each worker calls ``trainer_init_per_worker(train_dataset, eval_dataset, **trainer_init_config)``
    and trains the ``transformers.Trainer`` it returns with ``trainer.train()``.
    ``train_dataset`` and ``eval_dataset`` are this worker's shards of ``datasets["train"]`` and
    ``datasets["evaluation"]`` (``None`` when not given) as torch iterable datasets with a length
    (:class:`ddptrain.huggingface.transformers.ShardDataset`); the ``Trainer`` reads them in
    batches of ``per_device_*_batch_size`` and does not split them again. Evaluation metrics
    are gathered over every worker's shard, so they cover the whole evaluation set.

    Every checkpoint the ``Trainer`` saves (``save_strategy``/``save_steps``) is reported with
    the metrics logged so far (``RayTrainReportCallback``), in the reported checkpoint's
    ``checkpoint/`` folder; a restarted or resumed run calls
    ``trainer.train(resume_from_checkpoint=...)`` with it (a checkpoint whose files are at its
    top, as Ray 2.6 wrote them, works too).

    Args:
        trainer_init_per_worker: ``(train_dataset, eval_dataset, **config) -> transformers.Trainer``.
        trainer_init_config: Keyword arguments for ``trainer_init_per_worker``; a Tune
            ``param_space={"trainer_init_config": {...}}`` overrides them, as in Ray.
        torch_config: Process-group settings, as for ``TorchTrainer``.
        scaling_config: Number of workers and devices.
        dataset_config: Which datasets are split (all by default).
        run_config: Name, storage and policies of the run.
        datasets: ``"train"`` and optionally ``"evaluation"``.
        preprocessor: Raises Ray's deprecation (Ray removed preprocessors in 2.7): transform the datasets before.
        resume_from_checkpoint: A checkpoint of a TransformersTrainer run to continue from.

    Raises:
        ImportError: ``transformers`` is not installed (names ``ddptrain[transformers]``).
        ConfigError: ``trainer_init_per_worker`` does not take 3 arguments, or uses a reserved key.
    """

    def __init__(
        self,
        trainer_init_per_worker: Callable[..., Any],
        *,
        trainer_init_config: dict[str, Any] | None = None,
        torch_config: TorchConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        dataset_config: DataConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        preprocessor: Any = None,
        resume_from_checkpoint: Checkpoint | None = None,
    ) -> None:
        if not _transformers_installed():
            raise ImportError(
                "TransformersTrainer needs Hugging Face Transformers, which is not installed: "
                "`pip install ddptrain[transformers]` (or `pip install transformers`)."
            )
        if preprocessor is not None:  # as every trainer (Ray 2.7 removed them)
            raise DeprecationWarning(PREPROCESSOR_DEPRECATION_MESSAGE)
        if not callable(trainer_init_per_worker):
            raise ConfigError(
                f"`trainer_init_per_worker` must be a function returning a transformers.Trainer, "
                f"got {trainer_init_per_worker!r}."
            )
        parameters = len(inspect.signature(trainer_init_per_worker).parameters)
        if parameters < 3:
            raise ConfigError(
                f"`trainer_init_per_worker` must take (train_dataset, eval_dataset, **config); it takes "
                f"{parameters} argument(s)."
            )
        if trainer_init_config is not None and not isinstance(trainer_init_config, dict):
            raise ConfigError(f"`trainer_init_config` must be a dict, got {trainer_init_config!r}.")
        config = dict(trainer_init_config or {})
        if TRAINER_INIT_FN_KEY in config:
            raise ConfigError(f"'{TRAINER_INIT_FN_KEY}' is a reserved key in `trainer_init_config`.")
        config[TRAINER_INIT_FN_KEY] = trainer_init_per_worker
        super().__init__(
            _transformers_train_loop_per_worker,
            train_loop_config=config,
            torch_config=torch_config,
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            resume_from_checkpoint=resume_from_checkpoint,
        )


def _shard(name: str) -> Any:
    try:
        return context.get_dataset_shard(name)
    except KeyError:
        return None


def _transformers_train_loop_per_worker(config: dict[str, Any]) -> None:
    """Each worker: build the HF Trainer on this worker's shards, then ``train()``."""
    config = dict(config)
    trainer_init_per_worker = config.pop(TRAINER_INIT_FN_KEY)
    # A Tune param_space={"trainer_init_config": {...}} (Ray's spelling) lands here nested.
    overrides = config.pop("trainer_init_config", None)
    if isinstance(overrides, dict):
        config.update(overrides)
    hf: Any = importlib.import_module("ddptrain.huggingface.transformers")  # imports transformers
    transformers: Any = importlib.import_module("transformers")
    train_shard, eval_shard = _shard("train"), _shard("evaluation")
    trainer = trainer_init_per_worker(
        hf.ShardDataset(train_shard) if train_shard is not None else None,
        hf.ShardDataset(eval_shard) if eval_shard is not None else None,
        **config,
    )
    if not isinstance(trainer, transformers.Trainer):
        raise ConfigError(
            f"`trainer_init_per_worker` must return a transformers.Trainer, got {type(trainer).__name__}."
        )
    if not any(isinstance(callback, hf.RayTrainReportCallback) for callback in trainer.callback_handler.callbacks):
        trainer.add_callback(hf.RayTrainReportCallback())
    trainer = hf.prepare_trainer(trainer)
    checkpoint = context.get_checkpoint()
    if checkpoint is None:
        trainer.train()
        return
    with checkpoint.as_directory() as folder:
        nested = os.path.join(folder, hf.RayTrainReportCallback.CHECKPOINT_NAME)
        trainer.train(resume_from_checkpoint=nested if os.path.isdir(nested) else folder)
