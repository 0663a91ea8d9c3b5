"""Every message between the driver and its workers, as small frozen dataclasses.

Messages travel through the driver's store, pickled, signed with the run's secret and
numbered per sender (``ddptrain.channel``); nothing is unpickled before its signature checks
out. Workers send with plain ``pickle`` (data only); the driver's commands to workers may
carry functions (``Execute``) and go with cloudpickle. ``VERSION`` changes whenever a
message changes shape; the agent refuses a driver of another version (``_agent.versions``).

Worker to driver: :class:`Hello`, :class:`CallResult`, :class:`Report`, :class:`Collective`,
:class:`CheckpointsQuery`, :class:`Done`, :class:`Beat` (heartbeat connection).
Driver to worker: :class:`Execute`, :class:`Train`, :class:`Exit`, :class:`Ack`,
:class:`CollectiveResult`, :class:`CheckpointsReply`.
Inside the driver: :class:`Lost` (a message someone removed from the store).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Ack",
    "Beat",
    "CallResult",
    "CheckpointsQuery",
    "CheckpointsReply",
    "Collective",
    "CollectiveResult",
    "Done",
    "Execute",
    "Exit",
    "Hello",
    "Lost",
    "Report",
    "Train",
    "VERSION",
]

VERSION = 2


# ----------------------------------------------------------------- worker -> driver
@dataclass(frozen=True)
class Hello:
    """A worker joined the store and is ready for commands."""

    rank: int
    pid: int
    host: str


@dataclass(frozen=True)
class CallResult:
    """The outcome of one :class:`Execute`: the cloudpickled return value, or a failure record."""

    rank: int
    call_id: int
    ok: bool
    value: Any  # bytes when ok, else the worker's failure record (dict)


@dataclass(frozen=True)
class Report:
    """One ``ddptrain.report()`` call of one rank (the ``index``-th of the run)."""

    rank: int
    index: int
    metrics: dict[str, Any]
    staged: str | None  # the folder the rank's checkpoint files were staged in
    dir_name: str | None  # ``checkpoint_dir_name``


@dataclass(frozen=True)
class Collective:
    """One rank arrived at collective call ``index`` (rank 0 brings the pickled data)."""

    rank: int
    index: int
    data: bytes | None


@dataclass(frozen=True)
class CheckpointsQuery:
    """``get_all_reported_checkpoints()``: answer once reports up to ``index`` are in."""

    rank: int
    index: int
    timeout_s: float | None


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
class CheckpointsReply:
    """The run's reported checkpoints: ``(path, metrics)`` pairs, oldest first."""

    reported: list[tuple[str, dict[str, Any]]]


# ----------------------------------------------------------------- inside the driver
@dataclass(frozen=True)
class Lost:
    """Messages from ``error.rank`` were removed from the store (``channel.LostMessageError``)."""

    error: Any

    @property
    def rank(self) -> int:
        return 0 if self.error.rank is None else int(self.error.rank)
