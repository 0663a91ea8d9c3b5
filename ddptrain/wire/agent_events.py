"""What an agent tells the driver about its workers, and what the driver adds about the agent.

An agent writes :class:`WorkerStarted`, :class:`WorkerExited` and :class:`WorkerStates` as
pickled frames on its stdout, and :class:`AgentFailed` as plain text (so that even an agent of
another version can say why it stopped); :func:`decode_agent_event` turns a frame back into an
event (frames and kinds: ``ddptrain.wire.protocol``). The driver adds :class:`AgentLost` when an SSH
host stops answering, and :class:`AgentGone` when the pipe ends. Only the standard library and
``ddptrain.wire.protocol`` are imported here: the agent reads this module before it forks.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from ddptrain.wire.protocol import Kind, encode_frame

__all__ = [
    "AgentEvent",
    "AgentFailed",
    "AgentIdle",
    "AgentGone",
    "AgentLost",
    "AgentPreempted",
    "WorkerExited",
    "WorkerStarted",
    "WorkerStates",
    "decode_agent_event",
    "encode_event",
]


@dataclass(frozen=True)
class WorkerStarted:
    rank: int
    pid: int
    host: str


@dataclass(frozen=True)
class WorkerExited:
    """A worker's exit: its code, and the ``FailureRecord`` it wrote, pickled (empty if none)."""

    rank: int
    exitcode: int
    status: bytes
    memory: dict[str, Any] | None = None  # its host's memory evidence, for a worker killed by SIGKILL


@dataclass(frozen=True)
class WorkerStates:
    """The kernel's view of each live worker (``{rank: {"pid", "state", "wchan"}}``)."""

    rank: int  # the agent's (see :class:`AgentFailed`)
    states: dict[int, dict[str, Any]]


@dataclass(frozen=True)
class AgentFailed:
    """The agent could not start or run its workers (``text``: a traceback or a reason).

    ``rank`` names the agent: ``AGENT_RANK`` as sent, its first worker's rank once a driver
    of several agents has tagged it."""

    rank: int
    text: str


@dataclass(frozen=True)
class AgentPreempted:
    """The agent got a SIGTERM (its host is being preempted, or shut down) or a SIGUSR1 (SLURM's
    warning before a job's time limit, sent to every process of its steps); its workers keep
    running until the driver stops them or a SIGTERM after the notice ends the agent."""

    rank: int  # the agent's (see :class:`AgentFailed`)
    signal: str = "SIGTERM"  # the signal's name


@dataclass(frozen=True)
class AgentIdle:
    """After ``Request.RESET``: every worker of the agent (and whatever they started) is gone,
    and the agent waits for the next attempt's bootstrap."""

    rank: int  # the agent's (see :class:`AgentFailed`)


@dataclass(frozen=True)
class AgentGone:
    """The agent's pipe ended (added by the driver): ``exitcode`` ``None`` if unknown;
    ``last_words``: the agent's last line on its stderr when it said why it stopped
    (``"ddptrain agent: no heartbeat from the driver for 5 s; stopping"``), else empty."""

    rank: int
    exitcode: int | None
    last_words: str = ""


@dataclass(frozen=True)
class AgentLost:
    """Nothing came from an agent on an SSH host for ``silent_s`` seconds, more than the
    ``timeout_s`` it was allowed (added by the driver): its host or network went away, or
    (``stopped_pid``: its pid there) the agent process is stopped by a signal."""

    rank: int
    silent_s: float
    timeout_s: float
    stopped_pid: int | None = None


AgentEvent = (
    WorkerStarted | WorkerExited | WorkerStates | AgentFailed | AgentPreempted | AgentIdle | AgentLost | AgentGone
)
_EVENT_KINDS: dict[type, bytes] = {
    WorkerStarted: Kind.STARTED,
    WorkerExited: Kind.EXITED,
    WorkerStates: Kind.STATES,
    AgentPreempted: Kind.PREEMPTED,
    AgentIdle: Kind.IDLE,
}


def encode_event(
    event: WorkerStarted | WorkerExited | WorkerStates | AgentFailed | AgentPreempted | AgentIdle,
) -> bytes:
    """The frame an agent writes for ``event``."""
    if isinstance(event, AgentFailed):
        return encode_frame(Kind.FAILED, event.rank, event.text.encode("utf-8", errors="replace"))
    return encode_frame(_EVENT_KINDS[type(event)], event.rank, pickle.dumps(event))


def decode_agent_event(kind: bytes, rank: int, payload: bytes) -> AgentEvent:
    """The event of a frame that is not worker output."""
    if kind == Kind.FAILED:
        return AgentFailed(rank, payload.decode("utf-8", errors="replace"))
    if kind not in _EVENT_KINDS.values():
        raise ValueError(f"unknown frame kind {kind!r} from the agent")
    event: AgentEvent = pickle.loads(payload)
    return event
