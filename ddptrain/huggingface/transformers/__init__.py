"""Hugging Face Transformers in a ddptrain ``TorchTrainer``, under Ray Train's names.

Change ``ray.train.huggingface.transformers`` to ``ddptrain.huggingface.transformers``::

    from ddptrain.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    def train_func():
        trainer = transformers.Trainer(model=model, args=args,
                                       train_dataset=ddptrain.get_dataset_shard("train"))
        trainer.add_callback(RayTrainReportCallback())
        trainer = prepare_trainer(trainer)
        trainer.train()

The HF ``Trainer`` finds its rank and world size in the torchrun variables every worker has.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ddptrain.huggingface.transformers needs Hugging Face Transformers, which is not installed: "
        "`pip install ddptrain[transformers]` (or `pip install transformers`)."
    ) from error

import torch
from torch.utils.data import DataLoader, IterableDataset

from ddptrain import context
from ddptrain.checkpoint import Checkpoint
from ddptrain.data.iterator import DataIterator, _Iterable

__all__ = ["RayTrainReportCallback", "ShardDataset", "TransformersTrainer", "prepare_trainer"]

CHECKPOINT_NAME = "checkpoint"


def _metric(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.detach().cpu().tolist()
    return value


class RayTrainReportCallback(transformers.TrainerCallback):
    """Reports each checkpoint the HF ``Trainer`` saves, with its metrics, to ddptrain.

    On every save it reports the newest ``checkpoint-<step>`` folder of ``args.output_dir``,
    copied into the reported checkpoint as ``CHECKPOINT_NAME`` (``"checkpoint"``), as in Ray,
    with the metrics of ``state.log_history`` merged into one dict (later entries win) plus
    ``step`` and ``epoch``. Rank 0's folder is reported; with DeepSpeed or FSDP every rank's,
    whose shards ddptrain merges into the one checkpoint. Every rank calls ``report`` once per
    save, so ``save_strategy`` (and ``save_steps``) set how often a checkpoint is reported;
    make evaluation happen at the same steps to have its metrics in the report.

    Example:
        >>> trainer.add_callback(RayTrainReportCallback())
        >>> ...
        >>> with result.checkpoint.as_directory() as d:
        ...     model = AutoModelForSequenceClassification.from_pretrained(
        ...         os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME))
    """

    CHECKPOINT_NAME = CHECKPOINT_NAME

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        metrics: dict[str, Any] = {}
        for entry in state.log_history:
            metrics.update({key: _metric(value) for key, value in entry.items()})
        metrics["step"] = state.global_step
        metrics["epoch"] = state.epoch
        source: Path | None = Path(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if source is not None and not source.is_dir():  # the Trainer saved elsewhere: take the newest
            newest = get_last_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
            source = Path(newest) if newest else None
        sharded = bool(getattr(args, "deepspeed", None)) or bool(getattr(args, "fsdp", None))
        with tempfile.TemporaryDirectory(prefix="ddptrain_hf_") as folder:
            checkpoint = None
            if source is not None and (sharded or context.get_context().get_world_rank() == 0):
                shutil.copytree(source, Path(folder, CHECKPOINT_NAME))
                checkpoint = Checkpoint.from_directory(folder)
            context.report(metrics, checkpoint=checkpoint)


class _ShardBatches(IterableDataset):
    """Batches of one worker's dataset shard, for a DataLoader with ``batch_size=None``.

    Nothing is sharded again: the rows are already this worker's.
    """

    def __init__(self, batches: Any, length: int | None) -> None:
        super().__init__()
        self._batches = batches
        self._length = length

    def __iter__(self) -> Iterator[Any]:
        return iter(self._batches)

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("the length of these batches is unknown")
        return self._length


class ShardDataset(IterableDataset):
    """One worker's shard of a trainer dataset as a torch ``IterableDataset`` with a length:
    what ``TransformersTrainer`` passes to ``trainer_init_per_worker``.

    Iterating gives the rows as dicts of tensors; ``len()`` is the shard's row count (so
    ``num_train_epochs`` works). A ``Trainer`` prepared by :func:`prepare_trainer` reads it in
    batches of ``per_device_*_batch_size`` without splitting it again.
    """

    def __init__(self, shard: DataIterator) -> None:
        super().__init__()
        self.shard = shard

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.shard.iter_torch_batches(batch_size=1, device="cpu"):
            yield {key: value[0] for key, value in batch.items()}

    def __len__(self) -> int:
        return self.shard.count()


def _shard_loader(dataset: Any, batch_size: int, drop_last: bool) -> DataLoader[Any] | None:
    """A DataLoader over a ``get_dataset_shard`` iterator or its ``iter_*batches`` iterable."""
    if isinstance(dataset, ShardDataset):
        dataset = dataset.shard
    if isinstance(dataset, DataIterator):
        rows = dataset.count()
        length = rows // batch_size if drop_last else math.ceil(rows / batch_size)
        batches = dataset.iter_torch_batches(batch_size=batch_size, drop_last=drop_last)
        return DataLoader(_ShardBatches(batches, length), batch_size=None)
    if isinstance(dataset, _Iterable):
        return DataLoader(_ShardBatches(dataset, None), batch_size=None)
    return None


def prepare_trainer(trainer: Any) -> Any:
    """Let an HF ``Trainer`` read ddptrain dataset shards.

    A ``train_dataset`` or ``eval_dataset`` may then be this worker's shard,
    ``ddptrain.get_dataset_shard(name)`` (read in batches of ``per_device_*_batch_size``,
    with a length, so ``num_train_epochs`` works), or an iterable of batches from its
    ``iter_torch_batches(...)`` (no length: set ``max_steps``). These are not split again
    between workers. Other datasets go through the ``Trainer``'s own loaders.

    It warns when the ``Trainer`` sees fewer processes than there are workers (accelerate on
    CPU workers without ``ACCELERATE_USE_CPU=1`` or ``use_cpu=True``).

    Args:
        trainer: A ``transformers.Trainer`` (or a subclass).

    Returns:
        The same trainer, now of a subclass of its class.
    """
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"`prepare_trainer` expects a transformers.Trainer, got {type(trainer).__name__}.")
    try:
        workers = context.get_context().get_world_size()
    except RuntimeError:  # not in a training function: nothing to compare with
        workers = trainer.args.world_size
    if trainer.args.world_size != workers:
        warnings.warn(
            f"The HF Trainer sees {trainer.args.world_size} process(es) but ddptrain runs {workers} workers: "
            "each process would train alone, on its own data. On CPU workers set `ACCELERATE_USE_CPU=1` "
            "(or `TrainingArguments(use_cpu=True)`) so that accelerate joins the process group.",
            stacklevel=2,
        )
    base: Any = type(trainer)
    if getattr(base, "_ddptrain_prepared", False):
        return trainer

    class RayTransformersTrainer(base):
        _ddptrain_prepared = True

        def get_train_dataloader(self) -> Any:
            loader = _shard_loader(
                self.train_dataset, self.args.per_device_train_batch_size, self.args.dataloader_drop_last
            )
            return loader if loader is not None else super().get_train_dataloader()

        def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
            if isinstance(eval_dataset, str) and isinstance(self.eval_dataset, dict):
                dataset = self.eval_dataset[eval_dataset]
            loader = _shard_loader(dataset, self.args.per_device_eval_batch_size, self.args.dataloader_drop_last)
            return loader if loader is not None else super().get_eval_dataloader(eval_dataset)

    RayTransformersTrainer.__name__ = RayTransformersTrainer.__qualname__ = f"Ray{base.__name__}"
    trainer.__class__ = RayTransformersTrainer
    return trainer


from ddptrain.huggingface.transformers_trainer import TransformersTrainer  # noqa: E402  (Ray's second path)
