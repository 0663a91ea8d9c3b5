"""One call per host, all at once: how the driver and ``ddptrain check`` reach several hosts."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["each_host"]

T = TypeVar("T")
R = TypeVar("R")


def each_host(
    fn: Callable[[T], R], items: Sequence[T], timeout_s: float | None = None, name: str = "ddptrain-host"
) -> list[R | BaseException]:
    """``fn(item)`` for every item, each in a thread of its own; the results in ``items``' order.

    A call that raised gives its exception in its place. With ``timeout_s``, a call still running
    after that long gives a ``TimeoutError`` (its thread, a daemon, is left to end by itself):
    callers bound each call themselves and use this only as the last word.
    """
    results: dict[int, R | BaseException] = {}

    def call(index: int, item: T) -> None:
        try:
            results[index] = fn(item)
        except BaseException as exc:  # given back in its place, with every other host's outcome
            results[index] = exc

    threads = [
        threading.Thread(target=call, args=(i, item), name=f"{name}-{i}", daemon=True) for i, item in enumerate(items)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    return [
        results[i] if i in results else TimeoutError(f"{name} {i} did not end within {timeout_s:g} s")
        for i in range(len(items))
    ]
