"""The committed checkpoints of a run: index, retention, and loading for resume (driver side).

A checkpoint counts as committed once it is listed in ``checkpoints.json``. The index is
replaced atomically, and it is rewritten *before* checkpoints dropped by retention are
deleted, so a crash at any moment leaves every listed checkpoint on disk.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddptrain import storage
from ddptrain.checkpoint import Checkpoint
from ddptrain.config import CheckpointConfig
from ddptrain.errors import DdpTrainError

__all__ = ["CheckpointManager", "RunDirectoryError", "INDEX_FILE"]

_logger = logging.getLogger(__name__)

INDEX_FILE = "checkpoints.json"
_VERSION = 1


class RunDirectoryError(DdpTrainError, RuntimeError):
    """A run directory cannot be resumed; nothing in it was changed."""


@dataclass
class _Entry:
    dir_name: str
    metrics: dict[str, Any]
    report_index: int


class CheckpointManager:
    """Keeps the index of committed checkpoints and applies ``CheckpointConfig`` retention.

    Args:
        run_dir: The run directory.
        config: Retention settings.
    """

    def __init__(self, run_dir: str, config: CheckpointConfig) -> None:
        self.run_dir = run_dir
        self.config = config
        self._entries: list[_Entry] = []  # in commit order
        self._latest: _Entry | None = None

    # ----------------------------------------------------------------- queries
    @property
    def latest(self) -> Checkpoint | None:
        """The most recently committed checkpoint."""
        return self._checkpoint(self._latest) if self._latest else None

    def _checkpoint(self, entry: _Entry) -> Checkpoint:
        return Checkpoint(os.path.join(self.run_dir, entry.dir_name))

    def _score(self, entry: _Entry) -> tuple[float, int]:
        """Sort key: worse first. Checkpoints without the score metric count as the worst."""
        attribute = self.config.checkpoint_score_attribute
        if attribute is None:
            return (0.0, entry.report_index)
        value = entry.metrics.get(attribute)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            return (-math.inf, entry.report_index)
        return (value if self.config.checkpoint_score_order == "max" else -value, entry.report_index)

    def best_checkpoints(self) -> list[tuple[Checkpoint, dict[str, Any]]]:
        """Kept checkpoints with their metrics, worst first and best last."""
        ordered = sorted(self._entries, key=self._score)
        return [(self._checkpoint(e), e.metrics) for e in ordered]

    def is_committed(self, dir_name: str) -> bool:
        """Whether ``dir_name`` is a kept checkpoint of this run."""
        return any(e.dir_name == dir_name for e in self._entries)

    # ----------------------------------------------------------------- changes
    def register(self, path: str, metrics: dict[str, Any], report_index: int) -> Checkpoint:
        """Record a just-committed checkpoint, then drop the worst ones beyond ``num_to_keep``."""
        entry = _Entry(os.path.basename(path), storage.to_jsonable(metrics), report_index)
        self._entries = [e for e in self._entries if e.dir_name != entry.dir_name]
        self._entries.append(entry)
        self._latest = entry
        doomed: list[_Entry] = []
        keep = self.config.num_to_keep
        if keep is not None and len(self._entries) > keep:
            candidates = [e for e in sorted(self._entries, key=self._score) if e is not entry]
            doomed = candidates[: len(self._entries) - keep]
            self._entries = [e for e in self._entries if e not in doomed]
        self._write()
        for old in doomed:
            shutil.rmtree(os.path.join(self.run_dir, old.dir_name), ignore_errors=True)
        return self._checkpoint(entry)

    def _write(self) -> None:
        storage.write_json_atomic(
            os.path.join(self.run_dir, INDEX_FILE),
            {
                "version": _VERSION,
                "checkpoint_score_attribute": self.config.checkpoint_score_attribute,
                "checkpoint_score_order": self.config.checkpoint_score_order,
                "checkpoints": [vars(e) for e in self._entries],
                "latest": self._latest.dir_name if self._latest else None,
            },
        )

    @classmethod
    def from_run_dir(cls, run_dir: str) -> CheckpointManager:
        """The manager of an existing run, with the score settings that run used."""
        config = CheckpointConfig()
        path = Path(run_dir, INDEX_FILE)
        if path.exists():
            try:
                data = json.loads(path.read_text())
                config = CheckpointConfig(
                    checkpoint_score_attribute=data.get("checkpoint_score_attribute"),
                    checkpoint_score_order=data.get("checkpoint_score_order") or "max",
                )
            except (OSError, ValueError, AttributeError):
                pass  # load() reports it
        manager = cls(run_dir, config)
        manager.load()
        return manager

    def load(self) -> None:
        """Read the index of an earlier run in ``run_dir``.

        Raises:
            RunDirectoryError: The index is unreadable, of an unknown version, or lists a
                latest checkpoint that is missing. Nothing is changed on disk.
        """
        path = Path(self.run_dir, INDEX_FILE)
        if not path.exists():
            return
        hint = (
            "Nothing was changed. Fix or move the file away to start this run from scratch, "
            "or pick another `RunConfig(name=...)`."
        )
        try:
            data = json.loads(path.read_text())
            version = data.get("version")
            entries = [
                _Entry(str(e["dir_name"]), dict(e.get("metrics", {})), int(e.get("report_index", 0)))
                for e in data.get("checkpoints", [])
            ]
            latest_name = data.get("latest")
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise RunDirectoryError(f"Cannot read the checkpoint index {path}: {exc!r}. {hint}") from exc
        if version != _VERSION:
            raise RunDirectoryError(
                f"The checkpoint index {path} has version {version!r}; this ddptrain reads version {_VERSION}. {hint}"
            )
        for entry in entries:
            storage.safe_child(self.run_dir, entry.dir_name)  # refuse names escaping the run dir
        present = [e for e in entries if os.path.isdir(os.path.join(self.run_dir, e.dir_name))]
        latest = next((e for e in present if e.dir_name == latest_name), None)
        if latest_name and latest is None:
            raise RunDirectoryError(
                f"The checkpoint index {path} names {latest_name!r} as the latest checkpoint, "
                f"but {os.path.join(self.run_dir, latest_name)} is missing. {hint}"
            )
        if len(present) < len(entries):
            missing = sorted({e.dir_name for e in entries} - {e.dir_name for e in present})
            _logger.warning("ddptrain: checkpoints listed in %s but missing on disk: %s", path, missing)
        self._entries = present
        self._latest = latest
