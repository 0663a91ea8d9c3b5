"""Every message between the driver, its agents and its workers, as small frozen dataclasses.

Two transports carry them:

- **The agent's pipe** (its stdin and stdout: a local pipe or an SSH channel). Frames of
  ``FRAME`` (kind byte, rank, length) then the payload, written by :func:`encode_frame` and
  read by :func:`read_frame`. Driver to agent: one :class:`Bootstrap` (kind
  ``Kind.BOOTSTRAP``), then one-byte requests (:class:`Request`). Agent to driver: worker output
  (``Kind.STDOUT``/``Kind.STDERR``, raw bytes), ``Kind.ALIVE`` (empty: an agent on an SSH host
  is still there), and the events of ``ddptrain.wire.agent_events``.
- **The driver's store**, once a worker has joined it. Messages are pickled, sealed with a key
  derived from the run's secret (AES-GCM) and numbered per sender (``ddptrain.channel``);
  nothing is unpickled before its tag checks out. Workers send with plain ``pickle`` (data only),
  through logs of their own that the driver reads in batches; the driver's commands
  may carry functions (``Execute``) and go with cloudpickle. Worker to driver: :class:`Hello`,
  :class:`CallResult`, :class:`Report`, :class:`Collective`, :class:`CheckpointsQuery`,
  :class:`Done`, :class:`Beat` (heartbeat connection). Driver to worker: :class:`Execute`,
  :class:`BeginRun`, :class:`Train`, :class:`Exit`, :class:`Ack`, :class:`CollectiveResult`,
  :class:`CheckpointsReply`, and :class:`Preempt` (on a queue of its own, read by the worker's
  heartbeat thread while the training function runs).

``VERSION`` changes whenever a message changes shape; an agent refuses a driver of another
version (``ddptrain.wire.boot.versions``) before it unpickles anything but the version table. Only
the standard library is imported here: the agent reads this module before it forks.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = [
    "AGENT_RANK",
    "ALIVE_S",
    "FRAME",
    "Ack",
    "Bootstrap",
    "Kind",
    "Request",
    "RunInfo",
    "StorageSpec",
    "StoreAddress",
    "WorkerSpec",
    "decode_bootstrap",
    "encode_bootstrap",
    "encode_frame",
    "read_frame",
    "Beat",
    "BeginRun",
    "CallResult",
    "CheckpointsQuery",
    "CheckpointsReply",
    "Collective",
    "CollectiveResult",
    "Done",
    "Execute",
    "Exit",
    "FailureRecord",
    "Hello",
    "Preempt",
    "Report",
    "Uploaded",
    "Train",
    "STACK_SIGNAL",
    "VERSION",
]

VERSION = 11  # 6: BeginRun; 7: RunInfo.storage, a StorageSpec; 8: Preempt; 9: Report.pending, Uploaded;
# 10: Request.RESET, Kind.IDLE (agents kept for the next attempt); 11: AgentPreempted.signal, STACK_SIGNAL

# The signal on which a worker prints every thread's stack (faulthandler), sent by its agent when
# the driver asks (``ddptrain stack``, stall warnings). A real-time signal, which nothing sends by
# accident: SIGUSR1, which SLURM's `--signal` sends to every process of a job's steps, is a
# preemption notice to an agent and ignored by the workers.
STACK_SIGNAL = signal.SIGRTMIN + 5


# ----------------------------------------------------------------- worker -> driver
@dataclass(frozen=True)
class FailureRecord:
    """An exception raised in a worker, as the driver needs it to explain it. Travels in a
    :class:`CallResult`, or through the worker's status pipe in :class:`WorkerExited`."""

    # When it was raised: a peer failing a moment later because of it must not be named the
    # root cause just because its report reached the driver first.
    time: float
    type: str  # "module.QualifiedName"
    message: str
    traceback: str  # without ddptrain's own frames at the top
    exception: bytes | None  # the exception itself, pickled, when it can be


@dataclass(frozen=True)
class Hello:
    """A worker joined the store and is ready for commands."""

    rank: int
    pid: int
    host: str


@dataclass(frozen=True)
class CallResult:
    """The outcome of one :class:`Execute`: the cloudpickled return value, or why it failed."""

    rank: int
    call_id: int
    ok: bool
    value: bytes | FailureRecord


@dataclass(frozen=True)
class Report:
    """One ``ddptrain.report()`` call of one rank (the ``index``-th of the run)."""

    rank: int
    index: int
    metrics: dict[str, Any]
    staged: str | None  # the folder the rank's checkpoint files were staged in
    dir_name: str | None  # ``checkpoint_dir_name``
    pending: bool = False  # its checkpoint files are being uploaded: an ``Uploaded`` follows
    validation: bytes | None = (
        None  # validate the checkpoint: cloudpickled (fn, args, fn_kwargs), for the driver to pass on
    )


@dataclass(frozen=True)
class Uploaded:
    """The background upload of a rank's checkpoint of report ``index`` (``Report.pending``)
    ended: its files are in ``staged``, or it failed (``error``: the pickled exception, if it
    pickles; ``text``: its message and traceback)."""

    rank: int
    index: int
    staged: str | None
    error: bytes | None = None
    text: str = ""


@dataclass(frozen=True)
class Collective:
    """One rank arrived at collective call ``index`` (rank 0 brings the pickled data)."""

    rank: int
    index: int
    data: bytes | None


@dataclass(frozen=True)
class CheckpointsQuery:
    """``get_all_reported_checkpoints()``: answer once reports up to ``index`` are in (and,
    ``validated``, once no validation is queued or running)."""

    rank: int
    index: int
    timeout_s: float | None
    validated: bool = False


@dataclass(frozen=True)
class Done:
    """The rank's training function returned (``returned``: its cloudpickled value)."""

    rank: int
    returned: bytes | None
    note: str | None  # why the value is missing (it could not be pickled)


@dataclass(frozen=True)
class Beat:
    """Heartbeat: how many messages the rank has pushed to the driver so far."""

    rank: int
    pushed: int


# ----------------------------------------------------------------- driver -> worker
@dataclass(frozen=True)
class Execute:
    """Run ``fn(*args, **kwargs)`` and answer with a :class:`CallResult`."""

    call_id: int
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BeginRun:
    """Switch a warm worker to a new run: its :class:`RunInfo`, the training function's
    payload, its dataset shards and the new process group's port; answered with a
    :class:`CallResult` (the worker's ``begin_run`` does it)."""

    call_id: int
    run: RunInfo
    payload: bytes | None
    datasets: dict[int, Any] | None
    master_port: int


@dataclass(frozen=True)
class Train:
    """Run the current run's training function, then answer with :class:`Done`."""


@dataclass(frozen=True)
class Exit:
    """Leave the command loop and exit with code 0."""


@dataclass(frozen=True)
class Ack:
    """The checkpoint of report ``index`` was committed at ``path`` (or refused: ``problem``)."""

    index: int
    path: str | None
    problem: str | None


@dataclass(frozen=True)
class CollectiveResult:
    """Every rank reached collective call ``index``: rank 0's data."""

    index: int
    data: bytes | None


@dataclass(frozen=True)
class Preempt:
    """A preemption notice: the run stops at ``deadline_ms`` (UNIX time in milliseconds) at the
    latest; ``node_to_ranks``: the hosts going away and their ranks. Sent to a rank's notice
    queue (``Keys.notices``), which its heartbeat thread reads while the function runs."""

    deadline_ms: int | None
    node_to_ranks: dict[str, list[int]]
    reason: str


@dataclass(frozen=True)
class CheckpointsReply:
    """The run's reported checkpoints: ``(path, metrics, status)``, worst first."""

    reported: list[tuple[str, dict[str, Any], str]]


# ================================================================= the agent's pipe
# kind (1 byte), rank, payload length
FRAME = struct.Struct(">cII")
AGENT_RANK = 0xFFFFFFFF  # the rank of frames about the agent itself, not one of its workers


class Kind:
    """The kind byte of a frame."""

    BOOTSTRAP = b"B"  # driver -> agent, once: a :class:`Bootstrap`
    STDOUT = b"O"  # a worker's output, raw bytes
    STDERR = b"E"
    STARTED = b"S"  # :class:`WorkerStarted`
    EXITED = b"X"  # :class:`WorkerExited`
    STATES = b"P"  # :class:`WorkerStates`
    FAILED = b"F"  # :class:`AgentFailed`, as UTF-8 text
    PREEMPTED = b"R"  # :class:`AgentPreempted`: the agent got SIGTERM or SIGUSR1 (its host is going away)
    ALIVE = b"A"  # no payload: the agent is still there (SSH hosts, at least every `ALIVE_S`)
    IDLE = b"C"  # :class:`AgentIdle`: after ``Request.RESET``, every worker is gone


# How often the driver and an agent on an SSH host tell each other they are alive.
ALIVE_S = 0.5


class Request:
    """One-byte requests the driver writes to an agent's stdin after the bootstrap."""

    KILL = b"K"  # stop every worker and exit
    STATES = b"Q"  # answer with :class:`WorkerStates`
    STACKS = b"T"  # the same, and make every worker print its Python stacks
    HEARTBEAT = b"H"  # the driver is alive (agents on SSH hosts stop without it)
    RESET = b"C"  # stop every worker, answer :class:`AgentIdle`, and wait for the next bootstrap


def encode_frame(kind: bytes, rank: int, payload: bytes) -> bytes:
    return FRAME.pack(kind, rank, len(payload)) + payload


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    chunks, missing = [], size
    while missing:
        chunk = stream.read(missing)
        if not chunk:
            break
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def read_frame(stream: IO[bytes]) -> tuple[bytes, int, bytes] | None:
    """Read one frame ``(kind, rank, payload)``, or ``None`` at end of stream (short reads on
    pipes are retried)."""
    header = _read_exactly(stream, FRAME.size)
    if len(header) < FRAME.size:
        return None
    kind, rank, length = FRAME.unpack(header)
    payload = _read_exactly(stream, length)
    if len(payload) < length:
        return None
    return kind, rank, payload


# ----------------------------------------------------------------- driver -> agent
@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: its place in the group, its devices and its environment."""

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    devices: tuple[int, ...]  # indices among the GPUs its host lets it see; empty on CPU
    env: dict[str, str]  # torchrun's variables (RANK, MASTER_ADDR, ...)
    datasets: dict[str, Any] = field(default_factory=dict)  # its dataset shard specs


@dataclass(frozen=True)
class StorageSpec:
    """Where a run's files go, as a worker needs it to build its side of the run's storage
    (``ddptrain.storage.open.worker_storage``): the driver's ``RunStorage.spec`` makes it.

    Attributes:
        kind: ``"local"`` (the run directory, seen by every worker), ``"copyback"`` (the run
            directory on the driver; hosts that cannot see it stage checkpoints in
            ``local_cache`` and the driver copies them back) or ``"fsspec"`` (remote storage;
            workers upload their checkpoint files themselves).
        storage_path: The storage root, as users see it.
        run_dir: The run directory (on remote storage: the driver's local working copy).
        run_path: The run's folder on the remote file system (``"fsspec"`` only).
        filesystem: The cloudpickled ``RemoteRoot`` of remote storage (``"fsspec"`` only).
            Unpickling a file system may start an I/O thread, which the agent must not have
            when it forks, so only workers unpickle it (this and the next).
        checkpoint: The checkpoint to resume from.
        checkpoint_filesystem: The cloudpickled file system ``checkpoint`` is on (``None``:
            this machine's), such as ``resume_from_checkpoint``'s.
        probe: A file of the run that only a host seeing ``run_dir`` can read (``run.json``,
            which holds the run's id): how the driver tells whether a host sees it.
        local_cache: Where a host that cannot see ``run_dir`` keeps its checkpoint files until
            the driver copies them back (``None``: the host sees it).
    """

    kind: str = "local"
    storage_path: str = ""
    run_dir: str | None = None
    run_path: str | None = None
    filesystem: bytes | None = None
    checkpoint: str | None = None
    checkpoint_filesystem: bytes | None = None
    probe: str | None = None
    local_cache: str | None = None

    def on_unshared_host(self, cache: str, attempt: int) -> tuple[StorageSpec, str | None]:
        """This spec for a host that cannot see ``run_dir`` and keeps its files in ``cache``:
        with the folder there that the checkpoint to resume from must be copied to first
        (``None``: no checkpoint)."""
        checkpoint = f"{cache}/resume/a{attempt}/{os.path.basename(self.checkpoint)}" if self.checkpoint else None
        return dataclasses.replace(self, local_cache=cache, checkpoint=checkpoint), checkpoint


@dataclass(frozen=True)
class RunInfo:
    """What a worker needs to know of the training run it takes part in (empty for a group
    that only runs functions). Travels in the :class:`Bootstrap`, or to warm workers in a
    :class:`BeginRun`."""

    run_id: str = ""
    attempt: int = 0
    name: str = ""
    storage: StorageSpec = field(default_factory=StorageSpec)
    report_index: int = 0  # the number of the run's next report
    argv: tuple[str, ...] = ()
    log_level: str = "INFO"
    validates: bool = False  # the trainer has a ``ValidationConfig`` (``report(validation=True)`` works)


@dataclass(frozen=True)
class StoreAddress:
    """Where workers find the driver's store, as seen from their host, and the run's secret."""

    host: str
    port: int
    secret: bytes
    connect_timeout_s: float


@dataclass(frozen=True)
class Bootstrap:
    """Everything an agent needs to start its host's workers."""

    payload: bytes | None  # the pickled training function and config (``None``: none yet)
    sys_path: tuple[str, ...]  # the driver's; '' stands for the working directory, ``cwd``
    cwd: str | None
    start: str  # "shared" or "clean" (see ``ddptrain.agent.main``)
    grace_s: float  # SIGTERM to SIGKILL
    workers: tuple[WorkerSpec, ...]
    run: RunInfo
    store: StoreAddress
    heartbeat_s: float | None = None  # stop when the driver is silent this long (SSH hosts)
    ray_compat: bool = False  # under `ddptrain run`: `import ray...` resolves to ddptrain (``ray_compat``)


def encode_bootstrap(bootstrap: Bootstrap, versions: dict[str, str]) -> bytes:
    """A bootstrap frame: the version table as a plain dict first, so that an agent of another
    version can refuse it before unpickling any class of this module."""
    return encode_frame(Kind.BOOTSTRAP, AGENT_RANK, pickle.dumps((versions, pickle.dumps(bootstrap))))


def decode_bootstrap(payload: bytes, check_versions: Callable[[dict[str, str]], None]) -> Bootstrap:
    versions, inner = pickle.loads(payload)
    check_versions(versions)
    bootstrap = pickle.loads(inner)
    if not isinstance(bootstrap, Bootstrap):
        raise TypeError(f"expected a Bootstrap, got {type(bootstrap).__name__}")
    return bootstrap
