"""``FsspecRunStorage``: a run on remote storage (``s3://``, ``gs://``, ... through fsspec).

The driver works in a local copy of the run's small files (``RunMirror``: pulled on resume,
uploaded as they change, and at the end); workers upload their checkpoint files straight to
the store (``upload_checkpoint``); the driver commits them (``RemoteCheckpointManager``:
the upload of ``checkpoints.json`` is the commit point). Every call to the store is bounded.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle

from ddptrain.checkpoint import Checkpoint
from ddptrain.config import CheckpointConfig
from ddptrain.errors import StorageError, WorkerFailure
from ddptrain.storage import layout
from ddptrain.storage.base import RunStorage
from ddptrain.storage.checkpoint_manager import CheckpointManager
from ddptrain.storage.location import Earlier, RunLocation, load_earlier
from ddptrain.storage.mirror import RunMirror
from ddptrain.storage.remote import RemoteRoot
from ddptrain.storage.remote_checkpoints import RemoteCheckpointManager, upload_checkpoint

if TYPE_CHECKING:
    from ddptrain.wire.protocol import StorageSpec

__all__ = ["FsspecRunStorage"]

_log = logging.getLogger(__name__)


class FsspecRunStorage(RunStorage):
    """A run on an fsspec file system (see the module's doc and :class:`RunStorage`).

    Args:
        where: Where the run is (``where.remote`` is the storage root).
        checkpoint_config: Retention settings.
        remote: The storage root (default ``where.remote``; a worker's is unpickled from the spec).
    """

    kind = "fsspec"

    def __init__(
        self, where: RunLocation, checkpoint_config: CheckpointConfig | None = None, remote: RemoteRoot | None = None
    ) -> None:
        root = remote if remote is not None else where.remote
        if root is None:
            raise ValueError(f"{where.shown} is not on remote storage")
        self.remote = root
        self.run_path = root.path(where.name)
        super().__init__(where, checkpoint_config)
        self.mirror = RunMirror(root, self.run_dir, self.run_path)

    def _manager(self, config: CheckpointConfig) -> CheckpointManager:
        return RemoteCheckpointManager(self.run_dir, config, self.remote, self.run_path)

    # ----------------------------------------------------------------- what workers get
    def spec(self, checkpoint: Checkpoint | None) -> StorageSpec:
        return dataclasses.replace(
            super().spec(checkpoint), run_path=self.run_path, filesystem=cloudpickle.dumps(self.remote)
        )

    def worker_env(self) -> dict[str, str]:
        """The storage's credential and endpoint variables, for workers on other hosts."""
        return self.remote.credential_env()

    @property
    def filesystem(self) -> Any:
        return self.remote.fs

    def checkpoint_at(self, path: str) -> Checkpoint:
        return Checkpoint._at(path, self.remote.fs)

    # ----------------------------------------------------------------- opening the run
    def load_earlier(self) -> Earlier:
        """Pull the store's copy of the run into the local working copy first (see ``RunMirror.pull``)."""
        return load_earlier(self.where, self.checkpoints, self.mirror)

    def write_trainer(self, data: bytes) -> None:
        super().write_trainer(data)
        self.mirror.push_file(layout.RunLayout.TRAINER)

    def save_status(self, run_json: dict[str, Any], ended: bool) -> None:
        """Write ``run.json`` and upload it, unless the run ended (:meth:`close` uploads that
        one, with the run's last uploads); raises ``StorageError`` when the store does not
        take it (``RunMirror.push_file``)."""
        super().save_status(run_json, ended)
        if not ended:
            self.mirror.push_file(layout.RunLayout.RUN_JSON)

    # ----------------------------------------------------------------- checkpoints
    def name_problem(self, name: str, staged: Sequence[str] = ()) -> str | None:
        try:
            layout.safe_child(self.run_dir, name)
        except ValueError as exc:
            return str(exc)
        if any(self.is_final(folder, name) for folder in staged) and self.checkpoints.is_committed(name):
            return (
                f"checkpoint {name!r} is already committed: a checkpoint put in place by the user "
                "(`NO_UPLOAD`, `checkpoint_upload_fn`) needs a new `checkpoint_dir_name` each report."
            )
        return None

    def final_path(self, name: str) -> str:
        layout.check_dir_name(name)
        return posixpath.join(self.run_path, name)

    def is_final(self, path: str, name: str) -> bool:
        path = path.split("://", 1)[1] if "://" in path else path
        return posixpath.normpath(path) == self.final_path(name)

    @property
    def is_remote(self) -> bool:
        return True

    def folder_exists(self, path: str) -> bool:
        return self.remote.exists(path)

    def stage(self, source: str, name: str, attempt: int, index: int, rank: int, move: bool = False) -> str:
        """Upload one rank's checkpoint files to the store (see ``upload_checkpoint``).

        Raises:
            FileNotFoundError: ``source`` is not a folder.
            StorageError: The upload failed; names the checkpoint, the report and the store.
        """
        try:
            return upload_checkpoint(self.remote, self.run_path, name, source, attempt, index, rank)
        except FileNotFoundError:
            raise
        except Exception as exc:  # each fsspec backend raises its own errors
            raise StorageError(
                f"Uploading checkpoint {name!r} of report #{index} to "
                f"{self.remote.shown(self.run_path)} failed: {type(exc).__name__}: {exc}",
                timed_out=getattr(exc, "timed_out", False),
            ) from exc

    # ----------------------------------------------------------------- after reports, at the end
    @property
    def uploads(self) -> bool:
        return True

    def reported(self, checkpoint: Checkpoint | None) -> None:
        """Upload ``metrics.jsonl`` every few seconds, and at once with a checkpoint (so that the
        store's metrics list its report)."""
        self.mirror.push_metrics(force=checkpoint is not None)

    def clean_after_failure(self, failures: Sequence[WorkerFailure] = ()) -> None:
        """Remove what the failed attempt left half-done, upload its logs. A failure here is
        logged: the store may be what failed, and the next attempt (or the next resume) cleans
        up again. When the store did not answer a worker (``failures``), these calls get a
        bound of seconds: one that times out too stops the driver's calls to the store until it
        answers (see ``remote_calls``), so the run ends at once."""
        was_stopping = self.remote.stopping
        self.remote.stopping = was_stopping or any(
            isinstance(f.exception, StorageError) and f.exception.timed_out for f in failures
        )
        try:
            self.checkpoints.clean_leftovers()
            self.mirror.push_logs(retry=False)  # sent again later: the next attempt's end, the run's
        except Exception as exc:  # each fsspec backend raises its own errors
            _log.warning(
                "ddptrain: could not clean up after the failed attempt in %s: %s: %s",
                self.shown,
                type(exc).__name__,
                exc,
            )
        finally:
            self.remote.stopping = was_stopping

    def stop(self) -> None:
        self.remote.stopping = True  # Ctrl-C: the uploads left get a bound of seconds

    def why(self, error: BaseException) -> str:
        return self.mirror.why(error)

    def close(self, failed: bool) -> bool:
        """Upload what changed (``RunMirror.push_final``)."""
        return self.mirror.push_final(failed)
