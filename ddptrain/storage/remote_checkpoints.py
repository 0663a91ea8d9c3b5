"""Committed checkpoints of a run on remote storage (driver side).

Workers upload their checkpoint files themselves (see :func:`upload_checkpoint`): straight
into the checkpoint's folder, ``<run>/<name>/``, unless a folder of that name already exists
(a checkpoint replaced under its own name), then into ``<run>/.staging/...``, and the driver
copies those files into place (server-side) when it commits. The commit point is the upload
of ``checkpoints.json``: until then nothing lists the folder, and a resumed run deletes every
folder the index does not list. A committed checkpoint replaced under its own name is first
copied to a hidden backup folder (recorded in ``.commit.json``); a resumed run puts it back if
its successor was never listed. So a crash, of a worker or of the driver or of the store,
never leaves a checkpoint that looks committed but is not whole.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import uuid
from dataclasses import asdict
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.config import CheckpointConfig
from ddptrain.storage import layout as storage
from ddptrain.storage.checkpoint_manager import COMMITTED, CheckpointManager, _Entry, read_config
from ddptrain.storage.remote import RemoteRoot

__all__ = ["RemoteCheckpointManager", "upload_checkpoint", "remote_checkpoint"]

_logger = logging.getLogger(__name__)

_LAYOUT = storage.RunLayout
# What a run folder on remote storage holds besides checkpoints. The intent there is a
# replacement in progress (see RemoteCheckpointManager._put_aside).
_RUN_FILES = _LAYOUT.RESERVED | {_LAYOUT.INTENT}


def remote_checkpoint(remote: RemoteRoot, path: str) -> Checkpoint:
    """A checkpoint at ``path`` on ``remote`` (a path on its file system), shown as users
    gave the storage (a URI, or a path with the file system in ``.filesystem``)."""
    return Checkpoint._at(remote.shown(path), remote.fs)


def upload_checkpoint(
    remote: RemoteRoot, run_path: str, name: str, local: str, attempt: int, index: int, rank: int
) -> str:
    """Upload one rank's checkpoint files; returns the folder on ``remote`` they went to.

    Raises:
        FileNotFoundError: ``local`` is not a folder.
    """
    if not os.path.isdir(local):
        raise storage.not_a_folder(local)
    final = posixpath.join(run_path, name)
    target = final
    if remote.exists(final):  # replacing a checkpoint: never write into a committed folder
        target = posixpath.join(run_path, _LAYOUT.staged_name(attempt, index, rank))
        remote.remove_dir(target)
    remote.upload_dir(local, target)
    return target


class RemoteCheckpointManager(CheckpointManager):
    """:class:`CheckpointManager` for a run on remote storage.

    The index is kept in ``run_dir`` (the driver's local working copy) and uploaded on every
    change; checkpoint folders live only on the store.

    Args:
        run_dir: The driver's local working copy of the run's small files.
        config: Retention settings.
        remote: The storage root.
        run_path: The run's folder on ``remote.fs``.
    """

    def __init__(self, run_dir: str, config: CheckpointConfig, remote: RemoteRoot, run_path: str) -> None:
        super().__init__(run_dir, config)
        self.remote = remote
        self.run_path = run_path
        self._intent = posixpath.join(run_path, _LAYOUT.INTENT)

    @classmethod
    def from_copy(cls, run_dir: str, remote: RemoteRoot, run_path: str) -> RemoteCheckpointManager:
        """The manager of an existing run on the store, to read it: ``run_dir`` holds a copy of
        its small files (see :meth:`RemoteRoot.pull_run`).

        Raises:
            RunDirectoryError: The index is unreadable (see :meth:`CheckpointManager.load`).
        """
        manager = cls(run_dir, read_config(run_dir), remote, run_path)
        manager.load()
        return manager

    def _checkpoint(self, entry: _Entry) -> Checkpoint:
        return remote_checkpoint(self.remote, posixpath.join(self.run_path, entry.dir_name))

    def _where(self, name: str) -> str:
        return self.remote.shown(posixpath.join(self.run_path, name))

    def _present(self, entries: list[_Entry]) -> list[_Entry]:
        names = set(self.remote.list_names(self.run_path))
        return [e for e in entries if e.dir_name in names]

    def _delete(self, name: str) -> None:
        self.remote.remove_dir(posixpath.join(self.run_path, name))

    def _write(self) -> None:
        super()._write()
        self.remote.upload_file(str(self.layout.index), posixpath.join(self.run_path, _LAYOUT.INDEX))

    def commit(
        self, staged: list[str], name: str, metrics: dict[str, Any], report_index: int, status: str = COMMITTED
    ) -> Checkpoint:
        """Commit checkpoint ``name`` from the folders the ranks uploaded to (``staged``,
        earlier ranks win on a file clash): copy staged files into place, then upload the
        index (the commit point) and apply retention."""
        storage.check_dir_name(name)
        final = posixpath.join(self.run_path, name)
        moved = [folder for folder in staged if folder.rstrip("/") != final]
        entry = _Entry(name, storage.to_jsonable(metrics), report_index, status)
        backup = None
        if moved:
            replaced = next((e for e in self._entries if e.dir_name == name), None)
            if replaced is not None:  # replaced under its own name: keep a copy until the new one is listed
                backup = self._put_aside(replaced)
            for folder in reversed(moved):  # the earliest rank's files are copied last: they win
                self._copy_into(folder, final)
        self._record(entry)
        if backup is not None:
            self.remote.remove_dir(backup)
            self.remote.remove_file(self._intent)
        for folder in moved:
            self.remote.remove_dir(folder)
        return self._checkpoint(entry)

    def _put_aside(self, replaced: _Entry) -> str:
        """Before a committed checkpoint is overwritten: copy it to a hidden backup folder,
        record that in ``.commit.json``, then unlist and delete it. :meth:`recover` puts it
        back if the driver dies before its successor is listed."""
        name = replaced.dir_name
        final = posixpath.join(self.run_path, name)
        backup = posixpath.join(self.run_path, f".{name}.{uuid.uuid4().hex}.old")
        self._copy_into(final, backup)
        was_latest = self._latest is not None and self._latest.dir_name == name
        intent = {"entry": asdict(replaced), "backup": posixpath.basename(backup), "was_latest": was_latest}
        self.remote.write_bytes(self._intent, json.dumps(intent).encode())
        self._entries = [e for e in self._entries if e.dir_name != name]
        if was_latest:
            self._latest = self._entries[-1] if self._entries else None
        self._write()
        self.remote.remove_dir(final)
        return backup

    def _copy_into(self, folder: str, final: str) -> None:
        self.remote.copy_dir(folder, final)

    def recover(self) -> None:
        """Load the index (``Run`` downloaded it), put back a checkpoint whose replacement a
        crash interrupted, and delete every folder of the run that the index does not list:
        checkpoints a crash left unlisted, staged files, and folders retention had yet to
        delete."""
        self.layout.intent.unlink(missing_ok=True)  # local commits only
        self.load()
        raw = self.remote.read_bytes(self._intent)
        if raw is not None:
            self._finish_replacement(raw)
        self.clean_leftovers()

    def _finish_replacement(self, raw: bytes) -> None:
        try:
            intent = json.loads(raw)
            old = _Entry(
                str(intent["entry"]["dir_name"]), dict(intent["entry"]["metrics"]), int(intent["entry"]["report_index"])
            )
            backup = str(intent["backup"])
            storage.check_dir_name(old.dir_name)
            if "/" in backup or not backup.endswith(".old"):
                raise ValueError(f"not a backup folder: {backup!r}")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            _logger.warning("ddptrain: ignoring the unreadable replacement record of %s: %r", self.run_path, exc)
            self.remote.remove_file(self._intent)
            return
        backup_path = posixpath.join(self.run_path, backup)
        if not self.is_committed(old.dir_name) and self.remote.exists(backup_path):
            final = posixpath.join(self.run_path, old.dir_name)
            self.remote.remove_dir(final)
            self._copy_into(backup_path, final)
            self._entries.append(old)
            if intent.get("was_latest") or self._latest is None:
                self._latest = old
            self._write()
            _logger.warning(
                "ddptrain: restored checkpoint %r of report #%d: the driver died while replacing it",
                old.dir_name,
                old.report_index,
            )
        self.remote.remove_dir(backup_path)
        self.remote.remove_file(self._intent)

    def clean_leftovers(self) -> None:
        kept = {e.dir_name for e in self._entries} | _RUN_FILES
        for name in self.remote.list_names(self.run_path):
            if name in kept or name.startswith(".ddptrain_probe"):
                continue
            where = self.remote.shown(posixpath.join(self.run_path, name))
            if name != _LAYOUT.STAGING:
                _logger.warning("ddptrain: deleting %s: a checkpoint upload that was never committed", where)
            self.remote.remove_dir(posixpath.join(self.run_path, name))
