"""One ``fit()`` call in the driver: the run's state, its directory, what it reported, the Result.

``Run`` holds what outlives each attempt (each attempt sees it as an ``AttemptContext`` and
a ``ReportSink``): the configs, the run directory (local, or the
working copy of a run on remote storage), the metrics and checkpoints reported so far, and the
run's status. ``ddptrain.controller`` runs its attempts; local mode (``num_workers=0``) runs
the function in this process (``ddptrain.driver.local_run``). Both open the run with :meth:`Run.opened`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddptrain.callbacks import TrainRunContext
from ddptrain.checkpoint import Checkpoint
from ddptrain.config import CheckpointConfig
from ddptrain.driver.attempt import AttemptContext
from ddptrain.driver.plan import Plan
from ddptrain.driver.progress import Progress
from ddptrain.driver.run_validations import RunValidations
from ddptrain.driver.validation import Task
from ddptrain.errors import ControllerError, StorageError, WorkerFailure, disk_full_error
from ddptrain.result import Result
from ddptrain.storage import layout as storage
from ddptrain.storage.base import RunStorage
from ddptrain.storage.checkpoint_manager import CheckpointManager
from ddptrain.storage.location import RunLocation
from ddptrain.storage.open import run_storage
from ddptrain.wire import protocol

if TYPE_CHECKING:
    from ddptrain.backend import BackendConfig
    from ddptrain.config import DataConfig, RunConfig, ScalingConfig, ValidationConfig
    from ddptrain.data.ingest import DatasetIngest

__all__ = ["Run"]

_logger = logging.getLogger(__name__)


class Run:
    """State of one ``fit()``: configs, run directory, reported metrics and checkpoints.

    Args:
        payload: The cloudpickled training function and its config.
        datasets: The trainer's datasets; each start of the group gets new shard specs.
    """

    def __init__(
        self,
        *,
        payload: bytes,
        trainer_bytes: bytes | None = None,
        train_loop_config: dict[str, Any] | None,
        scaling_config: ScalingConfig,
        run_config: RunConfig,
        backend_config: BackendConfig,
        dataset_config: DataConfig,
        datasets: DatasetIngest | None = None,
        validation_config: ValidationConfig | None = None,
    ) -> None:
        self.payload = payload
        self.datasets = datasets
        self.trainer_bytes = trainer_bytes
        self.scaling_config = scaling_config
        self.run_config = run_config
        self.backend_config = backend_config
        self.run_id = uuid.uuid4().hex
        self.where = RunLocation.of(run_config)  # run_dir: on remote storage, a local working copy
        self.name, self.storage_path, self.run_dir = self.where.name, self.where.storage_path, self.where.run_dir
        self.location = self.where.shown
        self.layout = storage.RunLayout(self.run_dir)
        self.context = TrainRunContext(
            run_id=self.run_id,
            run_config=run_config,
            train_loop_config=train_loop_config,
            scaling_config=scaling_config,
            backend_config=backend_config,
            dataset_config=dataset_config,
        )
        self.metrics_history: list[dict[str, Any]] = []
        self.report_world_sizes: list[int] = []  # of each report of metrics_history
        hosts = Plan.read_hosts(scaling_config)  # a bad host list fails here, before any host is reached
        self.storage: RunStorage = run_storage(
            self.where, run_config.checkpoint_config or CheckpointConfig(), over_hosts=hosts is not None
        )
        self.start_checkpoint: Checkpoint | None = None  # resume_from_checkpoint
        self._metrics_lines: list[tuple[dict[str, Any], str]] = []  # recorded, not written yet (flush_metrics)
        # Workers on other hosts get the storage's credentials and endpoint from the driver.
        self._env_vars = {**self.storage.worker_env(), **run_config._env_vars()}
        self._plan: Plan | None = None  # made under the run's lock (``opened``): it may probe hosts
        self.left_out: frozenset[str] = frozenset()  # an elastic run's lost hosts, not in the next plans
        self._lost_reports = 0  # reports the checkpoint index knows of but metrics.jsonl lost
        self._last_attempt = -1  # the highest attempt number in an earlier run's metrics
        self.progress = Progress(self.name, self.location)
        self.progress.scored = bool(
            run_config.checkpoint_config and run_config.checkpoint_config.checkpoint_score_attribute
        )
        # The checkpoints reported with `validation=...`, validated one at a time beside training.
        self.validations = RunValidations(
            validation_config, hosts, self._env_vars, self.layout, self.run_id, self.storage, self.progress, self
        )
        self._attempt = 0  # the attempt of the latest report (for the validation lines)
        self._run_json: dict[str, Any] = {}
        self._ended_line: tuple[bool, tuple[str, dict[str, Any]] | None, str] | None = None  # for the console

    # ----------------------------------------------------------------- what workers get
    def run_info(self, attempt: int) -> protocol.RunInfo:
        """What a worker needs to know of this run (it travels with the bootstrap, or to warm
        workers in a ``BeginRun`` message)."""
        return protocol.RunInfo(
            run_id=self.run_id,
            attempt=attempt,
            name=self.name,
            storage=self.storage.spec(self.latest_checkpoint),
            # Numbered on from the checkpoint index too: metrics.jsonl may have lost lines.
            report_index=len(self.metrics_history) + self._lost_reports,
            argv=tuple(sys.argv),
            log_level=self.run_config.logging_config.log_level if self.run_config.logging_config else "INFO",
            validates=self.validations.config is not None,
        )

    def dataset_shards(self) -> dict[int, Any] | None:
        """Each rank's shard specs for a new start (datasets given as functions are built again)."""
        if self.datasets is None:
            return None
        return self.datasets.shards(remote_ranks=self.plan.remote_ranks(), world_size=self.plan.world_size)

    def log_dir(self, attempt: int) -> Path:
        return self.layout.attempt_logs(attempt)

    def attempt_context(self, index: int) -> AttemptContext:
        """What attempt ``index`` needs to start and steer its group (new dataset shards)."""
        log_dir = self.log_dir(index)
        datasets = self.dataset_shards()
        return AttemptContext(
            index=index,
            run_info=self.run_info(index),
            payload=self.payload,
            datasets=datasets,
            log_dir=log_dir,
            run_dir=self.run_dir,
            storage=self.storage,
            backend_config=self.backend_config,
            progress=self.progress,
        )

    def first_attempt(self) -> int:
        """The number of this ``fit()``'s first attempt: attempts of a run continue across the
        ``fit()`` calls that resume it, after the highest number in its logs or metrics (as
        read by ``_load_previous``)."""
        return max([self._last_attempt, *self.layout.attempts()]) + 1

    # ----------------------------------------------------------------- what workers report
    def record_metrics(self, metrics: dict[str, Any], attempt: int) -> None:
        """Record rank 0's metrics of one report: one JSON line, written by :meth:`flush_metrics`."""
        self.metrics_history.append(metrics)
        self._attempt = attempt
        world_size = self._plan.world_size if self._plan is not None else 1
        self.report_world_sizes.append(world_size)
        line = {
            "time": time.time(),
            "attempt": attempt,
            "world_size": world_size,
            "metrics": storage.to_jsonable(metrics),
        }
        self._metrics_lines.append((line, json.dumps(line) + "\n"))  # ASCII: its length is its size in bytes
        self.progress.recorded(metrics, len(self.metrics_history) + self._lost_reports)

    def flush_metrics(self) -> None:
        """Append the lines recorded since the last call to ``metrics.jsonl`` in one write, and
        flush it to the operating system (a crash of the driver loses none of them; there is no
        fsync, as for every file of the run). The driver calls it after each batch of messages
        and before anything acts on a report (its checkpoint's commit, the callbacks)."""
        if not self._metrics_lines:
            return
        lines, self._metrics_lines = self._metrics_lines, []
        self.storage.append_metrics(lines)

    @property
    def checkpoints(self) -> CheckpointManager:
        """The run's committed checkpoints (index and retention)."""
        return self.storage.checkpoints

    @property
    def latest_checkpoint(self) -> Checkpoint | None:
        """What ``get_checkpoint()`` returns to a (re)started group."""
        return self.checkpoints.latest or self.start_checkpoint

    @property
    def latest_path(self) -> str | None:
        """Where :attr:`latest_checkpoint` is (``None``: the run starts from scratch)."""
        latest = self.latest_checkpoint
        return latest.path if latest is not None else None

    def name_problem(self, name: str, staged: Sequence[str] = ()) -> str | None:
        """Why a checkpoint may not be committed as ``name`` from ``staged``, or ``None`` when it may."""
        return self.storage.name_problem(name, staged)

    def commit_checkpoint(
        self, staged: list[str], name: str, metrics: dict[str, Any], index: int, validation: bytes | None = None
    ) -> Checkpoint:
        """Commit staged files as checkpoint ``name``, record it, and apply retention;
        ``validation`` (the report's request): queue its validation."""
        self.flush_metrics()  # a checkpoint's report is on disk before the checkpoint
        checkpoint = self.storage.commit(staged, name, metrics, index, validating=validation is not None)
        self.progress.committed(checkpoint.path)
        if validation is None:  # else its validation may bring the score
            self.validations.check_scored(name, metrics)
        else:
            self.validations.submit(Task(name, checkpoint, index, self._attempt, validation))
        return checkpoint

    def reported_checkpoints(self) -> list[tuple[str, dict[str, Any], str]]:
        """Every checkpoint reported so far, with its metrics and status (``get_all_reported_checkpoints()``)."""
        return [(c.path, m, status) for c, m, status in self.checkpoints.reported_with_status()]

    # ----------------------------------------------------------------- validations (RunValidations)
    def record_validation(self, line: dict[str, Any], report_index: int, metrics: dict[str, Any]) -> None:
        """A validation's line for ``metrics.jsonl``; its metrics join those of its report."""
        self._metrics_lines.append((line, json.dumps(line) + "\n"))
        self.flush_metrics()
        position = report_index - 1 - self._lost_reports  # that report in metrics_history (Result.metrics)
        if metrics and 0 <= position < len(self.metrics_history):
            self.metrics_history[position] = {**self.metrics_history[position], **metrics}

    def record_validation_error(self, entry: dict[str, str]) -> None:
        """A failed validation, in ``run.json`` (``ddptrain show``)."""
        self._run_json.setdefault("validation_errors", []).append(entry)
        if self._run_json.get("status") in ("RUNNING", "RESTARTING"):
            self.save_status(self._run_json["status"])

    def after_report(self, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        """Every rank made its report (and its checkpoint is committed and acknowledged)."""
        if self.storage.uploads or self.run_config.callbacks:
            self.flush_metrics()  # what the upload and the callbacks may read
        self.progress.reported(metrics[0], len(self.metrics_history) + self._lost_reports)
        self.storage.reported(checkpoint)
        for callback in self.run_config.callbacks or []:
            callback.after_report(self.context, metrics, checkpoint)

    # ----------------------------------------------------------------- the fit loop
    def _load_previous(self) -> None:
        """Pick up an earlier run of the same name: its checkpoints and metrics. Loud on purpose."""
        earlier = self.storage.load_earlier()
        self.metrics_history = earlier.metrics
        self.report_world_sizes = list(earlier.world_sizes)
        self._last_attempt, self._lost_reports = earlier.last_attempt, earlier.lost_reports

    def _prepare_dir(self) -> None:
        """Write the run's own files (``_load_previous`` has already cleaned up after a crash)."""
        # run.json (argv) and trainer.pkl (the pickled config) are the user's secrets: 0600.
        self._run_json = {
            "name": self.name,
            "run_id": self.run_id,
            "started": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "argv": sys.argv,
            "num_workers": self._plan.world_size if self._plan is not None else self.scaling_config.max_workers,
            "use_gpu": self.scaling_config.use_gpu,
            "hosts": self._host_names(),
            "backend_config": repr(self.backend_config),
            "status": "RUNNING",
        }
        self.save_status("RUNNING")
        if self.trainer_bytes is not None:
            self.storage.write_trainer(self.trainer_bytes)
        self.storage.open_metrics()

    def save_status(self, status: str, **fields: Any) -> None:
        """Record how the run stands in ``run.json`` (read by ``ddptrain runs`` and ``show``):
        RUNNING, RESTARTING, FINISHED, ERRORED or ABORTED (Ray Train V2's words), or PREEMPTED
        (ddptrain's: a preemption notice stopped it, and a rerun resumes it). On remote
        storage it is uploaded (the final one with the run's last uploads, in ``opened``), or
        a ``StorageError`` raised (``RunStorage.save_status``)."""
        self._run_json.update(status=status, **fields)
        ended = status in ("FINISHED", "ERRORED", "ABORTED", "PREEMPTED")
        if ended:
            self._run_json["ended"] = time.time()
        self.storage.save_status(self._run_json, ended)

    @contextlib.contextmanager
    def opened(self, *, workers: int | None = None, hosts: int | None = None) -> Iterator[int]:
        """The run, open for one ``fit()``: locked, an earlier run of its name picked up, its
        files written; yields the number of the first attempt.

        ``hosts=None``: the run's placement plan is made here, once the lock is held (hosts
        are reached only then, to count their GPUs), and the hosts are counted from it.

        On the way out the metrics file is closed and, on remote storage, everything uploaded
        (``RunStorage.close``: after the training finished, a failure raises StorageError).
        A ``fit()`` stopped from the driver's side (Ctrl-C, an error of the driver) leaves the
        run ABORTED; one stopped by a ``StorageError``, ERRORED. A full disk where the driver
        writes (logs, metrics, checkpoints, the index) raises ``ControllerError`` caused by a
        ``DiskFullError`` naming the file.
        """
        try:
            with self.storage.lock():
                self._load_previous()
                if hosts is None:
                    self._plan = self.new_plan()
                    self._plan.check_gpus()
                    hosts = len(self._plan.placement.hosts) if self._plan.placement is not None else 1
                failed = True
                try:
                    self._prepare_dir()
                    index = self.first_attempt()
                    workers = self.plan.world_size if workers is None else workers
                    self.progress.started(workers=workers, hosts=hosts, attempt=index, resume_from=self.latest_path)
                    yield index
                    failed = False
                except BaseException as exc:
                    if not isinstance(exc, Exception):
                        self.storage.stop()  # Ctrl-C: what is left to store gets a bound of seconds
                    if self._run_json.get("status") in ("RUNNING", "RESTARTING"):  # not ended by a failure
                        if isinstance(exc, StorageError):  # the store failing is the run failing: ERRORED
                            why = self.storage.why(exc)
                            self._ended_line = (False, self._best(), f"StorageError: {why}")
                        with contextlib.suppress(OSError):  # a full disk: the error that got us here says so
                            status = "ERRORED" if isinstance(exc, StorageError) else "ABORTED"
                            self.save_status(status, error=f"{type(exc).__name__}: {exc}")
                    raise
                finally:
                    self.validations.stop()  # none is left running or queued past fit()
                    if self.storage.metrics_open:
                        with contextlib.suppress(OSError):  # as above
                            self.flush_metrics()  # what a failure cut short between two batches
                        self.storage.write_summary()
                        with contextlib.suppress(OSError):  # as above
                            self.storage.close_metrics()
                    if self.storage.uploads:  # the last uploads, then the console's last line
                        uploaded = False
                        try:
                            uploaded = self.storage.close(failed)
                        finally:
                            self._say_ended(None if uploaded else self.run_dir)
        except OSError as exc:
            full = disk_full_error(exc, exc.filename or self.run_dir)
            if full is None:
                raise
            raise ControllerError(f"Training stopped: {full}") from full

    def _say_ended(self, where: str | None = None) -> None:
        """The console's last line (on remote storage after the last uploads; ``where``: if failed)."""
        ending, self._ended_line = self._ended_line, None
        if ending is not None:
            self.progress.finished(*ending, where=where)

    def new_plan(self) -> Plan:
        """A placement plan for the next attempt (the host list is read again)."""
        return Plan(self.scaling_config, self._env_vars, self.backend_config.shares_visible_gpus(), self.left_out)

    @property
    def plan(self) -> Plan:
        """The placement plan of the current attempt (made by ``opened``, under the run's lock)."""
        if self._plan is None:
            raise RuntimeError("the run's plan is made when the run is opened (Run.opened)")
        return self._plan

    def use_plan(self, plan: Plan, attempt: int | None = None, why: str = "") -> None:
        """Run the next attempts on ``plan``: an elastic run's world size may change (``why``),
        which the console and ``run.json`` (``ddptrain show``) record with the ``attempt``."""
        before = self._plan.world_size if self._plan is not None else None
        self._plan = plan
        self._run_json["hosts"] = self._host_names()
        self._run_json["num_workers"] = plan.world_size
        if before is not None and before != plan.world_size:
            line = f"world size {before} -> {plan.world_size} from attempt {attempt}: {why}"
            self.progress.say(f"ddptrain: {line}")
            resizes = self._run_json.setdefault("resizes", [])
            resizes.append({"attempt": attempt, "from": before, "to": plan.world_size, "why": why, "time": time.time()})

    def _host_names(self) -> list[str]:
        if self._plan is None or self._plan.placement is None:
            return [socket.gethostname()]
        return [h.name for h in self._plan.placement.hosts]

    def ended(self, error: str | None = None) -> None:
        """The run is over: FINISHED, or ERRORED with ``error`` (the console says so at once, or
        on remote storage once the run's last uploads are done)."""
        self._ended_line = (error is None, self._best(), error or "")
        if not self.storage.uploads:  # else once the last uploads are done (``opened``)
            self._say_ended()
        if error is None:
            self.save_status("FINISHED")
        else:
            self.save_status("ERRORED", error=error)

    def preempted(self, reason: str) -> None:
        """The run was stopped by a preemption notice: PREEMPTED in ``run.json``, with why and
        the checkpoint a rerun resumes from (the console says so at once, or on remote storage
        once the run's last uploads are done)."""
        latest = self.latest_path
        self._ended_line = None
        self.progress.preempted(reason, latest)
        self.save_status("PREEMPTED", preempted={"reason": reason, "checkpoint": latest})

    def attempt_failed(self, index: int, failure: WorkerFailure) -> None:
        """Record the root cause of attempt ``index`` in ``run.json`` (``ddptrain show``)."""
        errors = self._run_json.setdefault("attempt_errors", [])
        errors.append({"attempt": index, "error": failure.headline(), "log": failure.log_path})

    def result(self, return_values: list[Any]) -> Result:
        return Result(
            metrics=self.metrics_history[-1] if self.metrics_history else None,
            checkpoint=self.latest_checkpoint,
            path=self.location,
            metrics_history=list(self.metrics_history),
            report_world_sizes=list(self.report_world_sizes),
            best_checkpoints=self.checkpoints.best_checkpoints(),
            return_value=return_values[0] if return_values else None,
            return_values=return_values,
            _storage_filesystem=self.storage.filesystem,
        )

    def clean_after_failure(self, failures: list[WorkerFailure] | tuple[()] = ()) -> None:
        """Remove what the failed attempt left half-done, and store its logs (see
        ``RunStorage.clean_after_failure``)."""
        self.storage.clean_after_failure(failures)

    def _best(self) -> tuple[str, dict[str, Any]] | None:
        """The best checkpoint by the configured score (the latest without one), for the summary."""
        ranked = self.checkpoints.best_checkpoints()
        return (ranked[-1][0].path, ranked[-1][1]) if ranked else None

    def after_exception(self, failures: list[WorkerFailure]) -> None:
        """Tell the run's callbacks how an attempt failed (their own errors are logged)."""
        exceptions = {f.rank: f.exception for f in failures}
        for callback in self.run_config.callbacks or []:
            try:
                callback.after_exception(self.context, exceptions)  # type: ignore[arg-type]
            except Exception as exc:
                _logger.warning("ddptrain: callback %r failed in after_exception: %r", callback, exc)
