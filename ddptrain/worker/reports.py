"""A worker's report path: its reports sent to the driver over its channel, its checkpoint
files staged (``SYNC``) or uploaded from its upload process in the background (``ASYNC``).

The worker's :class:`~ddptrain.context.ReportSink`; local mode's is
``ddptrain.driver.local_run.LocalReports``. ``report()`` checks its arguments in
``ddptrain.context`` and hands them here.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import cloudpickle

from ddptrain import _env
from ddptrain.checkpoint import Checkpoint
from ddptrain.context import ReportSink, _Session, persist_checkpoint
from ddptrain.errors import StorageError, is_disk_full
from ddptrain.report_config import CheckpointUploadMode, ReportedCheckpoint, ReportedCheckpointStatus, Upload
from ddptrain.storage.uploads import CheckpointUploads
from ddptrain.wire import protocol

__all__ = ["CHANNEL_REPORTS", "ChannelReports", "finish_uploads", "upload_error"]

_logger = logging.getLogger(__name__)


class ChannelReports:
    """A worker's reports: its checkpoint files staged (or uploaded), then sent to the driver,
    which commits them and answers; with ``ASYNC`` the report goes at once, the files follow
    from the upload thread (``protocol.Uploaded``) and nobody waits for the answer."""

    def report(
        self,
        session: _Session,
        metrics: dict[str, Any],
        checkpoint: Checkpoint | None,
        dir_name: str | None,
        upload: Upload,
        validation: bytes | None = None,
    ) -> None:
        channel = session.channel
        assert channel is not None, "a worker's session has its channel"
        rank, index = session.context.get_world_rank(), session.report_index
        if checkpoint is None:
            channel.send(protocol.Report(rank, index, metrics, None, dir_name))
            return
        name = dir_name or f"checkpoint_{index:06d}"
        if upload.mode is CheckpointUploadMode.ASYNC:
            if session.uploads is None:
                session.uploads = CheckpointUploads(_env.max_pending_uploads())
                channel.order_across_connections()  # the uploads send from a thread of their own

            def in_background() -> None:
                try:
                    staged = persist_checkpoint(session, checkpoint, name, index, upload, session.uploader)
                except BaseException as exc:
                    error = upload_error(session, exc, name, index)
                    # In the rank's log before the driver hears of it (it then stops this worker).
                    _logger.error("ddptrain: the checkpoint upload of report #%d failed: %s", index, error)
                    channel.send_aside(protocol.Uploaded(rank, index, None, _pickled(error), _described(error)))
                    if error is exc:
                        raise
                    raise error from exc
                channel.send_aside(protocol.Uploaded(rank, index, staged))

            announce = lambda: channel.send(  # noqa: E731
                protocol.Report(rank, index, metrics, None, dir_name, pending=True, validation=validation)
            )
            session.uploads.submit(index, announce, in_background)
            return
        # On a host that cannot see the run directory the staged files wait in a local cache,
        # and the driver copies them back over SSH before it commits the checkpoint.
        staged = persist_checkpoint(session, checkpoint, name, index, upload)
        reply = session.call_driver(protocol.Report(rank, index, metrics, staged, dir_name, validation=validation))
        assert isinstance(reply, protocol.Ack), reply
        if reply.problem or reply.path is None:  # the driver refused to commit it
            raise ValueError(reply.problem)
        session.checkpoint = session.checkpoint_at(reply.path)

    def reported_checkpoints(
        self, session: _Session, timeout_s: float | None, validated: bool
    ) -> list[ReportedCheckpoint]:
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))):
            raise TypeError(f"`timeout_s` must be a number of seconds or None, got {timeout_s!r}.")
        if session.uploads is not None:
            session.uploads.check()
        rank = session.context.get_world_rank()
        reply = session.call_driver(protocol.CheckpointsQuery(rank, session.report_index, timeout_s, validated))
        assert isinstance(reply, protocol.CheckpointsReply), reply
        return [
            ReportedCheckpoint(session.checkpoint_at(path), metrics, ReportedCheckpointStatus(status))
            for path, metrics, status in reply.reported
        ]


CHANNEL_REPORTS: ReportSink = ChannelReports()  # a worker's sink (its session holds the channel)


def upload_error(session: _Session, error: BaseException, name: str, index: int) -> BaseException:
    """``error`` of a background upload, as the run's failure: a ``StorageError`` that names
    the store (and says what to do when the folder was gone). A full disk stays the error it
    is (a ``DiskFullError`` naming the file and the space left), as in ``SYNC`` mode: the run
    is not restarted on it."""
    if isinstance(error, StorageError) or not isinstance(error, OSError) or is_disk_full(error):
        return error  # the store named already, the user's mistake (a ValueError, say), or a full disk
    where = session.storage.shown if session.storage is not None else session.run_dir
    hint = ""
    if isinstance(error, FileNotFoundError):
        hint = (
            " With `CheckpointUploadMode.ASYNC` the checkpoint folder must not be deleted or changed until its "
            "upload is done: make it with `tempfile.mkdtemp()`, not a `TemporaryDirectory` that ends with the report."
        )
    wrapped = StorageError(
        f"Uploading checkpoint {name!r} of report #{index} to {where} failed: {type(error).__name__}: {error}.{hint}"
    )
    wrapped.__cause__ = error
    return wrapped


def _pickled(error: BaseException) -> bytes | None:
    try:
        return cloudpickle.dumps(error)
    except Exception:
        return None


def _described(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


def finish_uploads(session: _Session) -> None:
    """The training function returned: wait for this worker's ``ASYNC`` uploads.

    Raises:
        StorageError: One failed.
    """
    if session.uploads is not None:
        session.uploads.wait()
    if session.uploader is not None:  # after a failure it ends with the worker process
        session.uploader.close()
