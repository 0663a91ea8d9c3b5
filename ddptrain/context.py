"""The worker-side API: ``report``, ``get_context``, ``get_checkpoint``, ``get_dataset_shard``.

These run inside the training function, in a worker process (or in the driver process in
local mode, ``num_workers=0``). One module-global session holds the worker's state; it is built
by :func:`build_session` in both, and differs only in where its reports go (its
:class:`ReportSink`: the worker's channel to the driver, or the local run itself).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ddptrain import report_config
from ddptrain.checkpoint import Checkpoint
from ddptrain.errors import DdpTrainError
from ddptrain.report_config import (
    CheckpointConsistencyMode,
    CheckpointUploadMode,
    ReportedCheckpoint,
    ReportedCheckpointStatus,
    Upload,
)
from ddptrain.storage.upload_process import UploadProcess
from ddptrain.storage.uploads import CheckpointUploads
from ddptrain.train_context import StorageContext, TrainContext
from ddptrain.wire import protocol

if TYPE_CHECKING:
    from ddptrain.storage.base import RunStorage
    from ddptrain.wire.channel import WorkerChannel

__all__ = [
    "TrainContext",
    "StorageContext",
    "report",
    "get_context",
    "get_checkpoint",
    "get_dataset_shard",
    "get_all_reported_checkpoints",
    "get_preemption_info",
    "PreemptionInfo",
    "ReportedCheckpoint",
    "ReportedCheckpointStatus",
    "CheckpointUploadMode",
    "CheckpointConsistencyMode",
]

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreemptionInfo:
    """A preemption notice, as ``get_preemption_info()`` returns it (Ray's fields, and a reason).

    Attributes:
        deadline_ms: When the run stops at the latest (UNIX time in milliseconds): report a
            final checkpoint before then. ``None`` if no deadline is known.
        preempted_node_to_ranks: The hosts going away, each with the world ranks it runs.
        reason: What the notice was (ddptrain's own field), e.g. ``"SIGTERM to the driver"``.
    """

    deadline_ms: int | None
    preempted_node_to_ranks: dict[str, list[int]]
    reason: str = ""

    @property
    def preempted_node_ids(self) -> list[str]:
        """The hosts going away, sorted."""
        return sorted(self.preempted_node_to_ranks)

    @property
    def preempted_ranks(self) -> list[int]:
        """The world ranks on those hosts, sorted."""
        return sorted({r for ranks in self.preempted_node_to_ranks.values() for r in ranks})


class ContextError(DdpTrainError, RuntimeError):
    """A worker-only function was called outside a training function."""


class ReportSink(Protocol):
    """Where a session's reports go: ``ddptrain.worker.reports.ChannelReports`` in a worker,
    the local run in local mode (``ddptrain.driver.local_run.LocalReports``)."""

    def report(
        self,
        session: _Session,
        metrics: dict[str, Any],
        checkpoint: Checkpoint | None,
        dir_name: str | None,
        upload: Upload,
        validation: bytes | None = None,
    ) -> None:
        """Persist report number ``session.report_index`` (checked by ``report()``); sets
        ``session.checkpoint`` to the committed checkpoint, if one was passed and committed
        before this returns. ``validation``: validate the checkpoint once committed (the
        pickled request)."""

    def reported_checkpoints(
        self, session: _Session, timeout_s: float | None, validated: bool
    ) -> list[ReportedCheckpoint]:
        """The run's kept checkpoints (see :func:`get_all_reported_checkpoints`)."""


@dataclass
class _Session:
    """Everything a worker (or local mode) knows while the training function runs."""

    context: TrainContext
    sink: ReportSink
    channel: WorkerChannel | None = None
    run_dir: str | None = None
    attempt: int = 0
    checkpoint: Checkpoint | None = None
    dataset_shards: dict[str, Any] = field(default_factory=dict)
    devices: list[Any] = field(default_factory=list)
    storage: RunStorage | None = None  # where reported checkpoints go (``None``: no run)
    uploads: CheckpointUploads | None = None  # its ASYNC uploads (made by the first one)
    uploader: UploadProcess | None = None  # where a worker's ASYNC uploads run (started by the first)
    report_index: int = 0
    validates: bool = False  # the trainer has a ValidationConfig
    collective_index: int = 0
    end_hooks: list[Callable[[bool], None]] = field(default_factory=list)  # see on_training_end
    preemption: PreemptionInfo | None = None  # set by the heartbeat thread (get_preemption_info)

    def checkpoint_at(self, path: str) -> Checkpoint:
        """The run's checkpoint at ``path`` (a path the driver sent)."""
        return self.storage.checkpoint_at(path) if self.storage is not None else Checkpoint(path)

    def call_driver(self, message: Any) -> Any:
        """Send a message and wait for the driver's reply to it."""
        assert self.channel is not None
        self.channel.send(message)
        return self.channel.recv()


def build_session(
    run: protocol.RunInfo,
    place: protocol.WorkerSpec,
    sink: ReportSink,
    *,
    dataset_shards: dict[str, Any],
    checkpoint: Checkpoint | None,
    storage: RunStorage | None = None,
    channel: WorkerChannel | None = None,
    experiment_name: str | None = None,
) -> _Session:
    """The session of rank ``place.rank`` in ``run``: for a worker (its channel the sink) and
    for local mode (``place`` is rank 0 of 1, the local run the sink) alike.

    Args:
        run: What the rank knows of the run (``Run.run_info``).
        place: Its ranks and devices.
        sink: Where its reports go.
        dataset_shards: Its dataset shards, by name.
        checkpoint: The checkpoint to resume from.
        storage: The run's storage, as this rank writes to it (``None``: no run).
        channel: Its channel to the driver (a worker's).
        experiment_name: The run's name as ``get_context()`` gives it (default: ``run.name``).
    """
    ctx = TrainContext(
        experiment_name=experiment_name or run.name,
        world_size=place.world_size,
        world_rank=place.rank,
        local_rank=place.local_rank,
        local_world_size=place.local_world_size,
        node_rank=place.node_rank,
        storage=StorageContext(run.storage.storage_path, run.name),
    )
    return _Session(
        context=ctx,
        sink=sink,
        channel=channel,
        run_dir=run.storage.run_dir,
        storage=storage,
        attempt=run.attempt,
        checkpoint=checkpoint,
        dataset_shards=dataset_shards,
        devices=list(place.devices),
        report_index=run.report_index,
        validates=run.validates,
        # A worker's uploads run in a process of their own; local mode's in the reporting thread.
        uploader=UploadProcess(run.storage, run.name) if storage is not None and channel is not None else None,
    )


_session: _Session | None = None


def _set_session(session: _Session | None) -> None:
    global _session
    _session = session


def _get_session(function: str) -> _Session:
    if _session is None:
        raise ContextError(
            f"`ddptrain.{function}()` can only be called inside a training function run by a "
            "ddptrain trainer (TorchTrainer / DataParallelTrainer)."
        )
    return _session


def report(
    metrics: dict[str, Any],
    checkpoint: Checkpoint | None = None,
    checkpoint_dir_name: str | None = None,
    checkpoint_upload_mode: Any = None,
    delete_local_checkpoint_after_upload: bool | None = None,
    checkpoint_upload_fn: Callable[[Checkpoint, str], Checkpoint] | None = None,
    validation: Any = False,
    validate_fn: Callable[..., dict[str, Any]] | None = None,
    validate_config: dict[str, Any] | None = None,
) -> None:
    """Report metrics, and optionally a checkpoint, from every worker.

    Contract: every worker must call ``report`` the same number of times. Rank 0's metrics
    become the run's metrics; every report is appended to ``metrics.jsonl`` in the run
    directory. Any subset of ranks may pass a checkpoint: their files are merged into one
    checkpoint folder (named by rank 0's ``checkpoint_dir_name``) under the run directory, and
    the checkpoint is committed (listed, kept by ``num_to_keep``, resumed from) only once every
    one of those ranks' files is there. With ``SYNC`` (the default) ``report`` returns on those
    ranks once it is committed, so the local folder may be deleted right after. With
    ``ASYNC`` it returns at once and an upload process of the worker uploads the files, in
    report order, at most ``DDPTRAIN_MAX_PENDING_UPLOADS`` (2) at a time (a report beyond that
    waits); **the folder must not be changed or deleted until its upload is done**, and it is
    deleted after it by default. The worker waits for its uploads when the training function
    returns; one that fails fails the run with a ``StorageError`` naming the store.
    Metrics-only reports do not wait for the other ranks.

    Args:
        metrics: A dict of picklable values; torch tensors are refused.
        checkpoint: Files to persist with this report.
        checkpoint_dir_name: Folder name of the persisted checkpoint (default
            ``checkpoint_<report index>``).
        checkpoint_upload_mode: A :class:`CheckpointUploadMode`: ``SYNC`` (default), ``ASYNC``,
            or ``NO_UPLOAD`` (the checkpoint already is the run's checkpoint folder
            ``get_context().get_storage().build_checkpoint_path_from_name(checkpoint_dir_name)``).
        delete_local_checkpoint_after_upload: Delete the local folder once it is uploaded
            (default: ``True`` for ``ASYNC``, else ``False``). ddptrain may then move the folder
            instead of copying it, on the same file system.
        checkpoint_upload_fn: ``fn(checkpoint, checkpoint_dir_name) -> Checkpoint`` uploads the
            files itself (in the background with ``ASYNC``); the checkpoint it returns must be
            the run's checkpoint folder named ``checkpoint_dir_name`` (as for ``NO_UPLOAD``),
            and is what gets committed.
        validation: ``True``: validate this report's checkpoint, once it is committed, with the
            trainer's ``ValidationConfig`` (its ``fn(checkpoint, **fn_kwargs)``, in a process of
            its own on the driver's host, while training goes on); a ``ValidationTaskConfig``:
            with its ``fn_kwargs`` instead of the trainer's. Its metrics are merged into the
            checkpoint's (see the checkpoints guide). On a rank that passes no checkpoint it
            is ignored.
        validate_fn: Ray's earlier form: ``validate_fn(checkpoint, validate_config)`` (or
            ``validate_fn(checkpoint)``) validates this report's checkpoint, as ``validation``.
        validate_config: The second argument of ``validate_fn``.

    Raises:
        ValueError: ``metrics`` holds tensors, the folder name is not a plain name, or a
            checkpoint put in place is not the run's checkpoint folder.
        TypeError: A metric cannot be pickled to the driver (a lock, a client).
        StorageError: An earlier ``ASYNC`` upload of this worker failed.
        DiskFullError: This report's staging, or an earlier ``ASYNC`` upload, found its disk full.
        RuntimeError: Called outside a training function.

    Example:
        >>> for epoch in range(3):
        ...     loss = train_one_epoch()
        ...     ddptrain.report({"epoch": epoch, "loss": loss})
    """
    session = _get_session("report")
    metrics = report_config.check_metrics(metrics)
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"`checkpoint` must be a ddptrain.Checkpoint, got {type(checkpoint).__name__}.")
    report_config.check_dir_name(checkpoint_dir_name)
    spec = (
        report_config.validation_spec(session.validates, validation, validate_fn, validate_config)
        if checkpoint is not None
        else None
    )
    upload = report_config.check_upload(
        checkpoint,
        checkpoint_upload_mode,
        delete_local_checkpoint_after_upload,
        checkpoint_upload_fn,
        session.run_dir,
    )
    if session.channel is not None:  # a worker: the metrics travel to the driver
        report_config.check_sendable(metrics)
    if session.uploads is not None:
        session.uploads.check()  # an earlier ASYNC upload failed
    session.report_index += 1
    session.sink.report(session, metrics, checkpoint, checkpoint_dir_name, upload, spec)


def persist_checkpoint(
    session: _Session,
    checkpoint: Checkpoint,
    name: str,
    index: int,
    upload: Upload,
    uploader: UploadProcess | None = None,
) -> str:
    """Put this rank's checkpoint files of report ``index`` where the driver commits them
    from (the run's storage decides: next to the run directory, a host's staging folder, or
    uploaded to the store), or check that the user put them in place (``NO_UPLOAD``,
    ``checkpoint_upload_fn``); then delete the local folder if asked. Returns the folder.
    ``uploader``: where the files are uploaded from (default: this process).

    Raises:
        ValueError: A checkpoint put in place is not the run's checkpoint folder ``name``.
        FileNotFoundError: The local folder does not exist.
        StorageError: The upload failed.
    """
    storage_ = session.storage
    assert storage_ is not None, "a session in a run has the run's storage"
    if upload.mode is CheckpointUploadMode.NO_UPLOAD:
        return storage_.adopt(checkpoint, name, "The checkpoint reported with `CheckpointUploadMode.NO_UPLOAD`")
    if upload.upload_fn is not None:
        uploaded = upload.upload_fn(checkpoint, name)
        if not isinstance(uploaded, Checkpoint):
            raise TypeError(f"`checkpoint_upload_fn` must return a ddptrain.Checkpoint, got {uploaded!r}.")
        staged = storage_.adopt(uploaded, name, "The checkpoint `checkpoint_upload_fn` returned")
    else:
        rank = session.context.get_world_rank()
        stage = uploader.stage if uploader is not None else storage_.stage
        staged = stage(checkpoint.path, name, session.attempt, index, rank, move=upload.delete_local)
    if upload.delete_local:
        shutil.rmtree(checkpoint.path, ignore_errors=True)
    return staged


def on_training_end(hook: Callable[[bool], None]) -> None:
    """Call ``hook(failed)`` in this worker once the training function returned or raised
    (``failed`` says which): for integrations that must close what they opened, such as a
    tracking run, since worker processes end without running ``atexit`` handlers. Hooks run
    newest first; one that raises is logged. Outside a training function this does nothing."""
    if _session is not None:
        _session.end_hooks.append(hook)


def run_end_hooks(session: _Session, failed: bool) -> None:
    """Run and clear ``session``'s end hooks (see :func:`on_training_end`)."""
    hooks, session.end_hooks = session.end_hooks, []
    for hook in reversed(hooks):
        try:
            hook(failed)
        except Exception as exc:
            _logger.warning("ddptrain: a training-end hook (%r) failed: %r", hook, exc)


def get_context() -> TrainContext:
    """This worker's :class:`TrainContext` (ranks, world size, run name, storage).

    Raises:
        RuntimeError: Called outside a training function.
    """
    return _get_session("get_context").context


def get_preemption_info() -> PreemptionInfo | None:
    """The run's preemption notice, or ``None`` while there is none (as Ray's).

    A SIGTERM to the driver (a spot instance's or a scheduler's notice) or to a host's agent
    gives every worker a :class:`PreemptionInfo` within a fraction of a second. The run then
    stops once a checkpoint reported after the notice is committed, or at
    ``deadline_ms`` (``DDPTRAIN_PREEMPTION_WINDOW_S`` after the notice), and is recorded as
    preempted; running the script again with the same ``RunConfig(name=...)`` resumes it
    from that checkpoint. A function that returns during the window finishes the run.

    Example:
        >>> def train_func():  # doctest: +SKIP
        ...     for step in range(start, steps):
        ...         train_step()
        ...         if ddptrain.get_preemption_info() is not None:
        ...             ddptrain.report({"step": step}, checkpoint=save(step))
    """
    return _get_session("get_preemption_info").preemption


def _set_preemption(info: PreemptionInfo) -> None:
    """Record a preemption notice for the current session (the worker's heartbeat thread)."""
    session = _session
    if session is not None and session.preemption is None:
        session.preemption = info


def get_checkpoint() -> Checkpoint | None:
    """The latest persisted checkpoint to resume from, or ``None`` on a fresh start.

    After a restart (``FailureConfig``) or a resumed run this is the latest checkpoint the
    run committed; during the run it is the latest checkpoint this worker reported.
    """
    return _get_session("get_checkpoint").checkpoint


def get_all_reported_checkpoints(
    consistency_mode: Any = None, timeout_s: float | None = None
) -> list[ReportedCheckpoint]:
    """The run's kept checkpoints in score order (worst first, as ``Result.best_checkpoints``),
    including those of earlier attempts and of a resumed run.

    As in Ray, this first waits until the driver has processed every ``report()`` call this
    worker made so far, on every rank: a checkpoint that another rank passed to the same
    ``report()`` call, and that is still being persisted, is included. With
    ``CheckpointConsistencyMode.VALIDATED`` (the default, as in Ray) it also waits until no
    validation is queued or running.

    Args:
        consistency_mode: ``CheckpointConsistencyMode.COMMITTED`` or ``VALIDATED`` (default).
        timeout_s: Stop waiting after this many seconds and return the checkpoints as they
            are then (``None``: wait as long as it takes).

    Returns:
        The run's kept checkpoints (in local mode, ``num_workers=0``, too).
    """
    session = _get_session("get_all_reported_checkpoints")
    if consistency_mode is None:
        consistency_mode = CheckpointConsistencyMode.VALIDATED
    try:
        mode = CheckpointConsistencyMode(getattr(consistency_mode, "value", consistency_mode))  # Ray's enum too
    except ValueError:
        raise ValueError(
            f"`consistency_mode` must be CheckpointConsistencyMode.COMMITTED or VALIDATED, got {consistency_mode!r}."
        ) from None
    validated = mode is CheckpointConsistencyMode.VALIDATED
    return session.sink.reported_checkpoints(session, timeout_s, validated)


def get_dataset_shard(dataset_name: str | None = None) -> Any:
    """This worker's shard of the trainer dataset ``dataset_name`` (default ``"train"``).

    Returns:
        A :class:`ddptrain.data.DataIterator` over the shard: this worker's equal share of
        the rows for a dataset in ``DataConfig.datasets_to_split``, the whole dataset
        otherwise. The same iterator is returned each time; read it once per epoch.

    Raises:
        KeyError: No dataset of that name was given to the trainer.

    Example:
        >>> shard = ddptrain.get_dataset_shard("train")
        >>> for epoch in range(3):
        ...     for batch in shard.iter_torch_batches(batch_size=64):
        ...         train_step(batch)
    """
    session = _get_session("get_dataset_shard")
    name = dataset_name or "train"
    try:
        return session.dataset_shards[name]
    except KeyError:
        known = sorted(session.dataset_shards)
        raise KeyError(
            f"Dataset shard for {name!r} not found. The trainer was given datasets {known}; "
            "pass `datasets={...}` to the trainer."
        ) from None
