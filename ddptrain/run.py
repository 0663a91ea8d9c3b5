"""One ``fit()`` call in the driver: the run directory, attempts and restarts, the Result."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cloudpickle

from ddptrain import _env, protocol, storage
from ddptrain.callbacks import TrainRunContext
from ddptrain.checkpoint import Checkpoint
from ddptrain.checkpoint_manager import CheckpointManager
from ddptrain.config import CheckpointConfig
from ddptrain.driver import Attempt
from ddptrain.errors import (
    ControllerError,
    LaunchError,
    WorkerFailure,
    WorkerGroupError,
    disk_full_error,
    is_disk_full,
)
from ddptrain.launcher import Launcher
from ddptrain.plan import Plan
from ddptrain.progress import Progress
from ddptrain.remote_checkpoints import RemoteCheckpointManager
from ddptrain.result import Result
from ddptrain.run_location import RunLocation, load_earlier
from ddptrain.run_lock import RunLock
from ddptrain.run_mirror import RunMirror
from ddptrain.warm import keeps_warm, put_warm, take_warm
from ddptrain.worker_group import GroupFailed, WorkerGroup

if TYPE_CHECKING:
    from ddptrain.backend import BackendConfig
    from ddptrain.config import DataConfig, RunConfig, ScalingConfig
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
        self.location, self.remote = self.where.shown, self.where.remote
        self.layout = storage.RunLayout(self.run_dir)
        if self.remote is not None:
            self.mirror = RunMirror(self.remote, self.run_dir, self.remote.path(self.name))
        self.context = TrainRunContext(
            run_id=self.run_id,
            run_config=run_config,
            train_loop_config=train_loop_config,
            scaling_config=scaling_config,
            backend_config=backend_config,
            dataset_config=dataset_config,
        )
        self.metrics_history: list[dict[str, Any]] = []
        checkpoint_config = run_config.checkpoint_config or CheckpointConfig()
        self.checkpoints = (
            CheckpointManager(self.run_dir, checkpoint_config)
            if self.remote is None
            else RemoteCheckpointManager(self.run_dir, checkpoint_config, self.remote, self.remote.path(self.name))
        )
        self.start_checkpoint: Checkpoint | None = None  # resume_from_checkpoint
        self._metrics_file: Any = None
        failure_config = run_config.failure_config
        self._max_failures = failure_config.max_failures if failure_config else 0
        # Workers on other hosts get the storage's credentials and endpoint from the driver.
        env_vars = {**(self.remote.credential_env() if self.remote else {}), **run_config._env_vars()}
        self.plan = Plan(scaling_config, env_vars)  # a bad host list fails here
        self._failures_seen = 0
        self._lost_reports = 0  # reports the checkpoint index knows of but metrics.jsonl lost
        self._last_attempt = -1  # the highest attempt number in an earlier run's metrics
        self._spare: Launcher | None = None  # the next attempt's agent, started on a failure
        self.progress = Progress(self.name, self.location)
        self.progress.scored = bool(
            run_config.checkpoint_config and run_config.checkpoint_config.checkpoint_score_attribute
        )
        self._run_json: dict[str, Any] = {}

    # ----------------------------------------------------------------- what workers get
    def run_info(self, attempt: int) -> protocol.RunInfo:
        """What a worker needs to know of this run (it travels with the bootstrap, or to warm
        workers as the argument of ``ddptrain.worker.begin_run``)."""
        return protocol.RunInfo(
            run_id=self.run_id,
            attempt=attempt,
            name=self.name,
            storage_path=self.storage_path,
            run_dir=self.run_dir,
            checkpoint=self.latest_checkpoint.path if self.latest_checkpoint else None,
            storage=cloudpickle.dumps((self.remote, self.latest_checkpoint._fs if self.latest_checkpoint else None)),
            run_path=self.where.run_path,
            # Numbered on from the checkpoint index too: metrics.jsonl may have lost lines.
            report_index=len(self.metrics_history) + self._lost_reports,
            argv=tuple(sys.argv),
            log_level=self.run_config.logging_config.log_level if self.run_config.logging_config else "INFO",
        )

    def dataset_shards(self) -> dict[int, Any] | None:
        """Each rank's shard specs for a new start (datasets given as functions are built again)."""
        if self.datasets is None:
            return None
        return self.datasets.shards(remote_ranks=self.plan.remote_ranks())

    def log_dir(self, attempt: int) -> Path:
        return self.layout.attempt_logs(attempt)

    def first_attempt(self) -> int:
        """The number of this ``fit()``'s first attempt: attempts of a run continue across the
        ``fit()`` calls that resume it, after the highest number in its logs or metrics (as
        read by ``_load_previous``)."""
        return max([self._last_attempt, *self.layout.attempts()]) + 1

    # ----------------------------------------------------------------- what workers report
    def record_metrics(self, metrics: dict[str, Any], attempt: int) -> None:
        """Persist rank 0's metrics of one report (one JSON line, flushed)."""
        self.metrics_history.append(metrics)
        line = {"time": time.time(), "attempt": attempt, "metrics": storage.to_jsonable(metrics)}
        with storage.naming_full_disk(self.layout.metrics):
            self._metrics_file.write(json.dumps(line) + "\n")
            self._metrics_file.flush()

    @property
    def latest_checkpoint(self) -> Checkpoint | None:
        """What ``get_checkpoint()`` returns to a (re)started group."""
        return self.checkpoints.latest or self.start_checkpoint

    def name_problem(self, name: str) -> str | None:
        """Why a checkpoint may not be committed as ``name``, or ``None`` when it may."""
        try:
            target = storage.safe_child(self.run_dir, name)
        except ValueError as exc:
            return str(exc)
        if self.remote is None and target.exists() and not self.checkpoints.is_committed(name):
            return (
                f"`checkpoint_dir_name` {name!r} names a folder of the run directory that is not a "
                "checkpoint of this run; choose another name."
            )
        return None

    def commit_checkpoint(self, staged: list[str], name: str, metrics: dict[str, Any], index: int) -> Checkpoint:
        """Commit staged files as checkpoint ``name``, record it, and apply retention."""
        checkpoint = self.checkpoints.commit(staged, name, metrics, index)
        self.progress.committed(checkpoint.path)
        if self.remote is not None:
            self.mirror.push_metrics(force=True)
        return checkpoint

    def after_report(self, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        """Every rank made its report (and its checkpoint is committed)."""
        self.progress.reported(metrics[0], len(self.metrics_history) + self._lost_reports)
        if self.remote is not None:
            self.mirror.push_metrics()
        for callback in self.run_config.callbacks or []:
            callback.after_report(self.context, metrics, checkpoint)

    # ----------------------------------------------------------------- the fit loop
    def _load_previous(self) -> None:
        """Pick up an earlier run of the same name: its checkpoints and metrics. Loud on purpose."""
        earlier = load_earlier(self.where, self.checkpoints, self.mirror if self.remote is not None else None)
        self.metrics_history = earlier.metrics
        self._last_attempt, self._lost_reports = earlier.last_attempt, earlier.lost_reports

    def _prepare_dir(self) -> None:
        """Write the run's own files (``_load_previous`` has already cleaned up after a crash)."""
        # run.json (argv) and trainer.pkl (the pickled config) are the user's secrets: 0600.
        self._run_json = {
            "name": self.name,
            "run_id": self.run_id,
            "started": time.time(),
            "host": self.plan.hostname,
            "pid": os.getpid(),
            "argv": sys.argv,
            "num_workers": self.scaling_config.num_workers,
            "use_gpu": self.scaling_config.use_gpu,
            "hosts": [h.name for h in self.plan.placement.hosts] if self.plan.placement else [self.plan.hostname],
            "backend_config": repr(self.backend_config),
            "status": "RUNNING",
        }
        self._save_status("RUNNING")
        if self.trainer_bytes is not None:
            storage.write_atomic(self.layout.trainer, self.trainer_bytes, private=True)
            if self.remote is not None:
                self.mirror.push_file(self.layout.TRAINER)
        self._metrics_file = open(self.layout.metrics, "a+")  # noqa: SIM115
        if self._metrics_file.tell() > 0:  # end a line a crash may have cut short
            self._metrics_file.seek(self._metrics_file.tell() - 1)
            if self._metrics_file.read(1) != "\n":
                self._metrics_file.write("\n")

    def _save_status(self, status: str, **fields: Any) -> None:
        """Record how the run stands in ``run.json`` (read by ``ddptrain runs`` and ``show``):
        RUNNING, RESTARTING, FINISHED, ERRORED or ABORTED (Ray Train V2's words)."""
        self._run_json.update(status=status, **fields)
        if status in ("FINISHED", "ERRORED", "ABORTED"):
            self._run_json["ended"] = time.time()
        storage.write_json_atomic(self.layout.run_json, self._run_json, private=True)
        if self.remote is not None:
            self.mirror.push_file(self.layout.RUN_JSON)

    def prepare_restart(self) -> None:
        """On a failure: if a restart will follow, start its agents now, during the teardown."""
        allowed = self._max_failures
        if self._spare is None and (allowed == -1 or self._failures_seen < allowed):
            try:
                self._spare = self.plan.new_launcher()
            except LaunchError as exc:  # the restart will try again, and report it then
                _logger.warning("ddptrain: could not start the next attempt's agents early: %s", exc)

    def fit(self) -> Result:
        """Run attempts until one succeeds or the failure budget is spent.

        A full disk where the driver writes (logs, metrics, checkpoints, the index) raises
        ``ControllerError`` caused by a ``DiskFullError`` naming the file; like a worker's full
        disk, it is never retried.
        """
        self.plan.check_gpus()
        try:
            with RunLock(self.run_dir, self.name):
                return self._fit_locked()
        except OSError as exc:
            full = disk_full_error(exc, exc.filename or self.run_dir)
            if full is None:
                raise
            raise ControllerError(f"Training stopped: {full}") from full

    def _fit_locked(self) -> Result:
        self._load_previous()
        # A warm group from an earlier fit(), or new agents importing torch while we set up.
        group: WorkerGroup | None = take_warm(self.plan) or WorkerGroup(self.plan, self.plan.new_launcher())
        kept = False
        root_causes: list[WorkerFailure] = []
        try:
            self._prepare_dir()
            _logger.info(
                "ddptrain: run %r in %s with %d workers", self.name, self.location, self.scaling_config.num_workers
            )
            index = self.first_attempt()
            hosts = len(self.plan.placement.hosts) if self.plan.placement is not None else 1
            latest = self.latest_checkpoint.path if self.latest_checkpoint else None
            self.progress.started(
                workers=self.scaling_config.num_workers, hosts=hosts, attempt=index, resume_from=latest
            )
            while True:
                assert group is not None
                attempt = Attempt(self, index, group, keep=keeps_warm(self.plan))
                self._save_status("RUNNING", attempt=index)
                try:
                    return_values = attempt.run_group()
                    break
                except GroupFailed as failed:
                    group.shutdown(0)
                    group = WorkerGroup(self.plan, self._spare) if self._spare is not None else None
                    self._spare = None
                    self._clean_after_failure()
                    failures = sorted(failed.failures, key=lambda f: (f.timestamp, f.rank))
                    root_causes.append(failures[0])
                    self._failures_seen = len(root_causes)
                    errors = self._run_json.setdefault("attempt_errors", [])
                    errors.append({"attempt": index, "error": failures[0].headline(), "log": failures[0].log_path})
                    self._after_exception(failures)
                    if group is None or any(is_disk_full(f.exception) for f in failures):
                        self.progress.finished(False, self._best(), error=failures[0].headline())
                        self._save_status("ERRORED", error=failures[0].headline())
                        raise self._final_error(failures, root_causes, index) from failures[0].exception
                    _logger.warning(
                        "ddptrain: attempt %d failed (%s); restarting from %s (failure %d of %s allowed)",
                        index,
                        failures[0].headline(),
                        self.latest_checkpoint.path if self.latest_checkpoint else "scratch",
                        len(root_causes),
                        "unlimited" if self._max_failures == -1 else self._max_failures,
                    )
                    index += 1
                    latest = self.latest_checkpoint.path if self.latest_checkpoint else None
                    self.progress.restarting(index, failures[0].headline(), latest)
                    self._save_status("RESTARTING", attempt=index)
            self.progress.finished(True, self._best())
            self._save_status("FINISHED")
            if attempt.keep and group.alive:
                kept = put_warm(group)
        except BaseException as exc:
            if self._run_json.get("status") in ("RUNNING", "RESTARTING"):  # stopped by the driver's side
                try:
                    self._save_status("ABORTED", error=f"{type(exc).__name__}: {exc}")
                except OSError:
                    pass  # a full disk: the error that got us here says so
            raise
        finally:
            if group is not None and not kept:
                group.shutdown()
            if self._spare is not None:
                self._spare.shutdown(_env.shutdown_grace_s())
            self._spare = None
            if self.datasets is not None:
                self.datasets.release()
            if self._metrics_file is not None:
                try:
                    self._metrics_file.close()
                except OSError:  # a full disk: the error that got us here says so
                    pass
            if self.remote is not None:
                self.mirror.push_final()
        return self._result(return_values)

    def _result(self, return_values: list[Any]) -> Result:
        return Result(
            metrics=self.metrics_history[-1] if self.metrics_history else None,
            checkpoint=self.latest_checkpoint,
            path=self.location,
            metrics_history=list(self.metrics_history),
            best_checkpoints=self.checkpoints.best_checkpoints(),
            return_value=return_values[0] if return_values else None,
            return_values=return_values,
            _storage_filesystem=self.remote.fs if self.remote else None,
        )

    def _clean_after_failure(self) -> None:
        """Remove what the failed attempt left half-done, upload its logs. On remote storage a
        failure here is logged: the store may be what failed, and the next attempt (or the
        next resume) cleans up again."""
        if self.remote is None:
            self.checkpoints.clean_leftovers()
            return
        try:
            self.checkpoints.clean_leftovers()
            self.mirror.push_logs()
        except Exception as exc:  # each fsspec backend raises its own errors
            _logger.warning(
                "ddptrain: could not clean up after the failed attempt in %s: %s: %s",
                self.location,
                type(exc).__name__,
                exc,
            )

    def _best(self) -> tuple[str, dict[str, Any]] | None:
        """The best checkpoint by the configured score (the latest without one), for the summary."""
        ranked = self.checkpoints.best_checkpoints()
        return (ranked[-1][0].path, ranked[-1][1]) if ranked else None

    def _final_error(
        self, failures: list[WorkerFailure], root_causes: list[WorkerFailure], index: int
    ) -> WorkerGroupError:
        error = WorkerGroupError.from_failures(failures, str(self.log_dir(index)))
        if len(root_causes) > 1:
            first = index - len(root_causes) + 1
            lines = [f"  attempt {first + i}: {f.headline()} (log: {f.log_path})" for i, f in enumerate(root_causes)]
            error.args = (f"{error.args[0]}\nRoot cause of every attempt ({len(root_causes)}):\n" + "\n".join(lines),)
        if any(is_disk_full(f.exception) for f in failures):
            error.args = (
                f"{error.args[0]}\nA file system is full: the group was not restarted (FailureConfig does not "
                "apply, every attempt would fail the same way until space is freed).",
            )
        return error

    def _after_exception(self, failures: list[WorkerFailure]) -> None:
        exceptions = {f.rank: f.exception for f in failures}
        for callback in self.run_config.callbacks or []:
            try:
                callback.after_exception(self.context, exceptions)  # type: ignore[arg-type]
            except Exception as exc:
                _logger.warning("ddptrain: callback %r failed in after_exception: %r", callback, exc)
