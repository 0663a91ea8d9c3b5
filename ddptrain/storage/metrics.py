"""Reading a run's ``metrics.jsonl`` (through :mod:`ddptrain.storage.run_files`), and the summary of it
the driver keeps for its readers.

``metrics.jsonl`` grows by a line per report, without bound. What ``ddptrain runs`` and the
dashboard need of it (the number of reports, the last one, each metric's last/min/max) is kept
by the driver in ``metrics_summary.json`` (:class:`MetricsSummary`, written atomically), which
covers the file up to a byte offset; a reader adds the few lines written after it. For a run
written before the summary existed, the reports are counted (newlines) and the last one is read
from the file's tail; only ``full`` reads (``ddptrain show``, a resumed run) read it all.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from ddptrain.storage.layout import RunLayout, write_json_atomic
from ddptrain.storage.run_files import RunFileError, open_file, read_json

__all__ = [
    "MetricsSummary",
    "iter_metric_lines",
    "read_metrics_summary",
    "read_metrics_tail",
    "read_metrics_after",
    "iter_validation_lines",
]

_LINE_MAX_BYTES = 16 << 20  # a longer metrics line is skipped
# What a read that is not `full` parses after the summary's offset, at most (about 10 000 reports;
# the driver rewrites the summary every second): past it, lines are counted, not parsed.
_DELTA_MAX_BYTES = 1 << 20
_POLL_MAX_BYTES = 4 << 20  # what one read of new reports (a dashboard's poll) reads, at most
_CHUNK_BYTES = 1 << 20
_SUMMARY_VERSION = 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metric_line(raw: bytes) -> dict[str, Any] | None:
    """One line of ``metrics.jsonl`` as ``{"time", "attempt", "metrics"}``, or ``None`` for a
    line that is not one (cut short by a crash, or not written by ddptrain)."""
    try:
        return _checked_line(json.loads(raw))
    except ValueError:
        return None


def _parses(raw: bytes) -> bool:
    """Whether a line that is not a report, nor a validation's, is JSON all the same (a cut
    one is not)."""
    try:
        line = json.loads(raw)
    except ValueError:
        return False
    return _validation_line(line) is None


def _validation_line(line: Any) -> dict[str, Any] | None:
    """A validation's line (``{"time", "attempt", "validation": {"checkpoint", "report",
    "metrics", "error", "seconds"}}``, written when a checkpoint's validation ended), or ``None``."""
    if not isinstance(line, dict) or not isinstance(line.get("validation"), dict):
        return None
    validation = line["validation"]
    if not isinstance(validation.get("checkpoint"), str) or not isinstance(validation.get("metrics"), dict):
        return None
    return line


def _checked_line(line: Any) -> dict[str, Any] | None:
    if not isinstance(line, dict) or not isinstance(line.get("metrics"), dict):
        return None
    time: Any = line.get("time")
    attempt = line.get("attempt")
    checked = {
        "time": time if _number(time) and math.isfinite(time) else None,
        "attempt": attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None,
        "metrics": line["metrics"],
    }
    world_size = line.get("world_size")  # the number of workers that made the report
    if isinstance(world_size, int) and not isinstance(world_size, bool):
        checked["world_size"] = world_size
    return checked


def _lines(
    f: IO[bytes], start: int, limit_bytes: int | None = None, unended: bool = False
) -> Iterator[tuple[bytes | None, int]]:
    """``(line, end)`` of each complete line from byte ``start`` (``None`` for one longer than
    16 MiB), until ``limit_bytes`` have been read. A last line without its newline is not
    complete (the driver may be writing it): it comes last only when ``unended``."""
    f.seek(start)
    end, long = start, False
    while limit_bytes is None or end - start < limit_bytes:
        raw = f.readline(_LINE_MAX_BYTES)
        if not raw.endswith(b"\n"):
            if len(raw) == _LINE_MAX_BYTES:
                long, end = True, end + len(raw)  # skip on to its end
                continue
            if raw and unended and not long:
                yield raw, end + len(raw)
            return
        end += len(raw)
        yield (None if long else raw), end
        long = False


@dataclass
class MetricsSummary:
    """What readers need of ``metrics.jsonl``, up to byte ``offset`` of it.

    Attributes:
        reports: How many reports (valid lines).
        last: The last report's line, ``{"time", "attempt", "metrics"}``.
        stats: Each numeric metric's ``[last, min, max]`` over every report (``None``: not
            known, for a long run written before summaries were kept, read without ``full``).
        offset: The bytes of the file this covers (always the end of a line).
        foreign: Lines that are JSON but not reports, or longer than 16 MiB: not written by
            ddptrain, and skipped (a line cut short by a crash is not JSON, and not counted).
    """

    reports: int = 0
    last: dict[str, Any] | None = None
    stats: dict[str, list[float]] | None = field(default_factory=dict)
    offset: int = 0
    foreign: int = 0

    def add(self, line: dict[str, Any], end: int) -> None:
        """Count the report ``line`` (as :func:`iter_metric_lines` gives it), which ends at byte ``end``."""
        self.reports += 1
        self.last = line
        self.offset = end
        if self.stats is None:
            return
        for key, value in line["metrics"].items():  # once per report in the driver: kept lean
            if (value.__class__ is float or value.__class__ is int) and value - value == 0:  # finite, not bool
                was = self.stats.get(key)
                if was is None:
                    self.stats[key] = [value, value, value]
                    continue
                was[0] = value
                if value < was[1]:
                    was[1] = value
                elif value > was[2]:
                    was[2] = value

    def write(self, run_dir: str | os.PathLike[str]) -> None:
        """Replace the run's summary file (atomically; private, as metrics may be)."""
        data = {"version": _SUMMARY_VERSION, "offset": self.offset, "reports": self.reports, "foreign": self.foreign}
        write_json_atomic(
            RunLayout(run_dir).metrics_summary, {**data, "last": self.last, "stats": self.stats}, private=True
        )

    @classmethod
    def _stored(cls, run_dir: str | os.PathLike[str], f: IO[bytes], size: int) -> MetricsSummary | None:
        """The run's summary file, if it is sound and still describes the start of ``f``."""
        try:
            data = read_json(run_dir, RunLayout.METRICS_SUMMARY)
        except RunFileError:
            return None
        if not isinstance(data, dict) or data.get("version") != _SUMMARY_VERSION:
            return None
        fields: list[Any] = [data.get(k) for k in ("offset", "reports", "foreign", "last", "stats")]
        offset, reports, foreign, last, stats = fields
        if not all(isinstance(n, int) and n >= 0 for n in (offset, reports, foreign)) or offset > size:
            return None
        if not (last is None or _checked_line(last) == last) or not isinstance(stats, dict):
            return None
        if not all(isinstance(v, list) and len(v) == 3 and all(map(_number, v)) for v in stats.values()):
            return None
        if offset > 0:
            f.seek(offset - 1)
            if f.read(1) != b"\n":
                return None
        return cls(reports, last, stats, offset, foreign)


def iter_metric_lines(run_dir: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Every report in the run's ``metrics.jsonl``, oldest first, read as it goes (a line cut
    short by a crash is skipped).

    Raises:
        RunFileError: ``metrics.jsonl`` cannot be read (see :func:`open_file`).
    """
    yield from _parsed_lines(run_dir, _metric_line, unended=True)  # a last line without its newline counts when whole


def iter_validation_lines(run_dir: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Every validation's line in the run's ``metrics.jsonl`` (see :func:`_validation_line`), oldest first.

    Raises:
        RunFileError: ``metrics.jsonl`` cannot be read (see :func:`open_file`).
    """
    yield from _parsed_lines(run_dir, _validation_raw)


def _validation_raw(raw: bytes) -> dict[str, Any] | None:
    """:func:`_validation_line` of a raw line (``None``: not JSON, or not a validation's)."""
    if b'"validation"' not in raw:  # most lines are reports: not parsed twice
        return None
    try:
        return _validation_line(json.loads(raw))
    except ValueError:
        return None


def _parsed_lines(
    run_dir: str | os.PathLike[str], parse: Callable[[bytes], dict[str, Any] | None], unended: bool = False
) -> Iterator[dict[str, Any]]:
    """The lines of the run's ``metrics.jsonl`` that ``parse`` accepts, oldest first, read as it
    goes (``unended``: a whole last line without its newline counts)."""
    f = open_file(run_dir, RunLayout.METRICS)
    if f is None:
        return
    with f:
        for raw, _ in _lines(f, 0, unended=unended):
            line = None if raw is None else parse(raw)
            if line is not None:
                yield line


def _scan(f: IO[bytes], summary: MetricsSummary, limit_bytes: int | None = None) -> list[dict[str, Any]]:
    """Add the complete lines after ``summary.offset`` to it; returns them."""
    added = []
    for raw, end in _lines(f, summary.offset, limit_bytes):
        line = None if raw is None else _metric_line(raw)
        if line is None:
            summary.offset = end
            summary.foreign += raw is None or _parses(raw)
        else:
            summary.add(line, end)
            added.append(line)
    return added


def _last_lines(f: IO[bytes], end: int, count: int, limit_bytes: int = 4 * _LINE_MAX_BYTES) -> list[dict[str, Any]]:
    """Up to ``count`` reports of the lines before byte ``end``, read backwards from it."""
    start, chunks, newlines = end, [], 0
    while start > 0 and newlines <= count and end - start < limit_bytes:
        step = min(_CHUNK_BYTES, start)
        start -= step
        f.seek(start)
        chunks.append(f.read(step))
        newlines += chunks[-1].count(b"\n")
    texts = b"".join(reversed(chunks)).split(b"\n")
    if start > 0:
        texts = texts[1:]  # its start is before what was read
    lines = [line for line in map(_metric_line, texts) if line is not None]
    return lines[-count:] if count else []


def read_metrics_summary(run_dir: str | os.PathLike[str], full: bool = False) -> MetricsSummary:
    """The reports of the run, from its summary and the lines after it.

    When more than 1 MiB of lines follow the summary (a run written by an older ddptrain, which
    has none), a read that is not ``full`` counts them and reads the last report from the end of
    the file; its ``stats`` is ``None``. A ``full`` read reads every line after the summary.

    Raises:
        RunFileError: ``metrics.jsonl`` cannot be read (see :func:`open_file`).
    """
    f = open_file(run_dir, RunLayout.METRICS)
    if f is None:
        return MetricsSummary()
    with f:
        size = os.fstat(f.fileno()).st_size
        summary = MetricsSummary._stored(run_dir, f, size) or MetricsSummary()
        if full or size - summary.offset <= _DELTA_MAX_BYTES:
            _scan(f, summary)
            return summary
        f.seek(summary.offset)
        newlines, at, end = 0, summary.offset, summary.offset
        while chunk := f.read(_CHUNK_BYTES):
            if found := chunk.count(b"\n"):
                newlines, end = newlines + found, at + chunk.rfind(b"\n") + 1  # up to the last complete line
            at += len(chunk)
        last = _last_lines(f, end, 1)
        last_line = last[-1] if last else summary.last
        return MetricsSummary(summary.reports + newlines, last_line, None, end, summary.foreign)


def read_metrics_tail(run_dir: str | os.PathLike[str], count: int) -> tuple[list[dict[str, Any]], MetricsSummary]:
    """The last ``count`` reports (fewer when the lines before them are longer than 64 MiB),
    and the summary they end (``summary.reports`` is the number of the last one).

    Raises:
        RunFileError: ``metrics.jsonl`` cannot be read (see :func:`open_file`).
    """
    summary = read_metrics_summary(run_dir)
    f = open_file(run_dir, RunLayout.METRICS)
    if f is None or summary.offset == 0:
        if f is not None:
            f.close()
        return [], summary
    with f:
        return _last_lines(f, summary.offset, count), summary


def read_metrics_after(
    run_dir: str | os.PathLike[str], offset: int, limit_bytes: int = _POLL_MAX_BYTES
) -> tuple[list[dict[str, Any]], int]:
    """The reports of the complete lines from byte ``offset`` (the end of a line, as returned
    by an earlier call), reading at most about ``limit_bytes``; and the offset after them.

    Raises:
        ValueError: ``offset`` is not the end of a line of the file.
        RunFileError: ``metrics.jsonl`` cannot be read (see :func:`open_file`).
    """
    f = open_file(run_dir, RunLayout.METRICS)
    if f is None:
        if offset:
            raise ValueError(f"offset {offset} is past the end of the run's metrics")
        return [], 0
    with f:
        size = os.fstat(f.fileno()).st_size
        if offset > size or offset < 0:
            raise ValueError(f"offset {offset} is past the end of the run's metrics ({size} bytes)")
        if offset > 0:
            f.seek(offset - 1)
            if f.read(1) != b"\n":
                raise ValueError(f"offset {offset} is not the end of a line of the run's metrics")
        summary = MetricsSummary(offset=offset, stats=None)
        return _scan(f, summary, limit_bytes), summary.offset
