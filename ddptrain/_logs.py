"""Worker output on the driver: one file per rank, and rank-prefixed lines on the console."""

from __future__ import annotations

import collections
import sys
import threading
from pathlib import Path
from typing import BinaryIO, TextIO

__all__ = ["LogSink"]

_TAIL_LINES = 30


class LogSink:
    """Writes each rank's output to ``<log_dir>/rank_<k>.log`` and echoes it with a prefix.

    Args:
        log_dir: Folder for this attempt's log files.
        labels: The console prefix of each rank, e.g. ``{0: "rank0"}``.
        echo_ranks: Ranks whose lines are copied to the driver's stdout/stderr (``None``: all).
    """

    def __init__(self, log_dir: Path, labels: dict[int, str], echo_ranks: set[int] | None = None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._labels = labels
        self._echo_ranks = echo_ranks
        self._files: dict[int, BinaryIO] = {}
        self._partial: dict[tuple[int, bytes], bytes] = {}
        self._tails: dict[int, collections.deque[str]] = {}
        self._lock = threading.Lock()
        for rank in labels:  # every rank gets its file, even one that prints nothing
            self._files[rank] = open(self.path(rank), "ab")  # noqa: SIM115 (closed in close())

    def path(self, rank: int) -> str:
        """The log file of ``rank``."""
        return str(self.log_dir / f"rank_{rank}.log")

    def write(self, rank: int, stream: bytes, data: bytes) -> None:
        """Take a chunk of a rank's stdout (``b"O"``) or stderr (``b"E"``)."""
        with self._lock:
            file = self._files.get(rank)
            if file is None:
                file = self._files[rank] = open(self.path(rank), "ab")  # noqa: SIM115 (closed in close())
            file.write(data)
            file.flush()
            buffered = self._partial.pop((rank, stream), b"") + data
            *lines, rest = buffered.split(b"\n")
            if rest:
                self._partial[(rank, stream)] = rest
            for line in lines:
                self._emit(rank, stream, line)

    def _emit(self, rank: int, stream: bytes, line: bytes) -> None:
        text = line.decode("utf-8", errors="replace").rstrip("\r")
        self._tails.setdefault(rank, collections.deque(maxlen=_TAIL_LINES)).append(text)
        if self._echo_ranks is None or rank in self._echo_ranks:
            out: TextIO = sys.stdout if stream == b"O" else sys.stderr
            try:
                out.write(f"[{self._labels.get(rank, f'rank{rank}')}] {text}\n")
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
        """Flush and close every file (safe to call twice)."""
        self.flush_partial()
        with self._lock:
            for file in self._files.values():
                file.close()
            self._files.clear()
