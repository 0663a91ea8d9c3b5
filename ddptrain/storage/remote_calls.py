"""Calls to remote storage with a deadline, whatever the file system (driver and workers).

fsspec file systems wait as long as their library lets them: s3fs on an endpoint that accepts
connections and never answers retries for many minutes, and other backends may wait forever.
So every call ddptrain makes to a store runs in a helper thread, and the caller waits for it
with a deadline:

* a call fails with :class:`~ddptrain.errors.StorageError` when it has gone
  ``DDPTRAIN_STORAGE_TIMEOUT_S`` seconds without an answer. A transfer counts progress: what
  the file system reports (s3fs, gcsfs and adlfs report every part), and for a download the
  local file growing. Bytes not reported yet get one more second per MiB (so a single large
  request, or a file system that reports nothing, is not cut while it works), counting at most
  64 MiB ahead for one that does report;
* the thread of a call that timed out cannot be stopped (Python threads cannot be killed): it is
  left to finish in the background, and until it does, further calls of this process to the same
  file system fail at once, naming the call that is stuck (so an unanswering store costs one
  timeout, not one per call);
* the wait is interruptible (Ctrl-C), and a caller that is stopping anyway (``stopping=True``:
  the driver after Ctrl-C) gets a bound of a few seconds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ddptrain import _env
from ddptrain.errors import ConfigError, StorageError

__all__ = ["Watch", "call", "local_size", "progress_callback", "stopping_timeout_s", "timeout_s"]

_logger = logging.getLogger(__name__)

T = TypeVar("T")

_MIN_RATE = float(1 << 20)  # bytes per second a transfer is allowed at the slowest, for bytes not reported yet
_REPORTED_AHEAD = 64 << 20  # ... counting at most this far ahead when the file system reports progress
_STOPPING_S = 3.0  # the bound of each call once the caller is stopping (Ctrl-C)
_TICK_S = 0.2


def stopping_timeout_s() -> float:
    """The bound of each call of a caller that is stopping anyway."""
    return min(_STOPPING_S, timeout_s())


def timeout_s() -> float:
    """The bound of each call: ``DDPTRAIN_STORAGE_TIMEOUT_S``.

    Raises:
        ConfigError: It is not a number > 0.
    """
    try:
        return _env.storage_timeout_s()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class Watch:
    """The progress of one call, which the helper thread and the waiting caller share.

    Args:
        timeout_s: How long the call may go without progress.
        size: The bytes it transfers (0: not a transfer).
    """

    def __init__(self, timeout_s: float, size: int = 0) -> None:
        self.timeout_s = timeout_s
        self.size = size
        self.moved_at = time.monotonic()
        self.reported = 0  # bytes the file system said it moved
        self.reports = False  # whether it says anything
        self._observe: Callable[[], int] | None = None
        self._observed = -1

    def progress(self, nbytes: int = 0) -> None:
        """The call moved on (``nbytes`` more bytes moved)."""
        self.moved_at = time.monotonic()
        self.reported += nbytes
        self.reports = True

    def observe(self, count: Callable[[], int]) -> None:
        """Also count a change of ``count()`` (e.g. the size of the file being downloaded) as progress."""
        self._observe = count

    def _poll(self) -> None:
        if self._observe is None:
            return
        try:
            now = self._observe()
        except OSError:
            return
        if now != self._observed:
            self._observed = now
            self.moved_at = time.monotonic()

    def deadline(self) -> float:
        self._poll()
        ahead = max(self.size - self.reported, 0)
        if self.reports:
            ahead = min(ahead, _REPORTED_AHEAD)
        return self.moved_at + self.timeout_s + ahead / _MIN_RATE


def progress_callback(watch: Watch) -> Any:
    """An fsspec callback that tells ``watch`` about every step a transfer reports."""
    from fsspec.callbacks import Callback  # fsspec is optional: only runs on remote storage import it

    class _Progress(Callback):
        def set_size(self, size: Any) -> None:
            super().set_size(size)
            watch.progress()

        def relative_update(self, inc: int = 1) -> None:
            super().relative_update(inc)
            watch.progress(int(inc or 0))

        def absolute_update(self, value: int) -> None:
            before = self.value or 0
            super().absolute_update(value)
            watch.progress(max(int(value or 0) - int(before), 0))

    return _Progress()


@dataclass
class _Stuck:
    what: str
    since: float


# The calls that timed out and have not returned yet, by file system (``id(fs)``: the stuck
# thread holds the file system, so its id is not reused while the entry exists).
_stuck: dict[int, _Stuck] = {}
_lock = threading.Lock()


def call(
    fs: Any,
    store: str,
    what: str,
    fn: Callable[[Watch], T],
    *,
    size: int = 0,
    stopping: bool = False,
) -> T:
    """``fn(watch)`` in a helper thread, with a deadline: its result, or its exception.

    Args:
        fs: The file system ``fn`` calls (calls to it fail at once while one of them is stuck).
        store: The store, as users know it (``s3://bucket/prefix``), for messages.
        what: The call, for messages (``"uploading s3://bucket/run/run.json"``).
        fn: The call; it reports progress on the :class:`Watch` it is given.
        size: The bytes it transfers (gives a large transfer more time, see the module's doc).
        stopping: The caller is stopping anyway: a bound of a few seconds.

    Raises:
        StorageError: ``fs`` did not answer in time, or an earlier call to it has not returned.
        ConfigError: ``DDPTRAIN_STORAGE_TIMEOUT_S`` is not a number > 0.
    """
    bound_s = stopping_timeout_s() if stopping else timeout_s()
    key = id(fs)
    with _lock:
        stuck = _stuck.get(key)
    if stuck is not None:
        raise StorageError(
            f"{store} has not answered for {time.monotonic() - stuck.since:.0f} s ({stuck.what} is still "
            f"waiting); not {what}.",
            timed_out=True,
        )
    watch = Watch(bound_s, size)
    done = threading.Event()
    box: dict[str, Any] = {}
    mine: list[_Stuck] = []

    def run() -> None:
        try:
            box["value"] = fn(watch)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        finally:
            with _lock:
                done.set()
                if mine and _stuck.get(key) is mine[0]:
                    del _stuck[key]
                    _logger.info("ddptrain: %s answered %s after all", store, mine[0].what)

    started = time.monotonic()
    threading.Thread(target=run, name="ddptrain-storage-call", daemon=True).start()
    try:
        while not done.wait(max(0.0, min(_TICK_S, watch.deadline() - time.monotonic()))):
            if time.monotonic() < watch.deadline():
                continue
            with _lock:
                if done.is_set():
                    break
                mine.append(_Stuck(what, started))
                _stuck[key] = mine[0]
            raise StorageError(
                f"{store} did not answer for {bound_s:g} s while {what} (the bound is DDPTRAIN_STORAGE_TIMEOUT_S"
                f"={timeout_s():g} s; the store may be overloaded or unreachable).",
                timed_out=True,
            )
    except BaseException:
        with _lock:  # interrupted (Ctrl-C) or timed out: the call goes on in the background
            if not done.is_set() and not mine:
                mine.append(_Stuck(what, started))
                _stuck[key] = mine[0]
        raise
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def local_size(path: str) -> Callable[[], int]:
    """``os.path.getsize(path)``, 0 while it does not exist: what a download has written so far."""

    def count() -> int:
        try:
            return os.path.getsize(path)
        except FileNotFoundError:
            return 0

    return count
