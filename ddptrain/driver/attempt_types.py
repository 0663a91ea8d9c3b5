"""What an attempt is given and what it gives back.

:class:`~ddptrain.driver.attempt.Attempt` sees its run through two narrow views, an
:class:`AttemptContext` (what starting and steering the group needs) and a :class:`ReportSink`
(where the reports go, which ``Run`` implements), and ends with an :data:`Outcome` that the
controller acts on. Kept apart from the attempt's logic so that the controller and the run read
these terms without the attempt's machinery.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ddptrain.checkpoint import Checkpoint
from ddptrain.driver import preemption
from ddptrain.errors import WorkerFailure, is_disk_full
from ddptrain.storage.base import RunStorage
from ddptrain.wire import protocol

if TYPE_CHECKING:
    from ddptrain.driver.run_validations import RunValidations

__all__ = [
    "AttemptContext",
    "Failed",
    "Outcome",
    "Preempted",
    "ReportSink",
    "Resized",
    "Succeeded",
]


@dataclass(frozen=True)
class Succeeded:
    """Every rank returned: their return values by rank, and whether the workers stay warm."""

    return_values: list[Any]
    keep_warm: bool


@dataclass(frozen=True)
class Failed:
    """The attempt failed. ``failures``: root cause first. ``retryable``: a later attempt may
    succeed (not after every rank returned, not on a full disk); the controller decides whether
    one follows. The group is dead but not shut down: the controller may start the next
    attempt's agents first."""

    failures: tuple[WorkerFailure, ...]
    retryable: bool

    @property
    def disk_full(self) -> bool:
        return any(is_disk_full(f.exception) for f in self.failures)


@dataclass(frozen=True)
class Preempted:
    """A preemption notice stopped the attempt: ``checkpoint`` is the one committed after the
    notice (``None``: the deadline came first). The group is alive: the controller stops it."""

    notice: preemption.Notice
    checkpoint: Checkpoint | None


@dataclass(frozen=True)
class Resized:
    """Hosts an elastic run had left out answer again (``hosts``): the attempt stopped at the
    checkpoint committed since (``checkpoint``), for a larger group. Not a failure. The group
    is alive: the controller stops it."""

    hosts: tuple[str, ...]
    checkpoint: Checkpoint


Outcome = Succeeded | Failed | Preempted | Resized


@dataclass(frozen=True)
class AttemptContext:
    """What one attempt needs to start and steer its group (made by ``Run.attempt_context``).

    Attributes:
        index: Attempt number, 0 for the first start.
        run_info: What the workers learn of the run.
        payload: The pickled training function.
        datasets: Each rank's dataset shard specs for this start.
        log_dir: Where each rank's output goes.
        run_dir: The run directory on this machine (``ddptrain stack`` requests, fetched files).
        storage: The run's storage (it collects the staged checkpoint files it commits).
        backend_config: Its backend sets up and tears down the workers' framework.
        progress: The console (worker lines, the live status line).
    """

    index: int
    run_info: protocol.RunInfo
    payload: bytes | None
    datasets: dict[int, Any] | None
    log_dir: Path
    run_dir: str
    storage: RunStorage
    backend_config: Any
    progress: Any


class ReportSink(Protocol):
    """Where an attempt's reports go (``Run`` is one)."""

    def record_metrics(self, metrics: dict[str, Any], attempt: int) -> None: ...

    def flush_metrics(self) -> None: ...

    def name_problem(self, name: str, staged: Sequence[str] = ()) -> str | None: ...

    def commit_checkpoint(
        self, staged: list[str], name: str, metrics: dict[str, Any], index: int, validation: bytes | None = None
    ) -> Checkpoint: ...

    def after_report(self, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None: ...

    def reported_checkpoints(self) -> list[tuple[str, dict[str, Any], str]]: ...

    @property
    def validations(self) -> RunValidations: ...
