"""Batches of a shard: which rows go in each batch (in order or through a shuffle buffer),
how a batch is formatted, and prefetching in a background thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    import pandas

__all__ = ["batch_plan", "gather", "to_pandas", "prefetch", "BATCH_FORMATS"]

T = TypeVar("T")

# Row selection of one batch: a slice (a view on the shard) or row indices (a gather).
Selection = slice | np.ndarray

BATCH_FORMATS = ("default", "numpy", "pandas")


def _in_order(num_rows: int, batch_size: int) -> Iterator[Selection]:
    for start in range(0, num_rows, batch_size):
        yield slice(start, min(start + batch_size, num_rows))


def _shuffled(num_rows: int, batch_size: int, buffer_size: int, rng: np.random.Generator) -> Iterator[Selection]:
    """Ray's local shuffle buffer over row indices: every batch is drawn at random from a
    buffer of at least ``buffer_size`` rows (while rows remain to fill it). The buffer is
    refilled ``buffer_size`` rows at a time and shuffled once per refill."""
    buffer = np.empty(0, dtype=np.int64)
    next_row = 0
    while True:
        if next_row < num_rows and len(buffer) < buffer_size + batch_size:
            stop = min(num_rows, next_row + max(buffer_size + batch_size - len(buffer), buffer_size))
            buffer = np.concatenate([buffer, np.arange(next_row, stop, dtype=np.int64)])
            next_row = stop
            rng.shuffle(buffer)
            continue
        if not len(buffer):
            return
        yield buffer[-batch_size:]
        buffer = buffer[:-batch_size]


def batch_plan(
    num_rows: int,
    batch_size: int | None,
    drop_last: bool,
    shuffle_buffer_size: int | None,
    shuffle_seed: int | None,
) -> Iterator[Selection]:
    """The row selection of every batch of one pass over ``num_rows`` rows."""
    size = batch_size if batch_size is not None else max(num_rows, 1)
    if shuffle_buffer_size is None:
        plan = _in_order(num_rows, size)
    else:
        plan = _shuffled(num_rows, size, shuffle_buffer_size, np.random.default_rng(shuffle_seed))
    for selection in plan:
        rows = selection.stop - selection.start if isinstance(selection, slice) else len(selection)
        if drop_last and rows < size:
            return
        yield selection


def gather(columns: Mapping[str, np.ndarray], selection: Selection) -> dict[str, np.ndarray]:
    """The batch's column arrays: views for a slice, new arrays for row indices."""
    if isinstance(selection, slice):
        return {name: column[selection] for name, column in columns.items()}
    return {name: np.take(column, selection, axis=0) for name, column in columns.items()}


def to_pandas(batch: Mapping[str, np.ndarray]) -> pandas.DataFrame:
    """A DataFrame of a numpy batch; a column of tensors holds one array per row."""
    try:
        import pandas
    except ImportError:
        raise ImportError("`batch_format='pandas'` needs pandas: `pip install pandas`.") from None
    return pandas.DataFrame({name: (c if c.ndim == 1 else list(c)) for name, c in batch.items()})


_END = object()


def prefetch(produce: Callable[[], Iterator[T]], depth: int) -> Iterator[T]:
    """Run ``produce()`` in a background thread, keeping up to ``depth`` items ready.

    The producer's exceptions are raised here; leaving the loop early stops the thread.
    """
    ready: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: tuple[bool, Any]) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in produce():
                if not put((True, item)):
                    return
            put((True, _END))
        except BaseException as exc:
            put((False, exc))

    thread = threading.Thread(target=run, name="ddptrain-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = ready.get()
            if not ok:
                raise item
            if item is _END:
                return
            yield item
    finally:
        stop.set()
        thread.join(timeout=5.0)
