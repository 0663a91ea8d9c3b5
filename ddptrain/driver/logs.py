"""Worker output on the driver: one file per rank, and rank-prefixed lines on the console.

The sink never raises into the thread that relays a launcher's frames: a log file that cannot
be written (a full disk) is reported once through ``on_error`` and the attempt fails on it,
while that rank's later output is counted, echoed and kept in its tail, but not written.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from ddptrain.errors import disk_full_error
from ddptrain.storage.layout import RunLayout

__all__ = ["LogSink"]

_logger = logging.getLogger(__name__)

_TAIL_LINES = 30


class LogSink:
    """Writes each rank's output to ``<log_dir>/rank_<k>.log`` and echoes it with a prefix.

    Args:
        log_dir: Folder for this attempt's log files (``None``: the console only).
        labels: The console prefix of each rank, e.g. ``{0: "rank0"}``.
        echo_ranks: Ranks whose lines are copied to the driver's stdout/stderr (``None``: all).
        on_error: Called once, from the relaying thread, with the first write error: a
            :class:`~ddptrain.errors.DiskFullError` for a full disk, else the ``OSError``.
        console: Writes the echoed lines instead (``Progress.console_write``), so that they
            do not garble a status line.
    """

    def __init__(
        self,
        log_dir: Path | None,
        labels: dict[int, str],
        echo_ranks: set[int] | None = None,
        on_error: Callable[[OSError], None] | None = None,
        console: Any = None,
    ) -> None:
        self.log_dir = log_dir
        self.console = console  # writes echoed lines (``Progress.console_write``); None: plain writes
        self._labels = labels
        self._echo_ranks = echo_ranks
        self._files: dict[int, BinaryIO] = {}
        self._partial: dict[tuple[int, bytes], bytes] = {}
        self._tails: dict[int, collections.deque[str]] = {}
        self._lock = threading.Lock()
        self._on_error = on_error
        self._error: OSError | None = None
        self._closed = False
        self.dropped: dict[int, int] = {}  # bytes of each rank's output that reached no file
        self.last_write = time.monotonic()  # when a rank last printed anything
        self._open_files()

    def _open_files(self) -> None:
        if self.log_dir is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank in self._labels:  # every rank gets its file, even one that prints nothing
            self._files[rank] = open(self.log_dir / RunLayout.rank_log_name(rank), "ab")  # noqa: SIM115 (closed in close())

    def path(self, rank: int) -> str | None:
        """The log file of ``rank`` (``None`` when output goes to the console only)."""
        return None if self.log_dir is None else str(self.log_dir / RunLayout.rank_log_name(rank))

    def retarget(self, log_dir: Path | None) -> None:
        """Write from now on to files in ``log_dir`` (a warm group starting its next run)."""
        self.flush_partial()
        with self._lock:
            self._close_files()
            self.log_dir = log_dir
            self._tails.clear()
            self._error = None
            self._open_files()

    def write(self, rank: int, stream: bytes, data: bytes) -> None:
        """Take a chunk of a rank's stdout (``b"O"``) or stderr (``b"E"``)."""
        self.last_write = time.monotonic()
        with self._lock:
            if self._closed:
                return
            if rank in self.dropped:
                self.dropped[rank] += len(data)
            else:
                self._write_file(rank, data)
            buffered = self._partial.pop((rank, stream), b"") + data
            *lines, rest = buffered.split(b"\n")
            if rest:
                self._partial[(rank, stream)] = rest
            for line in lines:
                self._emit(rank, stream, line)

    def _write_file(self, rank: int, data: bytes) -> None:
        path = self.path(rank)
        if path is None:
            return
        try:
            file = self._files.get(rank)
            if file is None:
                file = self._files[rank] = open(path, "ab")  # noqa: SIM115 (closed in close())
            file.write(data)
            file.flush()
        except OSError as exc:
            self.dropped[rank] = len(data)
            broken = self._files.pop(rank, None)
            if broken is not None:
                try:
                    broken.close()  # its unwritten buffer goes
                except OSError:
                    pass
            if self._error is None:
                error: OSError | None = disk_full_error(exc, path)
                if error is None:
                    error = exc if exc.filename else OSError(exc.errno, exc.strerror, path)
                self._error = error
                if self._on_error is not None:
                    self._on_error(error)

    def _emit(self, rank: int, stream: bytes, line: bytes) -> None:
        text = line.decode("utf-8", errors="replace").rstrip("\r")
        self._tails.setdefault(rank, collections.deque(maxlen=_TAIL_LINES)).append(text)
        if self._echo_ranks is None or rank in self._echo_ranks:
            out: TextIO = sys.stdout if stream == b"O" else sys.stderr
            prefixed = f"[{self._labels.get(rank, f'rank{rank}')}] {text}\n"
            if self.console is not None:
                self.console.console_write(out, prefixed)
                return
            try:
                out.write(prefixed)
                out.flush()
            except (OSError, ValueError):
                pass

    def tail(self, rank: int) -> list[str]:
        """The last lines a rank printed."""
        with self._lock:
            return list(self._tails.get(rank, ()))

    def flush_partial(self) -> None:
        """Emit unterminated last lines (at the end of an attempt)."""
        with self._lock:
            for (rank, stream), rest in list(self._partial.items()):
                self._emit(rank, stream, rest)
            self._partial.clear()

    def close(self) -> None:
        """Flush and close every file (safe to call twice); later output is dropped."""
        self.flush_partial()
        with self._lock:
            self._closed = True
            self._close_files()

    def _close_files(self) -> None:
        for file in self._files.values():
            try:
                file.close()
            except OSError:
                pass
        self._files.clear()
        dropped, self.dropped = self.dropped, {}
        for rank, size in sorted(dropped.items()):
            _logger.warning(
                "ddptrain: %s misses the last %d bytes of rank %d's output: writing it failed",
                self.path(rank),
                size,
                rank,
            )
