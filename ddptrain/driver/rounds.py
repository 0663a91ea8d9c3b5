"""Rounds: one ``report()`` or collective call, gathered across the ranks of an attempt, and
what the driver says about ranks that are late to one or never came.

:class:`~ddptrain.driver.attempt.Attempt` owns the open rounds and decides what a complete one
does (a checkpoint's commit, a collective's answer); this module holds the round itself and
the warnings, so that their wording lives in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ddptrain import _env
from ddptrain.wire import protocol

__all__ = ["Round", "warn_stragglers", "warn_unfinished"]

_logger = logging.getLogger(__name__)


@dataclass
class Round:
    """One ``report()`` or collective call, gathered across ranks (``entries`` by rank)."""

    kind: str  # "report" or "collective"
    index: int
    started: float
    entries: dict[int, Any] = field(default_factory=dict)
    warned_at: float = 0.0

    @property
    def what(self) -> str:
        """The call, as the warnings and errors name it."""
        return "report()" if self.kind == "report" else "a collective (barrier/broadcast)"

    def missing(self, world_size: int) -> list[int]:
        """The ranks that have not made this call yet."""
        return sorted(set(range(world_size)) - set(self.entries))


def warn_stragglers(rounds: dict[str, dict[int, Round]], world_size: int, now: float) -> None:
    """Name the ranks late to the oldest open round of each kind, once it is older than
    ``DDPTRAIN_REPORT_WARN_INTERVAL_S`` and then at most every 30 s (every worker must make
    each call; a missing one is named instead of a silent hang)."""
    interval = _env.report_warn_interval_s()
    for open_rounds in rounds.values():
        oldest = next(iter(open_rounds.values()), None)
        if oldest is None:
            continue
        age = now - oldest.started
        if age < interval or now - oldest.warned_at < max(interval, 30.0):
            continue
        oldest.warned_at = now
        _logger.warning(
            "ddptrain: rank(s) %s have not reached %s call #%d yet; rank(s) %s reached it %.1f s ago. "
            "Every worker must call it the same number of times.",
            oldest.missing(world_size),
            oldest.what,
            oldest.index,
            sorted(oldest.entries),
            age,
        )


def _runs_of_rounds(reports: Iterable[Round], world_size: int) -> list[tuple[str, list[int], list[int]]]:
    """Unfinished report rounds as runs of consecutive calls made by the same ranks: one line
    for ``if rank == 0: report(...)`` in a loop, not one per call."""
    runs: list[tuple[int, int, list[int], list[int]]] = []
    for round_ in sorted(reports, key=lambda r: r.index):
        made, missing = sorted(round_.entries), round_.missing(world_size)
        if runs and runs[-1][1] + 1 == round_.index and runs[-1][2:] == (made, missing):
            runs[-1] = (runs[-1][0], round_.index, made, missing)
        else:
            runs.append((round_.index, round_.index, made, missing))
    return [
        (f"report() call #{first} was" if first == last else f"report() calls #{first}-#{last} were", made, missing)
        for first, last, made, missing in runs
    ]


def warn_unfinished(
    reports: Iterable[Round],
    to_commit: Iterable[tuple[int, list[protocol.Report]]],
    uploaded: dict[int, dict[int, str]],
    world_size: int,
) -> None:
    """After training succeeded: name the ``report()`` calls some ranks never made, and the
    checkpoints never committed because a rank's upload never ended."""
    for calls, made, missing in _runs_of_rounds(reports, world_size):
        _logger.warning(
            "ddptrain: %s made by rank(s) %s but never by rank(s) %s; every worker must call report() "
            "the same number of times (only rank 0's metrics are kept: the others may pass the same dict).",
            calls,
            made,
            missing,
        )
    for index, entries in to_commit:
        missing = sorted(e.rank for e in entries if e.pending and e.rank not in uploaded.get(index, {}))
        _logger.warning(
            "ddptrain: the checkpoint of report() call #%d was never committed: the upload of rank(s) %s never ended.",
            index,
            missing,
        )
