"""One pass over a shard: the batches of one epoch, produced, timed and counted.

``DataIterator`` decides what a batch becomes (numpy arrays, a DataFrame, tensors); this module
owns how a pass hands them out: the checks on the options every ``iter_*`` call shares, the
fast path of views on consecutive rows, the planned path (a shuffle gather or costly
formatting, optionally in a prefetch thread), and the counters behind ``DataIterator.stats()``.
Which rows go in each batch, and the prefetch thread itself, belong to ``_batching``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddptrain.data._batching import batch_plan, gather, prefetch
from ddptrain.data._rows import check_positive_int

__all__ = ["PassOptions", "PassStats", "run_pass"]


@dataclass(frozen=True)
class PassOptions:
    """The batching options of one ``iter_*`` call.

    Checked when the call is made rather than at the first batch, so a bad value fails on the
    line that passed it. The messages use the argument names of the public methods.
    """

    batch_size: int | None
    drop_last: bool
    shuffle_buffer_size: int | None
    shuffle_seed: int | None
    prefetch_batches: int

    def __post_init__(self) -> None:
        if self.batch_size is not None:
            check_positive_int("batch_size", self.batch_size)
        if not isinstance(self.drop_last, bool):
            raise ValueError(f"`drop_last` must be True or False, got {self.drop_last!r}.")
        if self.shuffle_buffer_size is not None:
            check_positive_int("local_shuffle_buffer_size", self.shuffle_buffer_size)
            if self.batch_size is None:
                raise ValueError("`local_shuffle_buffer_size` needs a `batch_size`; set one (e.g. `batch_size=256`).")
        if self.shuffle_seed is not None:
            check_positive_int("local_shuffle_seed", self.shuffle_seed, 0)
        check_positive_int("prefetch_batches", self.prefetch_batches, 0)


@dataclass
class PassStats:
    """Totals over every pass of one iterator, for ``DataIterator.stats()``."""

    passes: int = 0
    batches: int = 0
    rows: int = 0
    wait_s: float = 0.0


def run_pass(
    columns: Mapping[str, np.ndarray],
    num_rows: int,
    stats: PassStats,
    options: PassOptions,
    finish: Callable[[dict[str, np.ndarray]], Any] | None,
    *,
    costly: bool,
    per_column: Callable[[np.ndarray], Any] | None = None,
) -> Iterator[Any]:
    """The batches of one pass over ``columns``, counted and timed in ``stats``.

    Each batch is ``{column: per_column(rows)}``, then given to ``finish``. A background thread
    prepares ``options.prefetch_batches`` batches ahead when preparing one does real work (a
    shuffle gather, or ``costly`` formatting); batches of rows in order are views, which cost
    less to make than handing them over from a thread would.
    """
    stats.passes += 1
    if options.shuffle_buffer_size is None and not (options.prefetch_batches > 0 and costly):
        return _views_in_order(columns, num_rows, stats, options, finish, per_column)

    def produce() -> Iterator[tuple[int, Any]]:
        o = options
        for selection in batch_plan(num_rows, o.batch_size, o.drop_last, o.shuffle_buffer_size, o.shuffle_seed):
            batch = gather(columns, selection)
            if per_column is not None:
                batch = {name: per_column(values) for name, values in batch.items()}
            rows = len(next(iter(batch.values()))) if batch else 0
            yield rows, (finish(batch) if finish is not None else batch)

    depth = options.prefetch_batches
    return _timed(stats, prefetch(produce, depth) if depth > 0 else produce())


def _timed(stats: PassStats, source: Iterator[tuple[int, Any]]) -> Iterator[Any]:
    """The batches of ``source`` (``(rows, batch)`` pairs), with the time the loop waited."""
    clock = time.perf_counter
    started = clock()
    for rows, out in source:
        stats.wait_s += clock() - started
        stats.batches += 1
        stats.rows += rows
        yield out
        started = clock()


def _views_in_order(
    columns: Mapping[str, np.ndarray],
    num_rows: int,
    stats: PassStats,
    options: PassOptions,
    finish: Callable[[dict[str, np.ndarray]], Any] | None,
    per_column: Callable[[np.ndarray], Any] | None,
) -> Iterator[Any]:
    """The fast path: batches of consecutive rows, made of views on the shard."""
    items = list(columns.items())
    size = options.batch_size or max(num_rows, 1)
    clock = time.perf_counter
    started = clock()
    for start in range(0, num_rows, size):
        stop = start + size
        if stop > num_rows:
            if options.drop_last:
                return
            stop = num_rows
        if per_column is None:
            batch = {name: column[start:stop] for name, column in items}
        else:
            batch = {name: per_column(column[start:stop]) for name, column in items}
        out = batch if finish is None else finish(batch)
        stats.wait_s += clock() - started
        stats.batches += 1
        stats.rows += stop - start
        yield out
        started = clock()
