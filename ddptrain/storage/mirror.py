"""The driver's local working copy of a run on remote storage, kept in step with the store.

``run.json``, ``metrics.jsonl``, ``trainer.pkl`` and the logs are written locally (as for a
local run) and uploaded: ``run.json`` on every status change, ``metrics.jsonl`` with every
checkpoint and otherwise at most every few seconds, logs after each attempt and at the end.
A resumed run first pulls the store's copies, which win over anything cached here.

An upload that fails is tried again (after 0.5 s, 1 s, 2 s, ... at most 4 s apart) until the
store has failed every try for ``DDPTRAIN_STORAGE_TIMEOUT_S``: a short outage costs a wait, a
store gone for the bound raises :class:`~ddptrain.errors.StorageError`, as does a call that got
no answer for the bound (that is one try for the whole bound). The error names the store and the
local copy, which has everything the store lacks. Uploads the run no longer depends on (the logs
of a failed attempt, the last uploads of a failed run) and those on the way out (Ctrl-C) get one
try.
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import shutil
import time
from pathlib import Path

from ddptrain.errors import StorageError
from ddptrain.storage import remote_calls
from ddptrain.storage.layout import RunLayout, write_json_atomic
from ddptrain.storage.remote import RemoteRoot

__all__ = ["RunMirror"]

_logger = logging.getLogger(__name__)

_METRICS_EVERY_S = 2.0
_FIRST_RETRY_S = 0.5  # the wait before an upload that failed is tried again; doubled each time
_LAST_RETRY_S = 4.0  # ... up to this


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
        # When the uploads began to fail (None: the last one worked). A failure a caller let
        # pass (on its way out) leaves it set: the store's copy is behind, and the next upload
        # is tried once more, not for another bound.
        self._failing_since: float | None = None
        self._logs_pushed: dict[str, tuple[int, float]] = {}  # local log file -> (size, mtime)
        # The last error an upload raised, and why it failed (its message without the local copy's note).
        self.lost: tuple[StorageError, str] | None = None

    def pull(self) -> None:
        """Replace the local copy with the store's run files (nothing, for a new run). Earlier
        attempts' log folders are recreated empty, so attempts are numbered on.

        What an earlier driver here could not upload (the store was away) is only here: its
        reports are kept when this copy's extend the store's, and its logs when the store's
        ``run.json`` is that driver's (same ``run_id``); both are uploaded."""
        root = self.layout.root
        local_metrics = self.layout.metrics
        kept = local_metrics.read_bytes() if local_metrics.is_file() else None
        local_run_id = _run_id(self.layout.run_json.read_bytes() if self.layout.run_json.is_file() else None)
        for entry in list(root.iterdir()) if root.is_dir() else []:
            if entry.is_dir() and not entry.is_symlink():
                if entry == self.layout.logs and local_run_id is not None:
                    continue  # decided below, once the store's run.json says whose run it holds
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
        logs = self.layout.logs
        if logs.is_dir() and not logs.is_symlink():
            if local_run_id is not None and local_run_id == _run_id(pulled[RunLayout.RUN_JSON]):
                self._push_missing_logs()
            else:
                shutil.rmtree(logs)
        for attempt in RunLayout.attempt_numbers(self.remote.list_names(posixpath.join(self.run_path, RunLayout.LOGS))):
            self.layout.attempt_logs(attempt).mkdir(parents=True, exist_ok=True)
            self._mark_pushed(self.layout.attempt_logs(attempt))

    def _push_missing_logs(self) -> None:
        """Upload the local log files that the store lacks, or has shorter (logs only grow)."""
        stored = self.remote.file_sizes(posixpath.join(self.run_path, RunLayout.LOGS))
        missing = [
            path
            for path in sorted(self.layout.logs.rglob("*"))
            if path.is_file() and stored.get(path.relative_to(self.layout.logs).as_posix()) != path.stat().st_size
        ]
        if missing:
            _logger.warning(
                "ddptrain: %s has %d log file(s) the store's copy lacks (an earlier upload failed); uploading them",
                self.layout.logs,
                len(missing),
            )
        for path in missing:
            self._upload(path, path.relative_to(self.layout.root).as_posix())
        self._mark_pushed(self.layout.logs)

    def push_file(self, name: str, retry: bool = True) -> None:
        """Upload one of the run's files (``name``: one of :class:`RunLayout`'s).

        Args:
            name: The file.
            retry: Try again while the store has failed for less than the bound (see the
                module's doc); ``False``: one try (what the run no longer depends on).

        Raises:
            StorageError: The store did not take it; names the store and the local copy.
        """
        self._upload(self.layout.root / name, name, retry)

    def _upload(self, local: Path, rel: str, retry: bool = True) -> None:
        """Upload ``local`` to ``rel`` below the run's folder, trying again (see the module's doc)."""
        remote = posixpath.join(self.run_path, rel)
        store = self.remote.display()
        retry_s = _FIRST_RETRY_S
        while True:
            tried_at = time.monotonic()
            try:
                self.remote.upload_file(str(local), remote)
            except Exception as exc:  # each fsspec backend raises its own errors
                error = exc
            else:
                if self._failing_since is not None:
                    _logger.warning("ddptrain: uploads to %s work again", store)
                self._failing_since = None
                return
            failing_since = self._failing_since
            first = failing_since is None
            if failing_since is None:
                failing_since = self._failing_since = tried_at
            if isinstance(error, StorageError) and error.timed_out:  # no answer for the bound, or a call still waits
                raise self._lost(str(error), error) from error
            failed = f"uploading {self.remote.shown(remote)}: {type(error).__name__}: {error}"
            if self.remote.stopping or not retry:  # on the way out (Ctrl-C), or asked to: no second try
                raise self._lost(f"{store} failed {failed}", error) from error
            bound_s = remote_calls.timeout_s()
            left_s = failing_since + bound_s - time.monotonic()
            if left_s <= 0:
                raise self._lost(
                    f"{store} failed every upload for {bound_s - left_s:.0f} s (the bound is "
                    f"DDPTRAIN_STORAGE_TIMEOUT_S={bound_s:g} s); the last: {failed}",
                    error,
                ) from error
            if first:
                _logger.warning("ddptrain: %s failed %s (tried again for up to %g s)", store, failed, bound_s)
            time.sleep(min(retry_s, left_s))
            retry_s = min(retry_s * 2, _LAST_RETRY_S)

    def why(self, error: BaseException) -> str:
        """Why ``error`` happened, without the note on the local copy when it is this mirror's."""
        return self.lost[1] if self.lost is not None and self.lost[0] is error else str(error).rstrip(".")

    def _lost(self, what: str, cause: BaseException) -> StorageError:
        why = what.rstrip(".")
        error = StorageError(
            f"{why}. The run's reports, run.json and logs are in its local copy {self.run_dir} "
            "(the store's copy lacks the latest of them).",
            timed_out=isinstance(cause, StorageError) and cause.timed_out,
        )
        self.lost = (error, why)
        return error

    def push_metrics(self, force: bool = False, retry: bool = True) -> None:
        """Upload ``metrics.jsonl`` if ``force`` or a few seconds passed since the last upload
        (``retry``: see :meth:`push_file`)."""
        now = time.monotonic()
        if force or self._failing_since is not None or now - self._metrics_pushed_at >= _METRICS_EVERY_S:
            self.push_file(RunLayout.METRICS, retry)
            self._metrics_pushed_at = now

    def push_logs(self, retry: bool = True) -> None:
        """Upload log files that are new or changed since the last upload (``retry``: see
        :meth:`push_file`)."""
        logs = self.layout.logs
        for path in sorted(logs.rglob("*")) if logs.is_dir() else []:
            if not path.is_file():
                continue
            stat = path.stat()
            key = str(path)
            if self._logs_pushed.get(key) == (stat.st_size, stat.st_mtime):
                continue
            self._upload(path, path.relative_to(self.layout.root).as_posix(), retry)
            self._logs_pushed[key] = (stat.st_size, stat.st_mtime)

    def _mark_pushed(self, folder: Path) -> None:
        for path in folder.rglob("*"):
            if path.is_file():
                stat = path.stat()
                self._logs_pushed[str(path)] = (stat.st_size, stat.st_mtime)

    def push_final(self, failed: bool) -> bool:
        """At the end of ``fit()``: upload what changed (``metrics.jsonl``, ``run.json``, logs).
        After the training failed (``failed``), each gets one try and a failure is logged: the
        training's error is the one raised (and a resume here uploads what is missing). After
        it finished, they are tried again (see :meth:`push_file`), and a failure is raised and
        recorded as ``upload_error`` in the local copy's ``run.json``.

        Returns:
            Whether everything is on the store.

        Raises:
            StorageError: The training finished, but its results are not all on the store; says
                so, and names the store and the local copy.
        """
        try:
            if self.layout.metrics.exists():
                self.push_metrics(force=True, retry=not failed)
            if self.layout.run_json.exists():
                self.push_file(RunLayout.RUN_JSON, retry=not failed)
            self.push_logs(retry=not failed)
        except Exception as exc:  # a StorageError, or a local file that cannot be read
            if failed:
                _logger.warning("ddptrain: could not upload the run's last results: %s: %s", type(exc).__name__, exc)
                return False
            with contextlib.suppress(OSError, ValueError, TypeError):  # the error names the local copy anyway
                run_json = json.loads(self.layout.run_json.read_bytes())
                write_json_atomic(self.layout.run_json, {**run_json, "upload_error": str(exc)}, private=True)
            raise StorageError(
                f"Training finished, but its results could not all be uploaded to {self.remote.display()}: {exc}",
                timed_out=isinstance(exc, StorageError) and exc.timed_out,
            ) from exc
        return True


def _run_id(run_json: bytes | None) -> str | None:
    """The ``run_id`` in a ``run.json`` (``None``: none, or not a run.json ddptrain wrote)."""
    try:
        found = json.loads(run_json) if run_json else None
    except ValueError:
        return None
    run_id = found.get("run_id") if isinstance(found, dict) else None
    return run_id if isinstance(run_id, str) else None
