"""Datasets for ``get_dataset_shard``: a small in-memory dataset and its per-worker shards."""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ddptrain.config import DataConfig

__all__ = ["Dataset", "DataIterator", "from_items", "range", "shard_datasets"]


class Dataset:
    """Rows held in memory (a list of items or of dicts).

    Build one with :func:`from_items` or :func:`range`.
    """

    def __init__(self, rows: Sequence[Any]) -> None:
        self._rows = list(rows)

    def count(self) -> int:
        """Number of rows."""
        return len(self._rows)

    def take(self, limit: int = 20) -> list[Any]:
        """The first ``limit`` rows."""
        return self._rows[:limit]

    def split(self, n: int, *, equal: bool = True) -> list[Dataset]:
        """``n`` contiguous shards; with ``equal`` the trailing remainder rows are dropped so
        every shard has the same number of rows (a DDP loop must not hang on an uneven shard)."""
        if n < 1:
            raise ValueError(f"`n` must be >= 1, got {n}.")
        size, extra = divmod(len(self._rows), n)
        shards, start = [], 0
        for i in builtins.range(n):
            length = size + (0 if equal or i >= extra else 1)
            shards.append(Dataset(self._rows[start : start + length]))
            start += length
        return shards

    def iterator(self) -> DataIterator:
        return DataIterator(self)

    def iter_batches(self, *, batch_size: int | None = 256, drop_last: bool = False, **_: Any) -> Iterator[Any]:
        """Batches of rows: lists of items, or dicts of lists for dict rows."""
        return self.iterator().iter_batches(batch_size=batch_size, drop_last=drop_last)

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"Dataset(num_rows={len(self._rows)})"


class DataIterator:
    """One worker's view of a dataset; it can be iterated again each epoch."""

    def __init__(self, dataset: Dataset) -> None:
        self._dataset = dataset

    def count(self) -> int:
        """Rows in this shard."""
        return self._dataset.count()

    def iter_rows(self) -> Iterator[Any]:
        """The rows one by one."""
        return iter(self._dataset._rows)

    def iter_batches(self, *, batch_size: int | None = 256, drop_last: bool = False, **_: Any) -> Iterator[Any]:
        """Batches of ``batch_size`` rows (``None``: the whole shard as one batch)."""
        rows = self._dataset._rows
        step = batch_size or max(1, len(rows))
        for start in builtins.range(0, len(rows), step):
            batch = rows[start : start + step]
            if drop_last and len(batch) < step:
                return
            if batch and isinstance(batch[0], dict):
                yield {key: [row[key] for row in batch] for key in batch[0]}
            else:
                yield batch

    def materialize(self) -> Dataset:
        return self._dataset


def from_items(items: Sequence[Any]) -> Dataset:
    """A dataset whose rows are ``items``."""
    return Dataset(items)


def range(n: int) -> Dataset:  # noqa: A001 (Ray's name)
    """A dataset of rows ``{"id": 0} .. {"id": n - 1}``."""
    return Dataset([{"id": i} for i in builtins.range(n)])


def shard_datasets(datasets: dict[str, Any], config: DataConfig, world_size: int) -> dict[int, dict[str, Any]]:
    """Per rank, the dataset shards it gets from ``get_dataset_shard``."""
    shards: dict[int, dict[str, Any]] = {rank: {} for rank in builtins.range(max(world_size, 1))}
    split_all = config.datasets_to_split == "all"
    for name, value in datasets.items():
        dataset = value() if isinstance(value, Callable) and not isinstance(value, Dataset) else value  # type: ignore[arg-type]
        if not isinstance(dataset, Dataset):
            dataset = Dataset(list(dataset))
        if split_all or name in config.datasets_to_split:
            parts = dataset.split(max(world_size, 1), equal=True)
        else:
            parts = [dataset] * max(world_size, 1)
        for rank, part in enumerate(parts):
            shards[rank][name] = part.iterator()
    return shards
