"""The validations of one run, seen from the run: the checkpoints reported with
``report(..., validation=...)`` are validated one at a time beside training
(``ddptrain.driver.validation`` runs them), and each result changes the run.

:class:`RunValidations` queues them, polls them, waits for the last ones when training is done
(bounded, and cut short by a preemption notice), kills them when ``fit()`` ends another way,
and records each result: the checkpoint's metrics and status (retention may now delete
others), a line of ``metrics.jsonl`` and the report's metrics in ``Result.metrics`` (through
the run, :class:`ValidatedRun`), and a console line; a failure is said with its traceback and
recorded in ``run.json``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from ddptrain import _env
from ddptrain.driver import preemption
from ddptrain.driver.progress import Progress
from ddptrain.driver.validation import Finished, LocalHost, Task, Validations, Where
from ddptrain.driver.validation_ssh import SSHValidationHost, validation_host
from ddptrain.storage import layout as storage
from ddptrain.storage.base import RunStorage
from ddptrain.storage.checkpoint_manager import COMMITTED, VALIDATED, lookup_metric

if TYPE_CHECKING:
    from ddptrain.config import ValidationConfig
    from ddptrain.launch.hosts import HostSpec

__all__ = ["RunValidations", "ValidatedRun"]

_logger = logging.getLogger(__name__)


class ValidatedRun(Protocol):
    """What a validation's result changes in its run (``Run``)."""

    def record_validation(self, line: dict[str, Any], report_index: int, metrics: dict[str, Any]) -> None:
        """Write ``line`` to ``metrics.jsonl`` and merge ``metrics`` into report ``report_index``."""

    def record_validation_error(self, entry: dict[str, str]) -> None:
        """Record a failed validation in ``run.json``."""


class RunValidations:
    """The validations of one run's checkpoints.

    Args:
        config: The trainer's ``ValidationConfig`` (``None``: the run validates nothing).
        hosts: The run's host list (a validation host is one of them), or ``None``.
        env_vars: What the run's agents get (a validation host needs the storage's credentials).
        layout: The run's files (validation logs under its ``logs/``).
        run_id: The run's id (a validation host checks it sees the run).
        run_storage: The run's storage (checkpoints, uploads).
        progress: The console.
        run: Where results are recorded.
    """

    def __init__(
        self,
        config: ValidationConfig | None,
        hosts: list[HostSpec] | None,
        env_vars: dict[str, str],
        layout: storage.RunLayout,
        run_id: str,
        run_storage: RunStorage,
        progress: Progress,
        run: ValidatedRun,
    ) -> None:
        self.config = config
        self._storage, self._progress, self._run = run_storage, progress, run
        uses_gpu = config is not None and config.uses_gpu
        where: Where = LocalHost(uses_gpu)
        validator = validation_host(config.host if config is not None else None, hosts)
        if validator is not None:  # with what the run's agents get there (the storage's credentials)
            where = SSHValidationHost(validator, env_vars, uses_gpu, (str(layout.run_json), run_id))
        task_config = config.task_config if config is not None else None
        self._validations = Validations(
            config.fn if config is not None else None,
            task_config.fn_kwargs if task_config is not None else None,
            layout.logs / "validation",
            where,
        )

    def submit(self, task: Task) -> None:
        """Queue a committed checkpoint's validation; started now when none runs."""
        self._validations.submit(task)
        self.poll()

    def validating(self) -> bool:
        """Whether a validation is queued or running."""
        return bool(self._validations.pending)

    def poll(self) -> bool:
        """Take in the validations that ended and start the next one; whether one ended."""
        done = self._validations.poll()
        for finished in done:
            self._validated(finished)
        return bool(done)

    def finish(self) -> None:
        """Training is done: wait for the validations left (``DDPTRAIN_VALIDATION_WAIT_S``), or
        until the deadline of a preemption notice (at once after a second one)."""
        for finished in self._validations.finish(_env.validation_wait_s(), self._progress.say, _notice_deadline):
            self._validated(finished)

    def stop(self) -> None:
        """``fit()`` ends another way (a failure, Ctrl-C, a preemption): kill the running
        validation, drop the queued ones; their checkpoints stay ``COMMITTED``."""
        try:
            for finished in self._validations.close("the run stopped before it ended"):
                self._validated(finished)
        except Exception as exc:  # the error that stopped the run is the one to raise
            _logger.warning("ddptrain: recording the validations the run stopped failed: %r", exc)

    def check_scored(self, name: str, metrics: dict[str, Any]) -> None:
        """Say (once) that checkpoint ``name`` lacks the ``checkpoint_score_attribute``."""
        attribute = self._storage.checkpoints.config.checkpoint_score_attribute
        if attribute is None:
            return
        try:
            lookup_metric(metrics, attribute)  # a nested metric is named 'outer/inner', as in Ray
        except KeyError:
            self._progress.unscored(name, attribute, metrics)

    def _validated(self, finished: Finished) -> None:
        """Record one validation's result (see the module's docstring)."""
        task = finished.task
        status = VALIDATED if finished.ran else COMMITTED
        merged = self._storage.checkpoints.validated(task.name, finished.metrics or {}, status)
        if merged is not None and finished.error is None:
            self.check_scored(task.name, merged)
        self._run.record_validation(_line(finished), task.index, finished.metrics or {})
        if finished.error is None:
            self._progress.validated(task.name, finished.metrics or {}, finished.seconds)
        else:
            kept = merged is not None and finished.ran
            self._progress.validation_failed(task.name, finished.error, finished.log, kept)
            last = finished.error.strip().splitlines()[-1]
            self._run.record_validation_error({"checkpoint": task.name, "error": last, "log": finished.log})
        self._storage.reported(None)


def _line(finished: Finished) -> dict[str, Any]:
    """The ``metrics.jsonl`` line of a validation's result."""
    task = finished.task
    return {
        "time": time.time(),
        "attempt": task.attempt,
        "validation": {
            "checkpoint": task.name,
            "report": task.index,
            "metrics": storage.to_jsonable(finished.metrics or {}),
            "error": finished.error,
            "seconds": round(finished.seconds, 3),
            "started": finished.started,
        },
    }


def _notice_deadline() -> tuple[float, str] | None:
    """The pending preemption notice's deadline (``time.monotonic``) and reason, if any."""
    notice = preemption.pending()
    return None if notice is None else (notice.deadline, notice.reason)
