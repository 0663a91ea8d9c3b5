"""The committed checkpoints of a run: index, retention, and loading for resume (driver side).

A checkpoint counts as committed once it is listed in ``checkpoints.json``. A commit goes:

1. merge the staged files into a hidden ``.<name>.<id>.partial`` folder;
2. write the intent, ``.commit.json``: the entry, that folder, and what retention will delete;
3. rename the folder to its name (the commit point);
4. rewrite the index (atomically), then delete what retention dropped;
5. remove the intent.

A driver killed anywhere in between leaves an intent that :meth:`CheckpointManager.recover`
finishes or undoes when the run resumes: before step 3 the folder is discarded (no worker
was told of it), after it the checkpoint is adopted into the index, and retention's deletions
are completed. Either way it logs one line. The index is never behind a listed checkpoint:
every checkpoint it lists is on disk and complete.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.config import CheckpointConfig
from ddptrain.errors import DdpTrainError
from ddptrain.storage import layout as storage
from ddptrain.storage import run_files

__all__ = ["CheckpointManager", "RunDirectoryError", "flat_metric_names", "lookup_metric"]

_logger = logging.getLogger(__name__)

_VERSION = 1


def lookup_metric(metrics: dict[str, Any], name: str) -> Any:
    """``metrics[name]``, or, as Ray flattens nested metrics, the value at the path
    ``outer/inner`` of nested dicts (what ``checkpoint_score_attribute`` and
    ``Result.get_best_checkpoint`` name).

    Raises:
        KeyError: There is no such metric.
    """
    if name in metrics:
        return metrics[name]
    value: Any = metrics
    for part in name.split("/"):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(name)
        value = value[part]
    return value


def flat_metric_names(metrics: dict[str, Any], prefix: str = "") -> list[str]:
    """The names of ``metrics``, nested ones as ``outer/inner`` (what a score attribute may name)."""
    names: list[str] = []
    for key, value in metrics.items():
        if isinstance(value, dict) and value:
            names.extend(flat_metric_names(value, f"{prefix}{key}/"))
        else:
            names.append(f"{prefix}{key}")
    return names


class RunDirectoryError(DdpTrainError, RuntimeError):
    """A run directory cannot be resumed; nothing in it was changed."""


COMMITTED, PENDING_VALIDATION, VALIDATED = "COMMITTED", "PENDING_VALIDATION", "VALIDATED"  # an entry's status


@dataclass
class _Entry:
    dir_name: str
    metrics: dict[str, Any]
    report_index: int
    status: str = COMMITTED  # PENDING_VALIDATION until its validation ended (then VALIDATED)


@dataclass
class _Intent:
    """What a commit in progress is about to do (``.commit.json``)."""

    entry: _Entry
    building: str  # the hidden folder the checkpoint is built in
    delete: list[str]  # the checkpoints retention deletes once it is committed


class CheckpointManager:
    """Keeps the index of committed checkpoints and applies ``CheckpointConfig`` retention.

    Retention follows Ray Train: after each commit, the ``num_to_keep`` best checkpoints by
    ``checkpoint_score_attribute`` (the newest without one) are kept, and so is the latest,
    so up to ``num_to_keep + 1`` may be on disk. :meth:`best_checkpoints` lists only the top
    ``num_to_keep``.

    Args:
        run_dir: The run directory.
        config: Retention settings.
    """

    def __init__(self, run_dir: str, config: CheckpointConfig) -> None:
        self.run_dir = run_dir
        self.layout = storage.RunLayout(run_dir)
        self.config = config
        self._entries: list[_Entry] = []  # in commit order
        self._latest: _Entry | None = None
        self._report_index = 0  # the highest report index ever committed

    # ----------------------------------------------------------------- queries
    @property
    def latest(self) -> Checkpoint | None:
        """The most recently committed checkpoint."""
        return self._checkpoint(self._latest) if self._latest else None

    def _checkpoint(self, entry: _Entry) -> Checkpoint:
        return Checkpoint(str(self.layout.checkpoint(entry.dir_name)))

    def _score(self, entry: _Entry) -> tuple[float, int]:
        """Sort key: worse first. Checkpoints without the score metric count as the worst."""
        attribute = self.config.checkpoint_score_attribute
        if attribute is None:
            return (0.0, entry.report_index)
        try:
            value = lookup_metric(entry.metrics, attribute)
        except KeyError:
            return (-math.inf, entry.report_index)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            return (-math.inf, entry.report_index)
        return (value if self.config.checkpoint_score_order == "max" else -value, entry.report_index)

    @property
    def report_index(self) -> int:
        """The highest report index of any checkpoint this run committed (0: none).

        Kept in the index, so reports numbered after a resume never reuse a committed
        checkpoint's default name, whatever happened to ``metrics.jsonl``.
        """
        return self._report_index

    def best_checkpoints(self) -> list[tuple[Checkpoint, dict[str, Any]]]:
        """The top ``num_to_keep`` checkpoints with their metrics, worst first and best last.

        Like Ray's ``Result.best_checkpoints``: the latest checkpoint is listed only if it is
        among them (it is kept on disk anyway). Without a score attribute, oldest first.
        """
        ordered = self.reported_checkpoints()
        keep = self.config.num_to_keep
        return ordered[-keep:] if keep is not None else ordered

    def reported_checkpoints(self) -> list[tuple[Checkpoint, dict[str, Any]]]:
        """Every checkpoint on disk (the best ones and the latest), ordered like
        :meth:`best_checkpoints`; what ``get_all_reported_checkpoints()`` returns."""
        return [(self._checkpoint(e), e.metrics) for e in sorted(self._entries, key=self._score)]

    def reported_with_status(self) -> list[tuple[Checkpoint, dict[str, Any], str]]:
        """:meth:`reported_checkpoints` with each one's status (``COMMITTED``,
        ``PENDING_VALIDATION`` or ``VALIDATED``)."""
        return [(self._checkpoint(e), e.metrics, e.status) for e in sorted(self._entries, key=self._score)]

    def statuses(self) -> dict[str, str]:
        """Each kept checkpoint's path and status."""
        return {self._checkpoint(e).path: e.status for e in self._entries}

    def is_committed(self, dir_name: str) -> bool:
        """Whether ``dir_name`` is a kept checkpoint of this run."""
        return any(e.dir_name == dir_name for e in self._entries)

    # ----------------------------------------------------------------- changes
    def commit(
        self, staged: list[str], name: str, metrics: dict[str, Any], report_index: int, status: str = COMMITTED
    ) -> Checkpoint:
        """Commit staged files as checkpoint ``name`` and apply retention, crash-consistently.

        See the module docstring for the steps; a crash at any point is finished or undone by
        :meth:`recover` on resume.

        Args:
            staged: The ranks' staged folders; earlier ones win on a file clash.
            name: The checkpoint's folder name.
            metrics: Rank 0's metrics of the report.
            report_index: The report's index (1 for a run's first report).
            status: ``PENDING_VALIDATION``: a validation of it follows (retention keeps it until
                :meth:`validated`).
        """
        final = storage.safe_child(self.run_dir, name)
        entry = _Entry(name, storage.to_jsonable(metrics), report_index, status)
        building = storage.build_checkpoint(self.run_dir, staged, name)
        intent = self.layout.intent
        try:
            doomed = [e.dir_name for e in self._doomed(entry)]
            storage.write_json_atomic(intent, asdict(_Intent(entry, building.name, doomed)))
            storage.move_into_place(building, final)
        except BaseException:  # not committed: no trace of it may stay
            intent.unlink(missing_ok=True)  # first: without it, the folder is only a leftover
            shutil.rmtree(building, ignore_errors=True)
            raise
        self._record(entry)
        intent.unlink()
        storage.remove_staged([folder for folder in staged if Path(folder).resolve() != final])
        return self._checkpoint(entry)

    def _doomed(self, entry: _Entry) -> list[_Entry]:
        """What retention deletes once ``entry`` is committed: every checkpoint outside the
        top ``num_to_keep`` by score, except ``entry``, the new latest (Ray's rule), and those
        pending validation (their score is not known yet)."""
        keep = self.config.num_to_keep
        entries = [e for e in self._entries if e.dir_name != entry.dir_name] + [entry]
        if keep is None:
            return []
        ranked = sorted(entries, key=self._score)[:-keep]
        return [e for e in ranked if e is not entry and e.status != PENDING_VALIDATION]

    def validated(self, dir_name: str, metrics: dict[str, Any], status: str = VALIDATED) -> dict[str, Any] | None:
        """The validation of checkpoint ``dir_name`` ended: its ``metrics`` are merged into the
        checkpoint's (same keys overwrite, as in Ray; empty for a validation that failed), it
        is ``status`` (``COMMITTED``: it never ran), and retention is applied again (the latest
        is kept). Returns the merged metrics, or ``None`` if the checkpoint is no longer kept."""
        entry = next((e for e in self._entries if e.dir_name == dir_name), None)
        if entry is None:
            return None
        entry.metrics = {**entry.metrics, **storage.to_jsonable(metrics)}
        entry.status = status
        latest = self._latest or entry
        doomed = {e.dir_name for e in self._doomed(latest)}
        self._entries = [e for e in self._entries if e.dir_name not in doomed]
        self._write()
        for name in sorted(doomed):
            self._delete(name)
        return entry.metrics

    @property
    def pending_validation(self) -> list[str]:
        """The kept checkpoints whose validation has not ended, oldest first."""
        return [e.dir_name for e in self._entries if e.status == PENDING_VALIDATION]

    def _record(self, entry: _Entry) -> None:
        """Add ``entry`` as the latest checkpoint, rewrite the index, then delete what
        retention dropped (in that order: a crash never leaves a listed checkpoint missing)."""
        doomed = {e.dir_name for e in self._doomed(entry)}
        self._entries = [e for e in self._entries if e.dir_name != entry.dir_name and e.dir_name not in doomed]
        self._entries.append(entry)
        self._latest = entry
        self._report_index = max(self._report_index, entry.report_index)
        self._write()
        for name in sorted(doomed):
            self._delete(name)

    def _delete(self, name: str) -> None:
        """Delete checkpoint folder ``name`` (retention)."""
        shutil.rmtree(self.layout.checkpoint(name), ignore_errors=True)

    def _present(self, entries: list[_Entry]) -> list[_Entry]:
        """Those of ``entries`` whose folders exist."""
        return [e for e in entries if self.layout.checkpoint(e.dir_name).is_dir()]

    def _where(self, name: str) -> str:
        """Checkpoint ``name``'s location, for messages."""
        return str(self.layout.checkpoint(name))

    def clean_leftovers(self) -> None:
        """Remove what a failed attempt left half-done (staged files, half-built folders)."""
        storage.clean_leftovers(self.run_dir)

    def _write(self) -> None:
        storage.write_json_atomic(
            self.layout.index,
            {
                "version": _VERSION,
                "checkpoint_score_attribute": self.config.checkpoint_score_attribute,
                "checkpoint_score_order": self.config.checkpoint_score_order,
                "num_to_keep": self.config.num_to_keep,
                "report_index": self._report_index,
                "checkpoints": [vars(e) for e in self._entries],
                "latest": self._latest.dir_name if self._latest else None,
            },
        )

    def recover(self) -> None:
        """Finish or undo a commit that a crash of the driver interrupted, then load the index.

        Called before a run resumes. A checkpoint that was not yet renamed into place is
        discarded (no worker was told of it); one that was is adopted into the index, with
        retention applied. Either is logged in one line. Leftovers of the crash (staged and
        half-built folders, temporary files) are removed.

        Raises:
            RunDirectoryError: As :meth:`load`.
        """
        intent = self._read_intent()
        path = self.layout.intent
        if intent is not None and self.layout.checkpoint(intent.building).exists():
            # Never renamed into place. The intent goes first: a crash right after it must not
            # find the folder gone and take that for a finished rename.
            path.unlink()
            shutil.rmtree(self.layout.checkpoint(intent.building), ignore_errors=True)
            _logger.warning(
                "ddptrain: discarded checkpoint %r of report #%d: the driver died while committing it, "
                "before any worker was told it was saved",
                intent.entry.dir_name,
                intent.entry.report_index,
            )
            intent = None
        storage.clean_leftovers(self.run_dir)  # before the index is read: it may move a checkpoint back
        self.load()
        if intent is None:
            path.unlink(missing_ok=True)  # an unreadable intent: nothing of it was kept
            return
        entry = intent.entry
        listed = any(e.dir_name == entry.dir_name and e.report_index == entry.report_index for e in self._entries)
        if not listed and self.layout.checkpoint(entry.dir_name).is_dir():
            _logger.warning(
                "ddptrain: adopted checkpoint %r of report #%d into %s: the driver died after saving it, "
                "before listing it",
                entry.dir_name,
                entry.report_index,
                self.layout.INDEX,
            )
            self._record(entry)
        for name in intent.delete:  # retention's deletions that the crash interrupted
            if not self.is_committed(name):
                shutil.rmtree(self.layout.checkpoint(name), ignore_errors=True)
        path.unlink()

    def _read_intent(self) -> _Intent | None:
        """The intent of an interrupted commit, or ``None`` (also for one that is unreadable)."""
        path = self.layout.intent
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            raw = data["entry"]
            entry = _Entry(str(raw["dir_name"]), dict(raw["metrics"]), int(raw["report_index"]), _status(raw))
            intent = _Intent(entry, str(data["building"]), [str(name) for name in data["delete"]])
            for name in [entry.dir_name, *intent.delete]:
                storage.safe_child(self.run_dir, name)  # refuse names escaping the run dir
            if Path(intent.building).name != intent.building or not intent.building.endswith(".partial"):
                raise ValueError(f"not a folder being built: {intent.building!r}")
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            _logger.warning("ddptrain: ignoring the unreadable commit record %s: %r", path, exc)
            return None
        return intent

    @classmethod
    def from_run_dir(cls, run_dir: str) -> CheckpointManager:
        """The manager of an existing run, with the score settings that run used."""
        manager = cls(run_dir, read_config(run_dir))
        manager.load()
        return manager

    def load(self) -> None:
        """Read the index of an earlier run in ``run_dir``.

        Raises:
            RunDirectoryError: The index is unreadable, of an unknown version, or lists a
                latest checkpoint that is missing. Nothing is changed on disk.
        """
        path = self.layout.index
        hint = (
            "Nothing was changed. Fix or move the file away to start this run from scratch, "
            "or pick another `RunConfig(name=...)`."
        )
        try:
            data = run_files.read_json(self.run_dir, storage.RunLayout.INDEX)
            if data is None:
                return
            version = data.get("version")
            entries = [
                _Entry(str(e["dir_name"]), dict(e.get("metrics", {})), int(e.get("report_index", 0)), _status(e))
                for e in data.get("checkpoints", [])
            ]
            latest_name = data.get("latest")
            report_index = max([int(data.get("report_index") or 0)] + [e.report_index for e in entries])
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise RunDirectoryError(f"Cannot read the checkpoint index {path}: {exc!r}. {hint}") from exc
        if version != _VERSION:
            raise RunDirectoryError(
                f"The checkpoint index {path} has version {version!r}; this ddptrain reads version {_VERSION}. {hint}"
            )
        for entry in entries:
            storage.safe_child(self.run_dir, entry.dir_name)  # refuse names escaping the run dir
        present = self._present(entries)
        latest = next((e for e in present if e.dir_name == latest_name), None)
        if latest_name and latest is None:
            raise RunDirectoryError(
                f"The checkpoint index {path} names {latest_name!r} as the latest checkpoint, "
                f"but {self._where(latest_name)} is missing. {hint}"
            )
        if len(present) < len(entries):
            missing = sorted({e.dir_name for e in entries} - {e.dir_name for e in present})
            _logger.warning("ddptrain: checkpoints listed in %s but missing on disk: %s", path, missing)
        self._entries = present
        self._latest = latest
        self._report_index = report_index


def _status(raw: dict[str, Any]) -> str:
    """An index entry's status. A validation an earlier run left pending never ends: that
    checkpoint is ``COMMITTED`` (its reported metrics only)."""
    status = raw.get("status")
    return VALIDATED if status == VALIDATED else COMMITTED


def read_config(run_dir: str) -> CheckpointConfig:
    """The retention settings recorded in ``run_dir``'s index (defaults when unreadable:
    :meth:`CheckpointManager.load` reports that)."""
    try:
        data = run_files.read_json(run_dir, storage.RunLayout.INDEX)
        if data is not None:
            return CheckpointConfig(
                num_to_keep=data.get("num_to_keep"),
                checkpoint_score_attribute=data.get("checkpoint_score_attribute"),
                checkpoint_score_order=data.get("checkpoint_score_order") or "max",
            )
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return CheckpointConfig()
