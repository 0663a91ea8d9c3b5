"""Constants and meters of RaySGD (``ray.util.sgd.utils``).

``BATCH_SIZE`` is the config key of a *global* batch size, which :class:`TorchTrainer` divides
among the workers; ``NUM_SAMPLES`` is the metric a ``train_batch`` uses to say how many samples
its batch had (the weight of its metrics in the averages).
"""

from __future__ import annotations

import collections
import contextlib
import numbers
import time
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["BATCH_COUNT", "BATCH_SIZE", "NUM_SAMPLES", "AverageMeter", "AverageMeterCollection", "TimerCollection"]

BATCH_SIZE = "*batch_size"
NUM_SAMPLES = "num_samples"
BATCH_COUNT = "batch_count"
_NULL = contextlib.nullcontext()


class AverageMeter:
    """The running (weighted) mean of one metric, and its last value.

    Example:
        >>> meter = AverageMeter()
        >>> meter.update(1.0, n=3); meter.update(2.0, n=1)
        >>> meter.avg, meter.val, meter.count
        (1.25, 2.0, 4)
    """

    def __init__(self) -> None:
        self.val: float = 0.0
        self.avg: float = 0.0
        self.sum: float = 0.0
        self.count: int = 0

    def reset(self) -> None:
        """Forget every value."""
        self.__init__()  # type: ignore[misc]

    def update(self, val: float, n: int = 1) -> None:
        """Add ``val`` with weight ``n`` (the number of samples it was measured on)."""
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count if self.count else 0.0


class AverageMeterCollection:
    """Per-batch metrics averaged over an epoch, each batch weighted by its sample count.

    ``summary()`` gives ``batch_count``, ``num_samples``, and for every metric ``m`` its mean
    ``m`` and its last value ``last_m`` (what RaySGD's ``train_epoch`` returns).

    Example:
        >>> meters = AverageMeterCollection()
        >>> meters.update({"loss": 1.0}, n=3); meters.update({"loss": 2.0}, n=1)
        >>> meters.summary()
        {'batch_count': 2, 'num_samples': 4, 'loss': 1.25, 'last_loss': 2.0}
    """

    def __init__(self) -> None:
        self._batch_count = 0
        self.n = 0
        self._meters: dict[str, AverageMeter] = collections.defaultdict(AverageMeter)

    def update(self, metrics: Mapping[str, Any], n: int = 1) -> None:
        """Add one batch's metrics, measured on ``n`` samples."""
        self._batch_count += 1
        self.n += n
        for metric, value in metrics.items():
            self._meters[metric].update(value, n=n)

    def summary(self) -> dict[str, Any]:
        """``batch_count``, ``num_samples``, and each metric's mean and ``last_`` value."""
        stats: dict[str, Any] = {BATCH_COUNT: self._batch_count, NUM_SAMPLES: self.n}
        for metric, meter in self._meters.items():
            stats[str(metric)] = meter.avg
            stats["last_" + str(metric)] = meter.val
        return stats


class TimerCollection:
    """Named timers for ``profile=True`` (``with timers.record("fwd"): ...``).

    Timing is on only while profiling; ``stats()`` gives ``mean_<name>_s`` of each timer.
    """

    def __init__(self) -> None:
        self.enabled = False
        self._totals: dict[str, float] = collections.defaultdict(float)
        self._counts: dict[str, int] = collections.defaultdict(int)

    def reset(self) -> None:
        self._totals.clear()
        self._counts.clear()

    def record(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time the block under ``name`` (a no-op while profiling is off)."""
        return self._record(name) if self.enabled else _NULL

    @contextlib.contextmanager
    def _record(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[name] += time.perf_counter() - start
            self._counts[name] += 1

    def stats(self) -> dict[str, float]:
        """``{"mean_<name>_s": seconds}`` for every timer that ran."""
        return {f"mean_{name}_s": self._totals[name] / self._counts[name] for name in self._totals}


def reduce_worker_stats(worker_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One dict from every worker's stats, as RaySGD did: ``num_samples`` summed, other
    numbers averaged over workers (weighted by each worker's ``num_samples`` when all have
    one, so that the result is the mean over every sample; ``epoch`` and ``batch_count`` are
    plain means), anything else (nested dicts, strings) taken from worker 0."""
    if not worker_stats:
        return {}
    samples: list[Any] = [s.get(NUM_SAMPLES) for s in worker_stats]
    weighted = all(_is_number(n) for n in samples) and sum(samples) > 0
    stats: dict[str, Any] = {}
    if any(n is not None for n in samples):
        stats[NUM_SAMPLES] = sum(n for n in samples if _is_number(n))
    for key, first in worker_stats[0].items():
        if key == NUM_SAMPLES:
            continue
        if _is_number(first):
            pairs = [(s[key], n) for s, n in zip(worker_stats, samples, strict=True) if _is_number(s.get(key))]
            if weighted and key not in ("epoch", BATCH_COUNT):
                total = sum(n for _, n in pairs)
                stats[key] = sum(v * n for v, n in pairs) / total if total else float("nan")
            elif all(v == pairs[0][0] for v, _ in pairs):
                stats[key] = pairs[0][0]  # every worker agrees (the epoch): keep its type
            else:
                stats[key] = sum(v for v, _ in pairs) / len(pairs)
        else:
            stats[key] = first
    return stats


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Number) and not isinstance(value, bool)
