"""The library's exceptions, and how worker failures are recorded and explained (driver side)."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import signal
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "StorageError",
    "DdpTrainError",
    "ConfigError",
    "ConfigTypeError",
    "LaunchError",
    "HostLostError",
    "AgentGoneError",
    "TrainingFailedError",
    "RunPreemptedError",
    "ControllerError",
    "ChannelError",
    "DiskFullError",
    "WorkerGroupError",
    "WorkerError",
    "WorkerDiedError",
    "WorkerFailure",
]


class DdpTrainError(Exception):
    """Base class of every error raised by ddptrain."""


class ConfigError(DdpTrainError, ValueError):
    """Bad user input: a config, a function or an argument that cannot work."""


class ConfigTypeError(ConfigError, TypeError):
    """Bad user input of the wrong type, where Ray raises ``TypeError``."""


class LaunchError(DdpTrainError, RuntimeError):
    """The worker processes could not be started.

    Attributes:
        hosts: The names of the hosts that could not be reached or started (empty when it
            was not about particular hosts).
    """

    def __init__(self, *args: object, hosts: list[str] | None = None) -> None:
        super().__init__(*args)
        self.hosts = list(hosts or [])

    def __reduce__(self) -> tuple[Any, ...]:
        return (_launch_error, (self.args, self.hosts))


def _launch_error(args: tuple[object, ...], hosts: list[str]) -> LaunchError:
    return LaunchError(*args, hosts=hosts)


class HostLostError(LaunchError):
    """An SSH host stopped answering, mid-run or while its workers started: nothing came from it
    (not even its agent's heartbeat, or its SSH server's answer before the agent ran) for longer
    than ``DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S``. Its network or the machine went away; its agent
    stops its workers once it misses the driver's heartbeat in turn. Or, when the host said so
    (``stopped_pid``), its agent process is stopped by a signal (SIGSTOP, Ctrl-Z, a debugger).

    Attributes:
        host: The host's name in the host list.
        silent_s: Seconds nothing came from it when it was declared lost.
        timeout_s: The heartbeat timeout it was allowed.
        stopped_pid: The pid of its agent on the host, stopped by a signal; ``None`` if not known
            to be stopped.
    """

    def __init__(
        self,
        host: str,
        silent_s: float,
        timeout_s: float,
        ranks: list[int] | None = None,
        stopped_pid: int | None = None,
    ) -> None:
        on_it = f"; rank(s) {ranks} ran there" if ranks else ""
        waited = f"for {silent_s:.1f} s (DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S={timeout_s:g})"
        if stopped_pid is None:
            text = f"host {host!r} stopped answering: nothing came from it {waited}{on_it}. "
            text += "Its network or the machine went away."
        else:
            text = (
                f"the ddptrain agent (pid {stopped_pid}) on host {host!r} is stopped by a signal (process state T: "
                f"SIGSTOP, Ctrl-Z or a debugger): nothing came from it {waited}, though the host answers{on_it}. "
                f"`kill -CONT {stopped_pid}` on host {host!r} resumes it, and it then stops its workers (the "
                "driver dropped its connection)."
            )
        super().__init__(text, hosts=[host])
        self.host = host
        self.silent_s = silent_s
        self.timeout_s = timeout_s
        self.ranks = list(ranks or [])
        self.stopped_pid = stopped_pid

    def __reduce__(self) -> tuple[Any, ...]:
        return (HostLostError, (self.host, self.silent_s, self.timeout_s, self.ranks, self.stopped_pid))


class AgentGoneError(LaunchError):
    """A host's agent (or a helper it runs, such as the storage check) had started, but was
    killed or ended before the attempt's workers started. A failure of that attempt, which
    ``FailureConfig`` may retry with a new agent, as when an agent dies mid-run; an agent that
    never started (a wrong ``python=``, a login that refuses) stays a plain
    :class:`LaunchError`, which ends the run.

    Attributes:
        what: What was gone, and how.
        ranks: The ranks that were to run there.
    """

    def __init__(self, what: str, ranks: list[int] | None = None) -> None:
        on_it = f"; rank(s) {ranks} were to run there" if ranks else ""
        super().__init__(f"{what}{on_it}.")
        self.what = what
        self.ranks = list(ranks or [])

    def __reduce__(self) -> tuple[Any, ...]:
        return (AgentGoneError, (self.what, self.ranks))


class TrainingFailedError(DdpTrainError, RuntimeError):
    """Raised by ``fit()`` when training failed (Ray Train's name)."""


class RunPreemptedError(TrainingFailedError):
    """Raised by ``fit()`` when the run was stopped by a preemption notice (a SIGTERM to the
    driver or to a host's agent, or ``request_preemption``): ``run.json`` says PREEMPTED, and
    running the same script again with the same ``RunConfig(name=...)`` resumes the run from
    :attr:`checkpoint`. A subclass of ``TrainingFailedError``: code after ``fit()`` does not
    run as if training had finished.

    Attributes:
        checkpoint: The run's latest committed checkpoint (``None``: none was reported).
        reason: What the notice was.
    """

    def __init__(self, message: str, checkpoint: Any = None, reason: str = "") -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (RunPreemptedError, (self.args[0] if self.args else "", self.checkpoint, self.reason))


class ControllerError(TrainingFailedError):
    """Training failed because of the driver itself (Ray Train's name), not a worker."""


class ChannelError(ControllerError):
    """The driver stopped reading its workers' messages: its store was tampered with, it holds
    more unread messages than ``DDPTRAIN_CHANNEL_MAX_UNREAD_MB`` allows, or its channel thread
    failed. The message says which; the run is not restarted."""


class StorageError(DdpTrainError, OSError):
    """Remote storage failed (unreachable, refused, not answering, or out of space); the message
    names the store and the underlying error.

    Attributes:
        timed_out: The store did not answer in time (``DDPTRAIN_STORAGE_TIMEOUT_S``).
    """

    def __init__(self, *args: object, timed_out: bool = False) -> None:
        super().__init__(*args)
        self.timed_out = timed_out

    def __reduce__(self) -> tuple[Any, ...]:
        return (_storage_error, (self.args, self.timed_out))


def _storage_error(args: tuple[object, ...], timed_out: bool) -> StorageError:
    return StorageError(*args, timed_out=timed_out)


class DiskFullError(DdpTrainError, OSError):
    """A file of the run could not be written because its file system is full (or over quota).

    An ``OSError`` with ``errno.ENOSPC``; it names the file and the space left where it failed.
    ``fit()`` raises it as the ``__cause__`` of its ``TrainingFailedError`` and does not restart
    the group: free some space and run the same named run again to resume.

    Attributes:
        path: The file or folder being written.
        free_bytes: Free bytes on its file system when the write failed (``None``: unknown).
        total_bytes: Size of that file system (``None``: unknown).
    """

    def __init__(self, path: str, free_bytes: int | None, total_bytes: int | None = None, reason: str = "") -> None:
        self.path = str(path)
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes
        self.reason = reason or os.strerror(errno.ENOSPC)
        space = "free space unknown"
        if free_bytes is not None:
            space = f"{_size(free_bytes)} free" + (f" of {_size(total_bytes)}" if total_bytes else "")
        self.message = (
            f"{self.reason}: could not write {self.path} ({space} on its file system). Free some space, "
            "then run fit() again with the same RunConfig(name=...) to resume from the last committed checkpoint."
        )
        super().__init__(errno.ENOSPC, self.message)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (DiskFullError, (self.path, self.free_bytes, self.total_bytes, self.reason))


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says a file system is full or over quota (``shutil.copytree``'s error too)."""
    if isinstance(exc, DiskFullError):
        return True
    if not isinstance(exc, OSError):
        return False
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # shutil.Error carries the failed copies' messages, not an errno.
    return isinstance(exc, shutil.Error) and f"[Errno {errno.ENOSPC}]" in str(exc)


def disk_full_error(exc: BaseException, path: str | os.PathLike[str]) -> DiskFullError | None:
    """The :class:`DiskFullError` for a failed write of ``path``, or ``None`` when ``exc`` is
    another error. Measures the free space of the nearest existing folder of ``path``."""
    if isinstance(exc, DiskFullError):
        return exc
    if not is_disk_full(exc):
        return None
    free = total = None
    folder = os.path.abspath(path)
    while True:
        try:
            usage = shutil.disk_usage(folder)
            free, total = usage.free, usage.total
            break
        except OSError:
            parent = os.path.dirname(folder)
            if parent == folder:
                break
            folder = parent
    quota = isinstance(exc, OSError) and exc.errno == errno.EDQUOT
    error = DiskFullError(str(path), free, total, os.strerror(errno.EDQUOT) if quota else "")
    error.__cause__ = exc
    return error


def _size(n: int) -> str:
    """``'512 B'``, ``'1.5 KiB'``, ``'2.0 MiB'``, ..."""
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


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
    """A worker process exited without finishing, or was killed by a signal.

    Attributes:
        memory: For a worker killed by SIGKILL, what its host knew about its memory (see
            :func:`describe_memory`), else ``None``.
    """

    def __init__(self, rank: int, exitcode: int, memory: dict[str, Any] | None = None) -> None:
        super().__init__(f"Worker rank {rank} died: {describe_death(exitcode, memory)}.")
        self.rank = rank
        self.exitcode = exitcode
        self.memory = memory

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerDiedError, (self.rank, self.exitcode, self.memory))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def describe_memory(memory: dict[str, Any]) -> str:
    """Why a worker got SIGKILL, from its host's evidence: ``oom_killed`` (the memory cgroup's
    OOM-kill counter grew while it ran), ``cgroup``, ``limit``, ``peak`` (bytes) and ``maxrss``
    (the worker's peak RSS in bytes); any of them may be missing."""
    cgroup = ""
    if memory.get("cgroup"):
        labels = (("limit", "memory limit"), ("peak", "peak use"))
        figures = [f"{label} {_mib(memory[key])}" for key, label in labels if memory.get(key)]
        cgroup = f"cgroup {memory['cgroup']}" + (f" ({', '.join(figures)})" if figures else "")
    if memory.get("oom_killed"):
        cause = "probably out of memory: the kernel's OOM killer acted" + (f" in {cgroup}" if cgroup else "")
    elif memory.get("oom_killed") is False:
        cause = f"no out-of-memory kill was recorded in its {cgroup}"
    else:
        cause = "SIGKILL often comes from the kernel's out-of-memory killer (see `dmesg`)"
    if memory.get("maxrss"):
        cause += f"; the worker's peak RSS was {_mib(memory['maxrss'])}"
    return cause


def describe_death(exitcode: int, memory: dict[str, Any] | None = None) -> str:
    """How a worker ended without a word: :func:`describe_exitcode`, followed by
    :func:`describe_memory` when there is evidence. An exit code (not a signal) means that the
    process ended itself before its function returned or raised (a ``SystemExit`` is reported
    as the function's error): ``os._exit()``, or a library's C ``exit()``."""
    text = describe_exitcode(exitcode)
    if exitcode >= 0:
        text += (
            " before its training function returned or raised: something it ran ended the process "
            "(os._exit(), or a library calling C's exit())"
        )
    return f"{text}, {describe_memory(memory)}" if memory else text


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
        timestamp: ``time.time()`` when the worker raised (as it reported), else when the driver
            learned of the failure.
        note: What else the driver knew when it happened (e.g. ranks that had returned).
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
    note: str = ""

    def headline(self) -> str:
        where = f"rank {self.rank} (host {self.host}, pid {self.pid})"
        how = f"{type(self.exception).__name__}: {self.exception}"
        if isinstance(self.exception, WorkerDiedError):
            how = describe_death(self.exception.exitcode, self.exception.memory)
        elif self.exitcode is not None:
            how += f" [{describe_exitcode(self.exitcode)}]"
        return f"{where}: {how}" + (f" ({self.note})" if self.note else "")


# What gloo (under torch.distributed and JAX) says in a rank whose peer left a collective.
_PEER_GONE = ("closed by peer", "reset by peer")


def peer_gone(failure: WorkerFailure) -> bool:
    """Whether ``failure`` is a collective that failed because a peer went away."""
    return any(text in str(failure.exception) for text in _PEER_GONE)


def root_cause_order(failure: WorkerFailure) -> tuple[bool, float, int]:
    """Sort key of failures, root cause first: the earliest, except that a rank whose
    collective failed only because a peer went away comes after the others. A killed peer is
    known only when its agent reaps it, often after the survivors raised."""
    return (peer_gone(failure), failure.timestamp, failure.rank)


def root_cause_first(failures: list[WorkerFailure]) -> list[WorkerFailure]:
    """``failures``, the root cause first (the one sort of failures: by :func:`root_cause_order`)."""
    return sorted(failures, key=root_cause_order)


def format_failures(failures: list[WorkerFailure], log_dir: str | None) -> str:
    """The message of a :class:`WorkerGroupError`: root cause first, then the others."""
    ordered = root_cause_first(failures)
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
        ordered = root_cause_first(failures)
        error = cls(format_failures(ordered, log_dir), {f.rank: f.exception for f in ordered}, ordered)
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
