"""Local mode (``ScalingConfig(num_workers=0)``): the training function runs in the driver
process, as rank 0 of 1, and its reports go through the same run storage as a worker group's:
``metrics.jsonl``, committed checkpoints with retention, ``run.json``, resume by name, local
or remote storage. There are no restarts (there is no process to restart)."""

from __future__ import annotations

import socket
import traceback
from collections.abc import Callable
from typing import Any

from ddptrain import context
from ddptrain.checkpoint import Checkpoint
from ddptrain.driver.run import Run
from ddptrain.errors import WorkerFailure, WorkerGroupError
from ddptrain.result import Result

__all__ = ["LocalReports", "fit_local"]


class LocalReports:
    """Where ``report()`` sends a local-mode report: staged (or uploaded), committed and
    recorded at once, in the calling thread.

    Args:
        run: The run.
        attempt: The attempt number reports are recorded under.
    """

    def __init__(self, run: Run, attempt: int) -> None:
        self.run = run
        self.attempt = attempt

    def report(
        self, metrics: dict[str, Any], checkpoint: Checkpoint | None, dir_name: str | None, index: int
    ) -> Checkpoint | None:
        """Persist report ``index``; returns the committed checkpoint, if one was passed.

        Raises:
            ValueError: ``dir_name`` cannot be a checkpoint of this run.
        """
        run = self.run
        committed = None
        run.record_metrics(metrics, self.attempt)
        run.flush_metrics()
        if checkpoint is not None:
            name = dir_name or f"checkpoint_{index:06d}"
            problem = run.name_problem(name)
            if problem is not None:
                raise ValueError(problem)
            staged = run.storage.stage(checkpoint.path, name, self.attempt, index, 0)
            committed = run.commit_checkpoint([staged], name, metrics, index)
        run.after_report([metrics], committed)
        return committed


def fit_local(run: Run, fn: Callable[[], Any], dataset_shards: dict[str, Any], experiment_name: str) -> Result:
    """Run ``fn`` in this process as the run's only rank, persisting what it reports.

    Raises:
        WorkerGroupError: ``fn`` raised (the run is marked ERRORED; its reports are kept).
    """

    def body(attempt: int) -> list[Any]:
        info = run.run_info(attempt)
        ctx = context.TrainContext(
            experiment_name=experiment_name,
            world_size=1,
            world_rank=0,
            local_rank=0,
            local_world_size=1,
            node_rank=0,
            storage=context.StorageContext(run.storage_path, run.name),
        )
        session = context._Session(
            context=ctx,
            run_dir=run.run_dir,
            attempt=attempt,
            checkpoint=run.latest_checkpoint,
            dataset_shards=dataset_shards,
            report_index=info.report_index,
            storage=run.storage,
            local_sink=LocalReports(run, attempt),
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
        run.ended()
    return run.result(return_values)
