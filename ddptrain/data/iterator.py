"""``DataIterator``: one worker's view of a dataset, read in batches once per epoch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ddptrain.data import _tf
from ddptrain.data._batching import BATCH_FORMATS, to_pandas
from ddptrain.data._passes import PassOptions, PassStats, run_pass
from ddptrain.data._rows import Schema, check_positive_int, row_dicts

if TYPE_CHECKING:
    import torch

    from ddptrain.data.dataset import Dataset

__all__ = ["DataIterator"]

_ROWS_PER_CHUNK = 1024


class _Iterable:
    """An iterable that starts a new pass over the shard each time it is iterated."""

    def __init__(self, start: Callable[[], Iterator[Any]]) -> None:
        self._start = start

    def __iter__(self) -> Iterator[Any]:
        return self._start()


class DataIterator:
    """The rows of one dataset shard, to read in batches (Ray Data's ``DataIterator``).

    ``ddptrain.get_dataset_shard(name)`` returns one in each worker. It can be read any number
    of times: each ``iter_*`` call (or each ``for`` over what it returns) is a new pass over
    the shard, so call it once per epoch.

    Batches are views of the shard's memory whenever they can be (rows in order, no dtype
    change, on the CPU): no bytes are copied. An in-place change to such a batch (``x -= 1``,
    ``t.add_(1)``) therefore changes this worker's copy of those rows for later epochs (never
    another worker's: the shared memory is mapped copy-on-write). Use out-of-place operations,
    or ``.clone()`` the batch, if you modify it.

    Per-epoch shuffling: with ``local_shuffle_buffer_size`` every pass draws its batches at
    random from a buffer of that many rows (a buffer of ``count()`` rows or more shuffles the
    whole shard). Without ``local_shuffle_seed`` every pass has a new order. With a fixed seed
    every pass has the same order, as in Ray; for an order that is new each epoch and still
    reproducible, pass a seed that changes with the epoch (``local_shuffle_seed=seed + epoch``).
    Rows never move between shards during a run; shuffle the dataset before training
    (``random_shuffle``) to mix them across workers.
    """

    def __init__(self, dataset: Dataset, description: str | None = None) -> None:
        self._dataset = dataset
        self._description = description or "dataset"
        self._stats = PassStats()

    # ----------------------------------------------------------------- facts
    def count(self) -> int:
        """Rows in this shard."""
        return self._dataset.count()

    def schema(self) -> Schema:
        """Column names and types."""
        return self._dataset.schema()

    def materialize(self) -> Dataset:
        """This shard as a :class:`Dataset` (sharing its memory)."""
        return self._dataset

    def stats(self) -> str:
        """How much was read, and how long the training loop waited for batches."""
        s = self._stats
        per_batch = f" ({s.wait_s / s.batches * 1e3:.3f} ms per batch)" if s.batches else ""
        return (
            f"DataIterator over {self._description}: {self.count():,} rows, "
            f"{self._dataset.size_bytes() / 2**20:.1f} MiB in {len(self._dataset.columns())} column(s)\n"
            f"* passes started: {s.passes}; batches: {s.batches:,}; rows: {s.rows:,}\n"
            f"* time waiting for batches: {s.wait_s:.3f} s{per_batch}"
        )

    def __repr__(self) -> str:
        return f"DataIterator({self._description}, {self._dataset!r})"

    # ----------------------------------------------------------------- one pass
    def _pass(
        self,
        options: PassOptions,
        finish: Callable[[dict[str, np.ndarray]], Any] | None,
        *,
        costly: bool,
        per_column: Callable[[np.ndarray], Any] | None = None,
    ) -> Iterator[Any]:
        """One pass over this shard, counted in :meth:`stats` (see ``_passes.run_pass``)."""
        dataset = self._dataset
        return run_pass(
            dataset._columns, dataset.count(), self._stats, options, finish, costly=costly, per_column=per_column
        )

    # ----------------------------------------------------------------- Ray's methods
    def iter_batches(
        self,
        *,
        prefetch_batches: int = 1,
        batch_size: int | None = 256,
        batch_format: str | None = "default",
        drop_last: bool = False,
        local_shuffle_buffer_size: int | None = None,
        local_shuffle_seed: int | None = None,
    ) -> Iterable[Any]:
        """Batches of rows.

        Args:
            prefetch_batches: Batches prepared ahead in a background thread when preparing one
                costs something (a shuffle, a pandas conversion); ``0`` prepares each batch
                when asked. Batches of rows in order are views and are never prefetched.
            batch_size: Rows per batch; ``None`` gives the whole shard as one batch. The last
                batch may be smaller unless ``drop_last``.
            batch_format: ``"default"`` or ``"numpy"``: a dict of numpy arrays per column;
                ``"pandas"``: a DataFrame.
            drop_last: Leave out a last batch smaller than ``batch_size``.
            local_shuffle_buffer_size: Draw batches at random from a buffer of at least this
                many rows (see the class docs for per-epoch shuffling).
            local_shuffle_seed: Seed of that shuffle.

        Returns:
            An iterable; each ``for`` over it is a new pass over the shard.
        """
        options = PassOptions(batch_size, drop_last, local_shuffle_buffer_size, local_shuffle_seed, prefetch_batches)
        fmt = "default" if batch_format is None else batch_format
        if fmt not in BATCH_FORMATS:
            raise ValueError(
                f"`batch_format` must be one of {', '.join(map(repr, BATCH_FORMATS))}, got {batch_format!r}."
            )
        finish = to_pandas if fmt == "pandas" else None
        return _Iterable(lambda: self._pass(options, finish, costly=finish is not None))

    def iter_torch_batches(
        self,
        *,
        prefetch_batches: int = 1,
        batch_size: int | None = 256,
        dtypes: torch.dtype | dict[str, torch.dtype] | None = None,
        device: Any = "auto",
        collate_fn: Callable[[dict[str, np.ndarray]], Any] | None = None,
        drop_last: bool = False,
        local_shuffle_buffer_size: int | None = None,
        local_shuffle_seed: int | None = None,
        pin_memory: bool = False,
    ) -> Iterable[Any]:
        """Batches as torch tensors: ``{column: tensor}`` by default.

        Numeric columns become tensors without a copy (``torch.from_numpy``) unless a dtype
        change, a shuffle or a device move needs one. Columns of Python objects are collated
        with ``torch.utils.data.default_collate``; string columns stay lists of ``str``.

        Args:
            prefetch_batches: Batches prepared ahead in a background thread when preparing one
                costs something (a shuffle, a dtype cast, a ``collate_fn``, a device copy).
            batch_size: Rows per batch (``None``: the whole shard).
            dtypes: A torch dtype for every column, or a dict of dtypes per column.
            device: ``"auto"`` (the default) is this worker's device (``ddptrain.torch.get_device()``)
                inside a training function, and the CPU elsewhere. With a ``collate_fn``,
                ``"auto"`` leaves the batch where ``collate_fn`` put it.
            collate_fn: Builds the batch from the numpy batch (a dict of arrays) instead;
                cannot be combined with ``dtypes``.
            drop_last: Leave out a last batch smaller than ``batch_size``.
            local_shuffle_buffer_size: As in :meth:`iter_batches`.
            local_shuffle_seed: As in :meth:`iter_batches`.
            pin_memory: Copy batches through pinned memory to a CUDA device (ignored for the CPU).
        """
        options = PassOptions(batch_size, drop_last, local_shuffle_buffer_size, local_shuffle_seed, prefetch_batches)
        from ddptrain.data import _torch  # imports torch, which `import ddptrain` must not

        if collate_fn is not None and dtypes is not None:
            raise ValueError(
                "`collate_fn` cannot be combined with `dtypes`: convert the tensors to the dtypes "
                "you want inside `collate_fn`."
            )
        target = None if collate_fn is not None and device == "auto" else _torch.resolve_device(device)
        columns = self._dataset._columns
        plain = collate_fn is None and dtypes is None and _torch.all_tensor_kinds(columns)
        # Plain numeric columns: each becomes a tensor on the same memory (torch.from_numpy).
        per_column = _torch.from_numpy if plain else None
        convert = None if plain else collate_fn or _torch.tensor_converter(columns, dtypes)
        to_device = target is not None and target.type != "cpu"
        finish = _torch.moved(convert, target, pin_memory) if to_device and target is not None else convert
        return _Iterable(lambda: self._pass(options, finish, costly=to_device or not plain, per_column=per_column))

    def iter_rows(self, *, prefetch_batches: int = 1, prefetch_blocks: int = 0) -> Iterator[dict[str, Any]]:
        """The rows one by one, as dicts (Python scalars for scalar columns)."""
        self._stats.passes += 1
        columns, num_rows = self._dataset._columns, self._dataset.count()
        for start in range(0, num_rows, _ROWS_PER_CHUNK):
            rows = row_dicts(columns, start, min(start + _ROWS_PER_CHUNK, num_rows))
            self._stats.rows += len(rows)
            yield from rows

    def to_torch(
        self,
        *,
        label_column: str | None = None,
        feature_columns: list[str] | list[list[str]] | dict[str, list[str]] | None = None,
        label_column_dtype: torch.dtype | None = None,
        feature_column_dtypes: Any = None,
        batch_size: int = 1,
        prefetch_batches: int = 1,
        drop_last: bool = False,
        local_shuffle_buffer_size: int | None = None,
        local_shuffle_seed: int | None = None,
        unsqueeze_label_tensor: bool = True,
        unsqueeze_feature_tensors: bool = True,
    ) -> torch.utils.data.IterableDataset[Any]:
        """A torch ``IterableDataset`` of ``(features, label)`` batches (Ray's ``to_torch``).

        ``features`` is one tensor ``(N, k)`` of ``feature_columns`` side by side (default:
        every column but the label), a list of such tensors for a list of lists, or a dict of
        them for a dict of lists. ``label`` is ``(N, 1)`` (``(N,)`` without
        ``unsqueeze_label_tensor``), or ``None`` without a ``label_column``. Each pass over the
        returned dataset is a pass over the shard. Iterate it directly (or through a
        ``DataLoader`` with ``batch_size=None`` and no worker processes): each DataLoader
        worker process would read the whole shard again.
        """
        from ddptrain.data import _torch  # imports torch, which `import ddptrain` must not

        known = self._dataset.columns()
        if label_column is not None and label_column not in known:
            raise ValueError(f"`label_column` {label_column!r} is not a column; the columns are {known}.")
        groups: Any = feature_columns or [c for c in known if c != label_column]
        flat = [c for g in (groups.values() if isinstance(groups, dict) else [groups]) for c in g]
        flat = [c for item in flat for c in ([item] if isinstance(item, str) else item)]
        unknown = [c for c in flat if c not in known]
        if unknown:
            raise ValueError(f"`feature_columns` names unknown column(s) {unknown}; the columns are {known}.")
        batches = self.iter_batches(
            prefetch_batches=prefetch_batches,
            batch_size=batch_size,
            drop_last=drop_last,
            local_shuffle_buffer_size=local_shuffle_buffer_size,
            local_shuffle_seed=local_shuffle_seed,
        )

        def dtype_of(key: Any, index: int) -> Any:
            if isinstance(feature_column_dtypes, dict):
                return feature_column_dtypes.get(key)
            if isinstance(feature_column_dtypes, (list, tuple)):
                return feature_column_dtypes[index]
            return feature_column_dtypes

        def features(batch: dict[str, np.ndarray]) -> Any:
            unsqueeze = unsqueeze_feature_tensors
            if isinstance(groups, dict):
                return {
                    k: _torch.feature_tensor(batch, list(v), dtype_of(k, i), unsqueeze)
                    for i, (k, v) in enumerate(groups.items())
                }
            if groups and not isinstance(groups[0], str):
                return [_torch.feature_tensor(batch, list(g), dtype_of(i, i), unsqueeze) for i, g in enumerate(groups)]
            return _torch.feature_tensor(batch, list(groups), dtype_of(None, 0), unsqueeze)

        def generate() -> Iterator[Any]:
            for batch in batches:
                label = None
                if label_column is not None:
                    label = _torch.feature_tensor(batch, [label_column], label_column_dtype, unsqueeze_label_tensor)
                yield features(batch), label

        return _torch.TorchIterableDataset(generate)

    def iter_tf_batches(self, **kwargs: Any) -> Any:
        """Not supported: ddptrain trains with PyTorch."""
        raise NotImplementedError("`iter_tf_batches` is not supported by ddptrain; use `iter_batches()`.")

    def to_tf(
        self,
        feature_columns: str | list[str],
        label_columns: str | list[str],
        *,
        additional_columns: str | list[str] | None = None,
        prefetch_batches: int = 1,
        batch_size: int = 1,
        drop_last: bool = False,
        local_shuffle_buffer_size: int | None = None,
        local_shuffle_seed: int | None = None,
        feature_type_spec: Any = None,
        label_type_spec: Any = None,
        additional_type_spec: Any = None,
    ) -> Any:
        """A ``tf.data.Dataset`` of ``(features, labels)`` batches, to pass to Keras ``fit``
        (Ray's ``to_tf``).

        A column name gives one tensor of shape ``(batch, *row_shape)`` with the column's dtype;
        a list of names gives a dict ``{name: tensor}`` (for a model with named inputs). String
        columns become ``tf.string``. With ``additional_columns`` the elements are
        ``(features, labels, additional)``. Each pass over the returned dataset (each Keras
        epoch) is a new pass over the shard. TensorFlow's auto-sharding is off: the rows are
        already this worker's shard.

        Args:
            feature_columns: The feature column, or a list of them.
            label_columns: The label column, or a list of them.
            additional_columns: More columns to yield third (e.g. sample weights).
            prefetch_batches: As in :meth:`iter_batches`.
            batch_size: Rows per batch.
            drop_last: Leave out a last batch smaller than ``batch_size``.
            local_shuffle_buffer_size: As in :meth:`iter_batches`.
            local_shuffle_seed: As in :meth:`iter_batches`.
            feature_type_spec: A ``tf.TypeSpec`` (a dict of them for a list of columns) to use
                instead of the one read from the schema; likewise ``label_type_spec`` and
                ``additional_type_spec``.

        Raises:
            ValueError: A column does not exist, or holds Python objects other than strings
                and no type spec was given for it.
            ImportError: TensorFlow is not installed.

        Example:
            >>> data = ddptrain.get_dataset_shard("train").to_tf("x", "y", batch_size=32)
            >>> model.fit(data, epochs=3)
        """
        try:
            import tensorflow as tf
        except ImportError:
            raise ImportError("`to_tf` needs TensorFlow: `pip install ddptrain[tensorflow]`.") from None
        check_positive_int("batch_size", batch_size)
        batches = self.iter_batches(
            prefetch_batches=prefetch_batches,
            batch_size=batch_size,
            drop_last=drop_last,
            local_shuffle_buffer_size=local_shuffle_buffer_size,
            local_shuffle_seed=local_shuffle_seed,
        )
        columns = [(feature_columns, feature_type_spec), (label_columns, label_type_spec)]
        if additional_columns is not None:
            columns.append((additional_columns, additional_type_spec))
        return _tf.tf_dataset(tf, self.schema(), self._dataset._columns, batches, columns)
