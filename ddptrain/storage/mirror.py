"""The driver's local working copy of a run on remote storage, kept in step with the store.

``run.json``, ``metrics.jsonl``, ``trainer.pkl`` and the logs are written locally (as for a
local run) and uploaded: ``run.json`` on every status change, ``metrics.jsonl`` with every
checkpoint and otherwise at most every few seconds, logs after each attempt and at the end.
A resumed run first pulls the store's copies, which win over anything cached here.
"""

from __future__ import annotations

import logging
import posixpath
import shutil
import time
from pathlib import Path

from ddptrain.storage.layout import RunLayout
from ddptrain.storage.remote import RemoteRoot

__all__ = ["RunMirror"]

_logger = logging.getLogger(__name__)

_METRICS_EVERY_S = 2.0


class RunMirror:
    """Uploads a run's small files from ``run_dir`` (local) to ``run_path`` (on the store).

    Args:
        remote: The storage root.
        run_dir: The local working copy.
        run_path: The run's folder on ``remote.fs``.
    """

    def __init__(self, remote: RemoteRoot, run_dir: str, run_path: str) -> None:
        self.remote = remote
        self.run_dir = run_dir
        self.layout = RunLayout(run_dir)
        self.run_path = run_path
        self._metrics_pushed_at = 0.0
        self._failing = False
        self._logs_pushed: dict[str, tuple[int, float]] = {}  # local log file -> (size, mtime)

    def pull(self) -> None:
        """Replace the local copy with the store's run files (nothing, for a new run). Earlier
        attempts' log folders are recreated empty, so attempts are numbered on."""
        root = self.layout.root
        local_metrics = self.layout.metrics
        # Reports an earlier driver here could not upload (the store was away) are only here:
        # keep them when this copy extends the store's.
        kept = local_metrics.read_bytes() if local_metrics.is_file() else None
        for entry in list(root.iterdir()) if root.is_dir() else []:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        root.mkdir(parents=True, exist_ok=True)
        pulled = {name: self.remote.read_bytes(posixpath.join(self.run_path, name)) for name in RunLayout.SMALL_FILES}
        stored = pulled[RunLayout.METRICS] or b""
        run_exists = pulled[RunLayout.RUN_JSON] is not None  # a run deleted from the store starts afresh
        keep_local = run_exists and kept is not None and len(kept) > len(stored) and kept.startswith(stored)
        if keep_local:
            _logger.warning(
                "ddptrain: %s has reports the store's copy lacks (an earlier upload failed); keeping them",
                local_metrics,
            )
            pulled[RunLayout.METRICS] = kept
        for name, data in pulled.items():
            if data is not None:
                (root / name).write_bytes(data)
        if keep_local:
            self.push_file(RunLayout.METRICS)
        for attempt in RunLayout.attempt_numbers(self.remote.list_names(posixpath.join(self.run_path, RunLayout.LOGS))):
            self.layout.attempt_logs(attempt).mkdir(parents=True, exist_ok=True)
            self._mark_pushed(self.layout.attempt_logs(attempt))

    def push_file(self, name: str) -> None:
        """Upload one of the run's files (``name``: one of :class:`RunLayout`'s). A failure is
        logged (once until an upload works again), not raised: the local copy has it, and the
        next upload sends it."""
        try:
            self.remote.upload_file(str(self.layout.root / name), posixpath.join(self.run_path, name))
        except Exception as exc:  # each fsspec backend raises its own errors
            if not self._failing:
                _logger.warning(
                    "ddptrain: could not upload %s to %s: %s: %s (the local copy in %s has it; retried with "
                    "the next report)",
                    name,
                    self.remote.shown(self.run_path),
                    type(exc).__name__,
                    exc,
                    self.run_dir,
                )
            self._failing = True
        else:
            self._failing = False

    def push_metrics(self, force: bool = False) -> None:
        """Upload ``metrics.jsonl`` if ``force`` or a few seconds passed since the last upload."""
        now = time.monotonic()
        if force or self._failing or now - self._metrics_pushed_at >= _METRICS_EVERY_S:
            self.push_file(RunLayout.METRICS)
            self._metrics_pushed_at = now

    def push_logs(self) -> None:
        """Upload log files that are new or changed since the last upload."""
        logs = self.layout.logs
        for path in sorted(logs.rglob("*")) if logs.is_dir() else []:
            if not path.is_file():
                continue
            stat = path.stat()
            key = str(path)
            if self._logs_pushed.get(key) == (stat.st_size, stat.st_mtime):
                continue
            rel = path.relative_to(self.layout.root).as_posix()
            self.remote.upload_file(key, posixpath.join(self.run_path, rel))
            self._logs_pushed[key] = (stat.st_size, stat.st_mtime)

    def _mark_pushed(self, folder: Path) -> None:
        for path in folder.rglob("*"):
            if path.is_file():
                stat = path.stat()
                self._logs_pushed[str(path)] = (stat.st_size, stat.st_mtime)

    def push_final(self) -> None:
        """At the end of ``fit()``: upload what changed. A failure is logged, not raised (the
        error that ended the run, if any, matters more)."""
        try:
            if self.layout.metrics.exists():
                self.push_metrics(force=True)
            if self.layout.run_json.exists():
                self.push_file(RunLayout.RUN_JSON)
            self.push_logs()
        except Exception as exc:
            _logger.warning(
                "ddptrain: could not upload the run's metrics and logs to %s: %s: %s (a local copy is in %s)",
                self.remote.shown(self.run_path),
                type(exc).__name__,
                exc,
                self.run_dir,
            )
