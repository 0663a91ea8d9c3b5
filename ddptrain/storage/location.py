"""Where a run lives, and what an earlier run of the same name left there (driver side).

A ``RunConfig`` puts a run under its storage path, local or remote, by its name; without a
name the run gets a fresh generated one, so only an explicit name ever resumes a run.
Rerunning with the same name resumes it: its committed checkpoints, its metrics (reports
are numbered on), its attempts (numbered on too). Resume is loud on purpose: it logs what
it picked up, and from where.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ddptrain import _env
from ddptrain.result import read_metric_lines
from ddptrain.storage.layout import RunLayout
from ddptrain.storage.remote import RemoteRoot

if TYPE_CHECKING:
    from ddptrain.config import RunConfig
    from ddptrain.storage.checkpoint_manager import CheckpointManager
    from ddptrain.storage.mirror import RunMirror

__all__ = ["Earlier", "RunLocation", "load_earlier"]

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunLocation:
    """Where one run's files are.

    Attributes:
        name: The run's name (generated when the config gives none).
        storage_path: The storage root, as users see it.
        run_dir: Where the driver writes the run's files: the run directory itself, or for a
            run on remote storage the driver's local working copy of its small files.
        shown: Where the run is, as users named it (a path, or a URI).
        remote: The storage root of a run on remote storage (``None``: a local run).
    """

    name: str
    storage_path: str
    run_dir: str
    shown: str
    remote: RemoteRoot | None

    @property
    def run_path(self) -> str | None:
        """The run's folder on ``remote.fs`` (``None`` for a local run)."""
        return self.remote.path(self.name) if self.remote is not None else None

    @classmethod
    def of(cls, run_config: RunConfig) -> RunLocation:
        """Where ``run_config`` puts its run (its name is generated when it gives none)."""
        remote = run_config._remote()
        if remote is None:
            storage_path = str(run_config._storage_root())
            name = run_config.name or _env.run_name() or _fresh_name(storage_path)
            run_dir = os.path.join(storage_path, name)
            return cls(name, storage_path, run_dir, run_dir, None)
        name = run_config.name or _env.run_name() or _fresh_name(remote.display(), remote)
        return cls(name, remote.display(), remote.cache_dir(name), remote.shown(remote.path(name)), remote)


def _fresh_name(storage_path: str, remote: RemoteRoot | None = None) -> str:
    """A generated run name that no earlier run used."""
    base = datetime.datetime.now().strftime("ddptrain_run-%Y-%m-%d_%H-%M-%S")
    name, n = base, 1
    taken = set(remote.list_names(remote.root)) if remote is not None else None
    while (name in taken) if taken is not None else os.path.exists(os.path.join(storage_path, name)):
        n += 1
        name = f"{base}_{n}"
    return name


@dataclass
class Earlier:
    """What an earlier run of the same name left (nothing, for a new run).

    Attributes:
        metrics: Rank 0's metrics of each of its reports, oldest first.
        last_attempt: The highest attempt number in its metrics (-1: none).
        lost_reports: Reports its checkpoint index knows of but its metrics lost (a crash):
            the next report is numbered after them, never reusing a checkpoint's name.
        world_sizes: The world size of each report of ``metrics``.
    """

    metrics: list[dict[str, Any]]
    last_attempt: int
    lost_reports: int
    world_sizes: list[int] = field(default_factory=list)


def load_earlier(where: RunLocation, checkpoints: CheckpointManager, mirror: RunMirror | None) -> Earlier:
    """Pick up an earlier run at ``where``: pull it from remote storage (through ``mirror``),
    finish or undo a commit a crash interrupted, load its checkpoints and metrics. Logs a
    warning for a resumed run, and for metrics that lost reports.

    Raises:
        RunDirectoryError: Its checkpoint index cannot be read; nothing was changed.
    """
    if mirror is not None:
        mirror.pull()
    checkpoints.recover()
    lines = read_metric_lines(where.run_dir)
    metrics = [line["metrics"] for line in lines]
    attempts = [a for a in (line.get("attempt") for line in lines) if isinstance(a, int) and not isinstance(a, bool)]
    world_sizes = [int(line.get("world_size", 1)) for line in lines]
    earlier = Earlier(metrics, max(attempts, default=-1), max(0, checkpoints.report_index - len(metrics)), world_sizes)
    if earlier.lost_reports:
        _logger.warning(
            "ddptrain: %s has %d reports but the checkpoint index records report #%d; reports are numbered on from #%d",
            RunLayout(where.run_dir).metrics,
            len(metrics),
            checkpoints.report_index,
            checkpoints.report_index + 1,
        )
    latest = checkpoints.latest
    if latest is not None:
        _logger.warning(
            "ddptrain: resuming run %r from checkpoint %s (%d earlier reports in %s)",
            where.name,
            latest.path,
            len(metrics),
            where.shown,
        )
    elif metrics or RunLayout(where.run_dir).run_json.exists():
        _logger.warning(
            "ddptrain: run %r already exists in %s but has no committed checkpoint; "
            "starting from scratch and appending to its metrics",
            where.name,
            where.shown,
        )
    return earlier
