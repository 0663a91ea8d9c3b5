"""Local mode (``ScalingConfig(num_workers=0)``): the training function runs in the driver
process, as rank 0 of 1, and its reports go through the same run storage as a worker group's:
``metrics.jsonl``, committed checkpoints with retention, ``run.json``, resume by name, local
or remote storage. There are no restarts (there is no process to restart)."""

from __future__ import annotations

import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from ddptrain import context
from ddptrain.checkpoint import Checkpoint
from ddptrain.driver.run import Run
from ddptrain.errors import WorkerFailure, WorkerGroupError
from ddptrain.result import Result
from ddptrain.wire import protocol

__all__ = ["LocalReports", "fit_local"]


# Local mode's place in its run: rank 0 of 1, on no GPU of its own.
_ONLY_RANK = protocol.WorkerSpec(
    rank=0, local_rank=0, node_rank=0, world_size=1, local_world_size=1, devices=(), env={}
)


class LocalReports:
    """Where ``report()`` sends a local-mode report (the session's :class:`~ddptrain.context.ReportSink`):
    staged (or uploaded), committed and recorded at once, in the calling thread.

    Args:
        run: The run.
        attempt: The attempt number reports are recorded under.
    """

    def __init__(self, run: Run, attempt: int) -> None:
        self.run = run
        self.attempt = attempt

    def report(
        self,
        session: context._Session,
        metrics: dict[str, Any],
        checkpoint: Checkpoint | None,
        dir_name: str | None,
        upload: context.Upload,
        validation: bytes | None = None,
    ) -> None:
        """Persist report ``session.report_index``; ``session.checkpoint`` becomes the committed
        checkpoint, if one was passed. In this process an ``ASYNC`` upload is made before this
        returns, as ``SYNC`` (there is no training process to free).

        Raises:
            ValueError: ``dir_name`` cannot be a checkpoint of this run, or a checkpoint put
                in place is not the run's checkpoint folder.
        """
        run, index = self.run, session.report_index
        committed = None
        run.record_metrics(metrics, self.attempt)
        run.flush_metrics()
        if checkpoint is not None:
            name = dir_name or f"checkpoint_{index:06d}"
            in_place = upload.mode is context.CheckpointUploadMode.NO_UPLOAD or upload.upload_fn is not None
            problem = None if in_place else run.name_problem(name)
            if problem is not None:
                raise ValueError(problem)
            staged = context.persist_checkpoint(session, checkpoint, name, index, upload)
            problem = run.name_problem(name, [staged]) if in_place else None
            if problem is not None:
                raise ValueError(problem)
            committed = run.commit_checkpoint([staged], name, metrics, index, validation)
        run.after_report([metrics], committed)
        run.validations.poll()
        if committed is not None:
            session.checkpoint = committed

    def reported_checkpoints(
        self, session: context._Session, timeout_s: float | None, validated: bool
    ) -> list[context.ReportedCheckpoint]:
        """The run's kept checkpoints, from its index in this process; ``validated``: once no
        validation is queued or running (or ``timeout_s`` is over)."""
        run = self.run
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        run.validations.poll()
        while validated and run.validations.validating() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)
            run.validations.poll()
        return [
            context.ReportedCheckpoint(c, metrics, context.ReportedCheckpointStatus(status))
            for c, metrics, status in run.checkpoints.reported_with_status()
        ]


def fit_local(run: Run, fn: Callable[[], Any], dataset_shards: dict[str, Any], experiment_name: str) -> Result:
    """Run ``fn`` in this process as the run's only rank, persisting what it reports.

    Raises:
        WorkerGroupError: ``fn`` raised (the run is marked ERRORED; its reports are kept).
    """

    def body(attempt: int) -> list[Any]:
        session = context.build_session(
            run.run_info(attempt),
            _ONLY_RANK,
            LocalReports(run, attempt),
            dataset_shards=dataset_shards,
            checkpoint=run.latest_checkpoint,
            storage=run.storage,
            experiment_name=experiment_name,
        )
        previous = context._session
        context._set_session(session)
        failed = True
        try:
            value = fn()
            failed = False
        except Exception as exc:
            failure = WorkerFailure(
                rank=0,
                host=socket.gethostname(),
                pid=None,
                exitcode=None,
                exception=exc,
                traceback_str="".join(traceback.format_exception(exc)),
            )
            raise WorkerGroupError.from_failures([failure], None) from exc
        finally:
            context.run_end_hooks(session, failed)
            context._set_session(previous)
        return [value]

    return _fit_in_process(run, body)


def _fit_in_process(run: Run, body: Callable[[int], list[Any]]) -> Result:
    """``body(attempt)`` runs the training function in this process and returns its return
    values; the run's files, status and lock are handled as for a worker group (``Run.opened``).

    Raises:
        WorkerGroupError: What ``body`` raised when the function failed (no restarts).
    """
    with run.opened(workers=1, hosts=1) as index:
        run.save_status("RUNNING", attempt=index, local_mode=True)
        try:
            return_values = body(index)
        except WorkerGroupError as error:
            run.ended(error=error.failures[0].headline() if error.failures else str(error))
            raise
        run.validations.finish()  # bounded: DDPTRAIN_VALIDATION_WAIT_S
        run.ended()
    return run.result(return_values)
