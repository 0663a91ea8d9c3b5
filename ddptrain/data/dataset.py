"""``Dataset``: rows held in memory column by column; numeric columns live in shared memory."""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ddptrain.data._batching import to_pandas
from ddptrain.data._rows import Schema, check_positive_int, row_dicts, type_name
from ddptrain.data._shm import ColumnRef, ColumnSource, SharedBuffer
from ddptrain.data.iterator import DataIterator

if TYPE_CHECKING:
    import pandas

__all__ = ["Dataset", "Schema"]


class Dataset:
    """A table of rows held in memory (Ray Data's ``Dataset``, always materialized).

    Build one with :func:`~ddptrain.data.from_items`, :func:`~ddptrain.data.from_numpy`,
    :func:`~ddptrain.data.from_pandas`, :func:`~ddptrain.data.from_torch`,
    :func:`~ddptrain.data.range`, :func:`~ddptrain.data.read_numpy` or
    :func:`~ddptrain.data.read_csv`. As in Ray, a row is a dict ``{column: value}``.

    Columns are numpy arrays. Numeric columns (any dtype without Python objects) are copied
    once, when the dataset is built, into shared memory: the workers of a run map that memory
    instead of receiving a copy. Columns of Python objects stay in this process and are
    pickled to each worker with its shard. Datasets never change: every method that
    transforms one returns a new dataset.

    Example:
        >>> ds = ddptrain.data.from_items([{"x": 1.0, "y": 0}, {"x": 2.0, "y": 1}])
        >>> ds.count(), ds.columns()
        (2, ['x', 'y'])
        >>> ds.take(1)
        [{'x': 1.0, 'y': 0}]
    """

    def __init__(
        self,
        columns: Mapping[str, np.ndarray],
        num_rows: int,
        buffer: SharedBuffer | tuple[SharedBuffer, ...] | None = None,
    ) -> None:
        # Private: build datasets with the ddptrain.data functions.
        self._columns = dict(columns)
        self._num_rows = num_rows
        # The shared memory of the columns (kept alive here); a zipped dataset has several.
        self._buffers: tuple[SharedBuffer, ...] = (
            buffer if isinstance(buffer, tuple) else () if buffer is None else (buffer,)
        )

    @classmethod
    def _build(cls, columns: Mapping[str, ColumnSource], order: np.ndarray | None = None) -> Dataset:
        """Check ``columns`` and copy them (their rows in ``order``, when given) into a new dataset."""
        lengths = {}
        for name, source in columns.items():
            if not isinstance(name, str):
                raise ValueError(f"Column names must be strings, got {name!r}.")
            pieces = [source] if isinstance(source, np.ndarray) else list(source)
            if any(p.ndim == 0 for p in pieces):
                raise ValueError(f"Column {name!r} must be an array of rows (1 or more dimensions), got a scalar.")
            lengths[name] = sum(len(p) for p in pieces)
        if len(set(lengths.values())) > 1:
            raise ValueError(f"All columns must have the same number of rows, got {lengths}.")
        num_rows = len(order) if order is not None else next(iter(lengths.values()), 0)

        def first(source: ColumnSource) -> np.ndarray:
            return source if isinstance(source, np.ndarray) else source[0]

        shared = [name for name, source in columns.items() if not first(source).dtype.hasobject]
        buffer, arrays = SharedBuffer.create([columns[name] for name in shared], order)
        built = dict(zip(shared, arrays, strict=True))
        for name, source in columns.items():
            if name not in built:
                whole = source if isinstance(source, np.ndarray) else np.concatenate(list(source))
                built[name] = whole[order] if order is not None else whole.copy()
        return cls({name: built[name] for name in columns}, num_rows, buffer)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by value; unpickling builds a new dataset (with its own shared memory).
        return (Dataset._build, ({name: np.asarray(c) for name, c in self._columns.items()},))

    # ----------------------------------------------------------------- what it holds
    def count(self) -> int:
        """Number of rows."""
        return self._num_rows

    def columns(self, fetch_if_missing: bool = True) -> list[str]:
        """Column names, in order."""
        return list(self._columns)

    def schema(self, fetch_if_missing: bool = True) -> Schema:
        """Column names and types."""
        return Schema(
            list(self._columns),
            [c.dtype for c in self._columns.values()],
            [tuple(c.shape[1:]) for c in self._columns.values()],
        )

    def size_bytes(self) -> int:
        """Bytes of the columns in memory (for object columns, only their references)."""
        return int(sum(c.nbytes for c in self._columns.values()))

    def take(self, limit: int = 20) -> list[dict[str, Any]]:
        """The first ``limit`` rows, as dicts."""
        limit = check_positive_int("limit", limit, 0)
        return row_dicts(self._columns, 0, min(limit, self._num_rows))

    def take_all(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Every row, as dicts.

        Raises:
            ValueError: The dataset has more than ``limit`` rows.
        """
        if limit is not None and self._num_rows > limit:
            raise ValueError(f"The dataset has {self._num_rows} rows, more than `limit={limit}`.")
        return row_dicts(self._columns, 0, self._num_rows)

    def take_batch(self, batch_size: int = 20, *, batch_format: str | None = "default") -> Any:
        """The first ``batch_size`` rows as one batch (see :meth:`DataIterator.iter_batches`).

        Raises:
            ValueError: The dataset is empty.
        """
        if not self._num_rows:
            raise ValueError("The dataset is empty: it has no batch to take.")
        return next(iter(self.limit(batch_size).iter_batches(batch_size=None, batch_format=batch_format)))

    def show(self, limit: int = 20) -> None:
        """Print the first ``limit`` rows."""
        for row in self.take(limit):
            print(row)

    def to_pandas(self, limit: int | None = None) -> pandas.DataFrame:
        """The rows as a pandas DataFrame (needs pandas)."""

        rows = self._num_rows if limit is None else min(limit, self._num_rows)
        return to_pandas({name: c[:rows] for name, c in self._columns.items()})

    # ----------------------------------------------------------------- new datasets
    def _slice(self, start: int, stop: int) -> Dataset:
        """Rows ``start:stop``; shares memory with this dataset."""
        return Dataset({n: c[start:stop] for n, c in self._columns.items()}, stop - start, self._buffers)

    def materialize(self) -> Dataset:
        """This dataset (it is always in memory)."""
        return self

    def limit(self, limit: int) -> Dataset:
        """The first ``limit`` rows."""
        return self._slice(0, min(check_positive_int("limit", limit, 0), self._num_rows))

    def select_columns(self, cols: str | list[str]) -> Dataset:
        """A dataset of only the columns ``cols``, in that order."""
        names = [cols] if isinstance(cols, str) else list(cols)
        unknown = [n for n in names if n not in self._columns]
        if unknown:
            raise ValueError(f"Unknown column(s) {unknown}; the dataset has {self.columns()}.")
        return Dataset({n: self._columns[n] for n in names}, self._num_rows, self._buffers)

    def zip(self, *other: Dataset) -> Dataset:
        """This dataset's columns side by side with those of ``other`` (Ray Data's ``zip``).

        The datasets must have the same number of rows. A column name already taken gets the
        first free suffix ``_1``, ``_2``, ... (``id``, ``id_1``), as in Ray. The result shares
        memory with the datasets zipped.

        Raises:
            ValueError: The datasets have different numbers of rows.

        Example:
            >>> features = ddptrain.data.from_numpy({"x": np.zeros((4, 3))})
            >>> labels = ddptrain.data.from_numpy({"y": np.arange(4)})
            >>> features.zip(labels).columns()
            ['x', 'y']
        """
        columns = dict(self._columns)
        buffers = list(self._buffers)
        for ds in other:
            if not isinstance(ds, Dataset):
                raise TypeError(f"`zip` takes ddptrain.data.Dataset objects, got {type(ds).__name__}.")
            if ds._num_rows != self._num_rows:
                raise ValueError(
                    f"Cannot zip datasets with different numbers of rows: {self._num_rows} and {ds._num_rows}."
                )
            for name, column in ds._columns.items():
                new_name, i = name, 1
                while new_name in columns:
                    new_name = f"{name}_{i}"
                    i += 1
                columns[new_name] = column
            buffers += [b for b in ds._buffers if all(b is not mine for mine in buffers)]
        return Dataset(columns, self._num_rows, tuple(buffers))

    def random_shuffle(self, *, seed: int | None = None, num_blocks: int | None = None) -> Dataset:
        """The rows in a random order (a new copy in shared memory).

        Args:
            seed: Seed of the permutation, for a reproducible order.
            num_blocks: Accepted for compatibility with Ray; ignored.
        """
        order = np.random.default_rng(seed).permutation(self._num_rows)
        return Dataset._build(self._columns, order=order)

    def split(self, n: int, *, equal: bool = False, locality_hints: Any = None) -> list[Dataset]:
        """``n`` contiguous shards.

        Args:
            n: Number of shards.
            equal: Give every shard ``count() // n`` rows; the last ``count() % n`` rows are
                left out (Ray's ``equal=True``). Otherwise shard sizes differ by at most one row.
            locality_hints: Accepted for compatibility with Ray; ignored.
        """
        n = check_positive_int("n", n)
        size, extra = divmod(self._num_rows, n)
        shards, start = [], 0
        for i in builtins.range(n):
            length = size + (0 if equal or i >= extra else 1)
            shards.append(self._slice(start, start + length))
            start += length
        return shards

    def split_at_indices(self, indices: list[int]) -> list[Dataset]:
        """Shards cut at the given row indices (``[2, 5]`` gives rows 0-1, 2-4 and 5-end)."""
        bounds = [min(check_positive_int("indices", i, 0), self._num_rows) for i in indices]
        if bounds != sorted(bounds):
            raise ValueError(f"`indices` must be sorted in ascending order, got {indices}.")
        edges = [0, *bounds, self._num_rows]
        return [self._slice(a, b) for a, b in zip(edges, edges[1:], strict=False)]

    def train_test_split(
        self, test_size: float | int, *, shuffle: bool = False, seed: int | None = None
    ) -> tuple[Dataset, Dataset]:
        """Split into a train and a test dataset; the test rows are the last ones.

        Args:
            test_size: A fraction of the rows (a float in (0, 1)) or a number of rows (an int).
            shuffle: Shuffle the rows first (with ``seed``).
            seed: Seed of the shuffle.
        """
        if isinstance(test_size, float):
            if not 0 < test_size < 1:
                raise ValueError(f"A float `test_size` must be between 0 and 1, got {test_size}.")
            test_rows = int(self._num_rows * test_size)
        else:
            test_rows = check_positive_int("test_size", test_size, 0)
            if test_rows > self._num_rows:
                raise ValueError(f"`test_size={test_rows}` is more than the dataset's {self._num_rows} rows.")
        source = self.random_shuffle(seed=seed) if shuffle else self
        train, test = source.split_at_indices([self._num_rows - test_rows])
        return train, test

    # ----------------------------------------------------------------- reading
    def iterator(self) -> DataIterator:
        """A :class:`DataIterator` over every row."""
        return DataIterator(self)

    def streaming_split(self, n: int, *, equal: bool = False, locality_hints: Any = None) -> list[DataIterator]:
        """One :class:`DataIterator` per shard of :meth:`split`."""
        return [shard.iterator() for shard in self.split(n, equal=equal)]

    def iter_rows(self, **kwargs: Any) -> Iterator[dict[str, Any]]:
        """The rows one by one, as dicts; see :meth:`DataIterator.iter_rows`."""
        return self.iterator().iter_rows(**kwargs)

    def iter_batches(self, **kwargs: Any) -> Any:
        """Batches of rows; same arguments as :meth:`DataIterator.iter_batches`."""
        return self.iterator().iter_batches(**kwargs)

    def iter_torch_batches(self, **kwargs: Any) -> Any:
        """Batches of torch tensors; same arguments as :meth:`DataIterator.iter_torch_batches`."""
        return self.iterator().iter_torch_batches(**kwargs)

    def to_torch(self, **kwargs: Any) -> Any:
        """A torch ``IterableDataset``; same arguments as :meth:`DataIterator.to_torch`."""
        return self.iterator().to_torch(**kwargs)

    # ----------------------------------------------------------------- shipping to workers
    def _describe(
        self, start: int, stop: int, share: bool = True
    ) -> tuple[dict[str, ColumnRef], dict[str, np.ndarray]]:
        """Rows ``start:stop``: references to the columns in shared memory (none without
        ``share``), and the other columns' values (which must be pickled)."""
        shared, inline = {}, {}
        for name, column in self._columns.items():
            part = column[start:stop]
            ref = None
            if share and len(part):
                ref = next((r for b in self._buffers if (r := b.locate(part)) is not None), None)
            if ref is None:
                inline[name] = part
            else:
                shared[name] = ref
        return shared, inline

    def __repr__(self) -> str:
        schema = ", ".join(f"{name}: {type_name(c.dtype, tuple(c.shape[1:]))}" for name, c in self._columns.items())
        return f"Dataset(num_rows={self._num_rows}, schema={{{schema}}})"
