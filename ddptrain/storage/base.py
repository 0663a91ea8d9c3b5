"""``RunStorage``: the one interface to a run's files, whatever holds them.

The driver opens a run's storage once per ``fit()`` (``ddptrain.storage.open.run_storage``)
and asks it for everything that touches the run's files: the lock, picking up an earlier
run of the same name, ``run.json``, ``trainer.pkl``, ``metrics.jsonl`` and its summary,
checkpoint commits with retention, the logs' uploads and the final uploads. Workers build
their side of it from the :class:`~ddptrain.wire.protocol.StorageSpec` the driver sends
(``ddptrain.storage.open.worker_storage``) and use :meth:`RunStorage.stage` and
:meth:`RunStorage.checkpoint_at`.

Three implementations: ``LocalRunStorage`` (a folder every worker sees),
``CopyBackRunStorage`` (a folder on the driver; hosts that cannot see it stage their files
locally and the driver copies them back through a :class:`FileTransfer` the launcher
supplies) and ``FsspecRunStorage`` (an fsspec URI; the driver keeps a local working copy of
the small files and uploads them).
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import IO, Any, Protocol

import cloudpickle

from ddptrain.checkpoint import Checkpoint
from ddptrain.config import CheckpointConfig
from ddptrain.errors import WorkerFailure
from ddptrain.storage import layout
from ddptrain.storage import metrics as run_metrics
from ddptrain.storage.checkpoint_manager import COMMITTED, PENDING_VALIDATION, CheckpointManager
from ddptrain.storage.location import Earlier, RunLocation
from ddptrain.storage.lock import RunLock
from ddptrain.wire.protocol import StorageSpec

__all__ = ["FileTransfer", "RunStorage"]

_logger = logging.getLogger(__name__)

# How often the metrics summary that `ddptrain runs` and the dashboard read is rewritten (and
# when the run's metrics file closes): readers add the lines written since.
SUMMARY_EVERY_S = 1.0


class FileTransfer(Protocol):
    """What a launcher supplies to reach the files of hosts that cannot see the run directory
    (copy-back storage): storage decides the paths, the launcher moves the bytes."""

    @property
    def unshared_ranks(self) -> Collection[int]:
        """Ranks on hosts that cannot see the run directory."""

    def fetch_dir(self, rank: int, remote: str, local: str) -> None:
        """Copy the folder ``remote`` of the host of ``rank`` to ``local`` here, then delete it
        there. Raises ``LaunchError`` naming the host when the copy fails."""


class RunStorage(ABC):
    """One run's files: where they are, and every write the driver and the workers make.

    Args:
        where: Where the run is (its name, storage root, local run directory).
        checkpoint_config: Retention settings (the defaults on a worker's side).
    """

    kind = "local"  # the StorageSpec kind workers build this from

    def __init__(self, where: RunLocation, checkpoint_config: CheckpointConfig | None = None) -> None:
        self.where = where
        self.name = where.name
        self.storage_path = where.storage_path
        self.run_dir = where.run_dir  # on remote storage, the driver's local working copy
        self.shown = where.shown  # where the run is, as users named it
        self.layout = layout.RunLayout(self.run_dir)
        self.checkpoints = self._manager(checkpoint_config or CheckpointConfig())
        self._metrics_file: IO[str] | None = None
        self._summary = run_metrics.MetricsSummary()  # of metrics.jsonl, for its readers
        self._summary_due = 0.0

    @abstractmethod
    def _manager(self, config: CheckpointConfig) -> CheckpointManager:
        """The checkpoint index of this storage."""

    # ----------------------------------------------------------------- what workers get
    def spec(self, checkpoint: Checkpoint | None) -> StorageSpec:
        """What a worker needs to build its side of this storage, resuming from ``checkpoint``."""
        return StorageSpec(
            kind=self.kind,
            storage_path=self.storage_path,
            run_dir=self.run_dir,
            checkpoint=checkpoint.path if checkpoint is not None else None,
            checkpoint_filesystem=cloudpickle.dumps(checkpoint._fs) if checkpoint and checkpoint._fs else None,
            probe=str(self.layout.run_json),
        )

    def worker_env(self) -> dict[str, str]:
        """Environment variables workers on other hosts need to reach the storage."""
        return {}

    @property
    def filesystem(self) -> Any:
        """The fsspec file system of the run's files (``None``: this machine's)."""
        return None

    def checkpoint_at(self, path: str) -> Checkpoint:
        """The run's checkpoint at ``path`` (a path the driver sent, or this storage made)."""
        return Checkpoint(path)

    # ----------------------------------------------------------------- opening the run
    def lock(self) -> RunLock:
        """The lock that keeps a second driver out of the run (a context manager)."""
        return RunLock(self.run_dir, self.name)

    @abstractmethod
    def load_earlier(self) -> Earlier:
        """Pick up an earlier run of the same name (under the lock): finish or undo what a crash
        interrupted, load its checkpoints and metrics. Loud on purpose.

        Raises:
            RunDirectoryError: Its checkpoint index cannot be read; nothing was changed.
        """

    def write_trainer(self, data: bytes) -> None:
        """Write ``trainer.pkl`` (the pickled trainer, private to the user)."""
        layout.write_atomic(self.layout.trainer, data, private=True)

    def save_status(self, run_json: dict[str, Any], ended: bool) -> None:
        """Write ``run.json`` (private to the user: it holds the command line)."""
        layout.write_json_atomic(self.layout.run_json, run_json, private=True)

    # ----------------------------------------------------------------- metrics
    def open_metrics(self) -> None:
        """Open ``metrics.jsonl`` for appending, ending a line a crash cut short, and read the
        summary of what it holds."""
        metrics_file = self._metrics_file = open(self.layout.metrics, "a+")  # noqa: SIM115
        if metrics_file.tell() > 0:  # end a line a crash may have cut short
            metrics_file.seek(metrics_file.tell() - 1)
            if metrics_file.read(1) != "\n":
                metrics_file.write("\n")
                metrics_file.flush()
        self._summary = run_metrics.read_metrics_summary(self.run_dir, full=True)
        self.write_summary()

    @property
    def metrics_open(self) -> bool:
        return self._metrics_file is not None

    def append_metrics(self, lines: Sequence[tuple[dict[str, Any], str]]) -> None:
        """Append ``(line, its JSON text)`` pairs to ``metrics.jsonl`` in one write and flush it
        to the operating system; the summary is rewritten at most every second.

        Raises:
            DiskFullError: The disk is full; names the file.
        """
        assert self._metrics_file is not None, "open_metrics comes first"
        with layout.naming_full_disk(self.layout.metrics):
            self._metrics_file.write("".join(text for _, text in lines))
            self._metrics_file.flush()
        for line, text in lines:
            if "metrics" in line:
                self._summary.add(line, self._summary.offset + len(text))
            else:  # a validation's line (``Run._validated``): not a report
                self._summary.offset += len(text)
        if time.monotonic() >= self._summary_due:
            self.write_summary()

    def write_summary(self) -> None:
        """Rewrite the metrics summary. It only spares readers work: when it cannot be written
        (a full disk stops the run at the next report anyway), they read the lines after it."""
        self._summary_due = time.monotonic() + SUMMARY_EVERY_S
        try:
            self._summary.write(self.run_dir)
        except OSError as exc:
            _logger.debug("ddptrain: could not write the metrics summary of %s: %s", self.run_dir, exc)

    def close_metrics(self) -> None:
        """Close ``metrics.jsonl`` (an ``OSError`` is the caller's to suppress)."""
        metrics_file, self._metrics_file = self._metrics_file, None
        if metrics_file is not None:
            metrics_file.close()

    # ----------------------------------------------------------------- checkpoints
    def name_problem(self, name: str, staged: Sequence[str] = ()) -> str | None:
        """Why a checkpoint may not be committed as ``name`` from ``staged``, or ``None`` when
        it may. A folder the user put in place already (``NO_UPLOAD``, ``checkpoint_upload_fn``:
        one of ``staged`` is the checkpoint's own folder) must not replace a committed one."""
        try:
            target = layout.safe_child(self.run_dir, name)
        except ValueError as exc:
            return str(exc)
        in_place = any(self.is_final(folder, name) for folder in staged)
        if in_place and self.checkpoints.is_committed(name):
            return (
                f"checkpoint {name!r} is already committed: a checkpoint put in place by the user "
                "(`NO_UPLOAD`, `checkpoint_upload_fn`) needs a new `checkpoint_dir_name` each report."
            )
        if not in_place and target.exists() and not self.checkpoints.is_committed(name):
            return (
                f"`checkpoint_dir_name` {name!r} names a folder of the run directory that is not a "
                "checkpoint of this run; choose another name."
            )
        return None

    def final_path(self, name: str) -> str:
        """Where checkpoint ``name`` of this run is committed (as ``Checkpoint.path`` gives it)."""
        return str(layout.safe_child(self.run_dir, name))

    def is_final(self, path: str, name: str) -> bool:
        """Whether ``path`` is the folder checkpoint ``name`` is committed as."""
        return os.path.realpath(path) == os.path.realpath(self.final_path(name))

    def adopt(self, checkpoint: Checkpoint, name: str, what: str) -> str:
        """Register a checkpoint the user put in place (``NO_UPLOAD``, or what
        ``checkpoint_upload_fn`` returned): returns its folder, to commit as it is.

        Raises:
            ValueError: It is not the folder of checkpoint ``name`` in this run's storage, or
                that folder does not exist; ``what`` names where it came from.
        """
        final = self.final_path(name)
        if not self.is_final(checkpoint.path, name) or (checkpoint.filesystem is not None and not self.is_remote):
            raise ValueError(
                f"{what} is at {checkpoint.path}, but a checkpoint that is not uploaded by ddptrain must "
                f"already be the run's checkpoint folder {final} "
                "(`ddptrain.get_context().get_storage().build_checkpoint_path_from_name(checkpoint_dir_name)`)."
            )
        if not self.folder_exists(final):
            raise ValueError(f"{what} names {final}, which does not exist (nothing was uploaded there).")
        return final

    @property
    def is_remote(self) -> bool:
        return False

    def folder_exists(self, path: str) -> bool:
        return os.path.isdir(path)

    def stage(self, source: str, name: str, attempt: int, index: int, rank: int, move: bool = False) -> str:
        """Put one rank's checkpoint files of report ``index`` where the driver commits them
        from (a worker's side, or local mode); returns where they went. ``move``: the folder
        is the run's now (``delete_local_checkpoint_after_upload``), so it may be moved rather
        than copied when that is possible.

        Raises:
            FileNotFoundError: ``source`` is not a folder.
            DiskFullError: The disk is full; nothing staged is left.
        """
        return layout.stage_files(self.run_dir, source, attempt, index, rank, move=move)

    def collect(self, rank: int, attempt: int, index: int, staged: str, transfer: FileTransfer | None) -> str:
        """The staged folder of ``rank`` as the driver commits it (see ``CopyBackRunStorage``)."""
        return staged

    def commit(
        self, staged: list[str], name: str, metrics: dict[str, Any], index: int, validating: bool = False
    ) -> Checkpoint:
        """Commit staged folders (earlier ones win on a clash) as checkpoint ``name`` of report
        ``index``, record it in the index and apply retention; crash-consistent. ``validating``:
        a validation of it follows (retention keeps it until then)."""
        status = PENDING_VALIDATION if validating else COMMITTED
        return self.checkpoints.commit(staged, name, metrics, index, status)

    # ----------------------------------------------------------------- after reports, at the end
    @property
    def uploads(self) -> bool:
        """Whether the run's files are uploaded after they are written (reports are flushed
        before each upload, and the console's last line waits for the final one)."""
        return False

    def reported(self, checkpoint: Checkpoint | None) -> None:  # noqa: B027 (only uploads act on it)
        """A report round ended (``metrics.jsonl`` is flushed)."""

    def clean_after_failure(self, failures: Sequence[WorkerFailure] = ()) -> None:
        """Remove what a failed attempt left half-done (staged files, half-built folders)."""
        self.checkpoints.clean_leftovers()

    def stop(self) -> None:  # noqa: B027 (only uploads act on it)
        """The driver is stopping (Ctrl-C): what is left to store gets a short bound."""

    def why(self, error: BaseException) -> str:
        """Why a ``StorageError`` stopped the run, as the console says it."""
        return str(error)

    def close(self, failed: bool) -> bool:
        """The ``fit()`` is over (``failed``: by an error): store what is left. Returns whether
        everything is stored.

        Raises:
            StorageError: The training finished, but its results could not all be stored.
        """
        return True
