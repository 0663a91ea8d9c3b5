"""The library's exceptions, and how worker failures are recorded and explained (driver side)."""

from __future__ import annotations

import pickle
import signal
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DdpTrainError",
    "ConfigError",
    "LaunchError",
    "TrainingFailedError",
    "ControllerError",
    "WorkerGroupError",
    "WorkerError",
    "WorkerDiedError",
    "WorkerFailure",
]


class DdpTrainError(Exception):
    """Base class of every error raised by ddptrain."""


class ConfigError(DdpTrainError, ValueError):
    """Bad user input: a config, a function or an argument that cannot work."""


class LaunchError(DdpTrainError, RuntimeError):
    """The worker processes could not be started."""


class TrainingFailedError(DdpTrainError, RuntimeError):
    """Raised by ``fit()`` when training failed (Ray Train's name)."""


class ControllerError(TrainingFailedError):
    """Training failed because of the driver itself (Ray Train's name), not a worker."""


class WorkerError(DdpTrainError, RuntimeError):
    """Stands in for a worker's exception that could not be sent back to the driver.

    Attributes:
        type_name: The qualified name of the original exception type.
        traceback_str: The worker's formatted traceback.
    """

    def __init__(self, type_name: str, message: str, traceback_str: str = "") -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.traceback_str = traceback_str

    def __reduce__(self) -> tuple[Any, ...]:
        text = str(self)
        message = text.split(": ", 1)[1] if ": " in text else text
        return (WorkerError, (self.type_name, message, self.traceback_str))


class WorkerDiedError(DdpTrainError, RuntimeError):
    """A worker process exited without finishing, or was killed by a signal."""

    def __init__(self, rank: int, exitcode: int) -> None:
        super().__init__(f"Worker rank {rank} died: {describe_exitcode(exitcode)}.")
        self.rank = rank
        self.exitcode = exitcode

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerDiedError, (self.rank, self.exitcode))


def describe_exitcode(exitcode: int) -> str:
    """``'exit code 3'`` or ``'killed by signal SIGKILL (9)'`` from a Popen-style return code."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {name} ({-exitcode})"
    return f"exit code {exitcode}"


@dataclass
class WorkerFailure:
    """What went wrong on one rank, as the driver saw it.

    Attributes:
        rank: World rank of the worker.
        host: Host name the worker ran on.
        pid: Process id of the worker, when known.
        exitcode: Exit code (negative: killed by that signal), ``None`` while it was alive.
        exception: The worker's own exception, or a stand-in when it could not be unpickled.
        traceback_str: The worker's formatted traceback, empty when it died without one.
        log_path: The file that holds this rank's output.
        timestamp: ``time.time()`` when the driver learned of the failure.
    """

    rank: int
    host: str
    pid: int | None
    exitcode: int | None
    exception: BaseException
    traceback_str: str = ""
    log_path: str | None = None
    timestamp: float = 0.0
    log_tail: list[str] = field(default_factory=list)

    def headline(self) -> str:
        where = f"rank {self.rank} (host {self.host}, pid {self.pid})"
        how = f"{type(self.exception).__name__}: {self.exception}"
        if isinstance(self.exception, WorkerDiedError):
            how = describe_exitcode(self.exception.exitcode)
        elif self.exitcode is not None:
            how += f" [{describe_exitcode(self.exitcode)}]"
        return f"{where}: {how}"


def format_failures(failures: list[WorkerFailure], log_dir: str | None) -> str:
    """The message of a :class:`WorkerGroupError`: root cause first, then the others."""
    ordered = sorted(failures, key=lambda f: (f.timestamp, f.rank))
    root = ordered[0]
    lines = ["Training failed due to worker errors:", f"Root cause (first failure): {root.headline()}"]
    if root.traceback_str:
        lines.append(root.traceback_str.rstrip())
    elif root.log_tail:
        lines.append(f"Last lines of rank {root.rank}'s output:")
        lines.extend("    " + line for line in root.log_tail)
    if root.log_path:
        lines.append(f"Log of rank {root.rank}: {root.log_path}")
    if len(ordered) > 1:
        lines.append("Other failures:")
        lines.extend(f"  {f.headline()}" for f in ordered[1:])
    if log_dir:
        lines.append(f"All logs: {log_dir}")
    return "\n".join(lines)


class WorkerGroupError(TrainingFailedError):
    """Training failed because one or more workers failed.

    Attributes:
        worker_failures: World rank to the exception that rank raised (or a
            :class:`WorkerDiedError` when it died without one).
        failures: The full :class:`WorkerFailure` records, first failure first.
    """

    def __init__(
        self,
        error_message: str,
        worker_failures: dict[int, BaseException],
        failures: list[WorkerFailure] | None = None,
    ) -> None:
        super().__init__(error_message)
        self.worker_failures = worker_failures
        self.failures = failures or []

    @classmethod
    def from_failures(cls, failures: list[WorkerFailure], log_dir: str | None) -> WorkerGroupError:
        """Build the error, with the root cause's exception as ``__cause__``."""
        ordered = sorted(failures, key=lambda f: (f.timestamp, f.rank))
        error = cls(
            format_failures(ordered, log_dir),
            {f.rank: f.exception for f in ordered},
            ordered,
        )
        error.__cause__ = ordered[0].exception
        return error

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerGroupError, (str(self), self.worker_failures, self.failures))


def exception_to_bytes(exc: BaseException) -> bytes | None:
    """Pickle an exception for the trip to the driver, or ``None`` when it cannot round-trip."""
    import cloudpickle

    try:
        data: bytes = cloudpickle.dumps(exc)
        pickle.loads(data)
    except Exception:
        return None
    return data
