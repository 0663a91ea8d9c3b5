"""The agent's wire protocol, without processes: frames are encoded and decoded by
``ddptrain.wire.protocol``, and a fake connection replays an agent's frames through the real
``AgentSession`` into a real worker group's event pump, which must turn them into the
failures a user reads."""

from __future__ import annotations

import io
import pickle
import threading
from pathlib import Path

import cloudpickle
import pytest

from ddptrain.config import ScalingConfig
from ddptrain.driver.group_events import FailureSeen, GroupEvents, GroupFailed, StatesReported, TickDue
from ddptrain.driver.logs import LogSink
from ddptrain.driver.plan import Plan
from ddptrain.errors import LaunchError
from ddptrain.launch.agent_session import AgentSession
from ddptrain.wire import agent_events, protocol
from ddptrain.wire.boot import versions
from ddptrain.worker.main import failure_record


def _bootstrap(workers: int = 2) -> protocol.Bootstrap:
    plan = Plan(ScalingConfig(num_workers=workers))
    store = protocol.StoreAddress("127.0.0.1", 29500, b"s" * 32, 30.0)
    return plan.bootstrap(b"payload", protocol.RunInfo(run_id="r1", name="run"), store, None)


def test_bootstrap_round_trip_keeps_every_field() -> None:
    bootstrap = _bootstrap()
    frame = io.BytesIO(protocol.encode_bootstrap(bootstrap, versions()))
    kind, rank, payload = protocol.read_frame(frame)  # type: ignore[misc]
    assert (kind, rank) == (protocol.Kind.BOOTSTRAP, protocol.AGENT_RANK)
    seen: list[dict[str, str]] = []
    decoded = protocol.decode_bootstrap(payload, seen.append)
    assert decoded == bootstrap
    assert seen == [versions()]
    assert [spec.rank for spec in decoded.workers] == [0, 1]
    assert decoded.workers[1].env["RANK"] == "1" and decoded.workers[1].env["MASTER_PORT"] == "29500"


def test_a_version_mismatch_is_refused_before_the_bootstrap_is_unpickled() -> None:
    """An agent of another version may not have the classes the bootstrap pickles: it must say
    "version mismatch" instead of failing to unpickle."""
    payload = pickle.dumps(({"ddptrain": "9.9"}, b"not a pickle of anything"))

    def check(expected: dict[str, str]) -> None:
        raise RuntimeError(f"version mismatch: {expected}")

    with pytest.raises(RuntimeError, match="version mismatch"):
        protocol.decode_bootstrap(payload, check)


@pytest.mark.parametrize(
    "event",
    [
        agent_events.WorkerStarted(3, 1234, "box"),
        agent_events.WorkerExited(1, -9, b"", {"maxrss": 1024}),
        agent_events.WorkerStates(protocol.AGENT_RANK, {0: {"pid": 5, "state": "S", "wchan": "futex"}}),
        agent_events.AgentFailed(protocol.AGENT_RANK, "Traceback: boom \N{SNOWMAN}"),
    ],
)
def test_agent_events_round_trip(event: agent_events.AgentEvent) -> None:
    frame = protocol.read_frame(io.BytesIO(agent_events.encode_event(event)))  # type: ignore[arg-type]
    assert frame is not None
    assert agent_events.decode_agent_event(*frame) == event


def test_a_truncated_stream_reads_as_its_end() -> None:
    data = agent_events.encode_event(agent_events.WorkerStarted(0, 1, "h"))
    assert protocol.read_frame(io.BytesIO(data[:-1])) is None
    assert protocol.read_frame(io.BytesIO(data[:3])) is None
    with pytest.raises(ValueError, match="unknown frame kind"):
        agent_events.decode_agent_event(b"Z", 0, b"")


class ReplayConnection:
    """A ``HostConnection`` whose agent "wrote" ``frames``; what the driver writes is kept."""

    where = "on the replay host"
    stray_output = ""
    agent_pid = None

    def __init__(self, frames: bytes, exit_code: int | None) -> None:
        self.stdout = io.BytesIO(frames)
        self.stderr = io.BytesIO(b"")
        self.written: list[bytes] = []
        self._exit_code = exit_code

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def wait_ready(self) -> None:
        pass

    def exit_code(self) -> int | None:
        return self._exit_code

    def close(self, grace_s: float) -> None:
        pass

    def abort(self) -> None:
        pass


def _replay(frames: bytes, exit_code: int | None, tmp_path: Path) -> tuple[GroupEvents, ReplayConnection]:
    """Feed ``frames`` through a real AgentSession into a real event pump of a 2-rank group."""
    group = GroupEvents(Plan(ScalingConfig(num_workers=2)))
    group.sink = LogSink(tmp_path, {0: "rank0", 1: "rank1"}, echo_ranks=set())
    connection = ReplayConnection(frames, exit_code)
    session = AgentSession(connection, heartbeat_s=None, label="replay")
    gone = threading.Event()

    def on_event(event: agent_events.AgentEvent) -> None:
        group.events.put(("agent", event))
        if isinstance(event, agent_events.AgentGone):
            gone.set()

    session.start(_bootstrap(), group.sink, on_event)
    assert gone.wait(5.0), "the session never said the agent is gone"
    return group, connection


def test_a_worker_failure_record_becomes_the_users_exception(tmp_path: Path) -> None:
    record = failure_record(ValueError("bad batch"))
    frames = b"".join(
        [
            agent_events.encode_event(agent_events.WorkerStarted(0, 100, "replayhost")),
            agent_events.encode_event(agent_events.WorkerStarted(1, 101, "replayhost")),
            protocol.encode_frame(protocol.Kind.STDOUT, 1, b"epoch 0\n"),
            agent_events.encode_event(agent_events.WorkerExited(1, 1, cloudpickle.dumps(record))),
        ]
    )
    group, connection = _replay(frames, exit_code=None, tmp_path=tmp_path)
    with pytest.raises(GroupFailed) as caught:
        group.pump_until(lambda: False, timeout_s=5.0, waiting_for="the replay")
    failure = caught.value.failures[0]
    assert failure.rank == 1 and failure.pid == 101
    assert isinstance(failure.exception, ValueError) and str(failure.exception) == "bad batch"
    assert (tmp_path / "rank_1.log").read_text() == "epoch 0\n"
    # The driver wrote exactly one bootstrap frame, which an agent decodes to the same bootstrap.
    frame = protocol.read_frame(io.BytesIO(b"".join(connection.written)))
    assert frame is not None and frame[0] == protocol.Kind.BOOTSTRAP
    assert protocol.decode_bootstrap(frame[2], lambda v: None) == _bootstrap()


def test_an_agent_that_vanishes_names_its_ranks_and_the_lost_connection(tmp_path: Path) -> None:
    frames = agent_events.encode_event(agent_events.WorkerStarted(0, 100, "replayhost"))
    group, _ = _replay(frames, exit_code=None, tmp_path=tmp_path)
    with pytest.raises(GroupFailed, match=r"rank\(s\) \[0, 1\].*connection lost") as caught:
        group.pump_until(lambda: False, timeout_s=5.0)
    assert caught.value.lost_ranks == [0]


def test_an_unreadable_frame_fails_the_group_instead_of_hanging(tmp_path: Path) -> None:
    frames = protocol.encode_frame(protocol.Kind.EXITED, 0, b"not a pickle")
    group, _ = _replay(frames, exit_code=1, tmp_path=tmp_path)
    with pytest.raises(GroupFailed, match="unreadable frame") as caught:
        group.pump_until(lambda: False, timeout_s=5.0)
    assert isinstance(caught.value.failures[0].exception, LaunchError)


def test_an_agent_that_never_ran_says_so_with_its_exit_status(tmp_path: Path) -> None:
    group, _ = _replay(b"", exit_code=127, tmp_path=tmp_path)
    with pytest.raises(GroupFailed, match=r"on the replay host the agent did not start \(exit status 127"):
        group.pump_until(lambda: False, timeout_s=5.0)


def test_poll_returns_states_and_ticks_and_the_failure_last_and_blocking_waits_show_them_to_an_observer(
    tmp_path: Path,
) -> None:
    states = {0: {"pid": 100, "state": "S", "wchan": "futex_wait_queue"}}
    frames = b"".join(
        [
            agent_events.encode_event(agent_events.WorkerStarted(0, 100, "replayhost")),
            agent_events.encode_event(agent_events.WorkerStates(protocol.AGENT_RANK, states)),
            agent_events.encode_event(
                agent_events.WorkerExited(0, 1, cloudpickle.dumps(failure_record(KeyError("k"))))
            ),
        ]
    )
    group, _ = _replay(frames, exit_code=None, tmp_path=tmp_path)
    seen: list[object] = []
    with group.observed(seen.append), pytest.raises(GroupFailed, match="KeyError"):
        group.pump_until(lambda: False, timeout_s=5.0)
    assert StatesReported(states) in seen and any(isinstance(e, TickDue) for e in seen)
    assert not any(isinstance(e, FailureSeen) for e in seen)  # raised, not observed

    group, _ = _replay(frames, exit_code=None, tmp_path=tmp_path / "again")
    events: list[object] = []
    while not any(isinstance(e, FailureSeen) for e in events):
        events += group.poll(1.0)
    assert StatesReported(states) in events and isinstance(events[-1], FailureSeen)
    root = events[-1].failures[0]  # root cause first (rank 1 goes with its agent)
    assert root.rank == 0 and isinstance(root.exception, KeyError)
