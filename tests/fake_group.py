"""A worker group without processes for the driver's unit tests (``test_attempt``,
``test_controller``): its ``poll()`` replays a script."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ddptrain.driver.group_events import FailureSeen, GroupEvent, MessagesHandled, StatesReported, TickDue
from ddptrain.driver.worker_group import GroupFailed
from ddptrain.errors import WorkerFailure
from ddptrain.wire import protocol


class FakeGroup:
    """A started worker group whose workers' messages come from ``script``, one per poll().

    A script item is a protocol message from a worker, a group event (``FailureSeen``...) or
    a callable run at that point (to look at what the driver has sent so far). Each poll is
    followed by a due tick. Polling more than the script holds fails the test: a real group
    would hang there.
    """

    def __init__(self, world_size: int, script: list[Any], started: bool = True, log: list[str] | None = None) -> None:
        self.world_size = world_size
        self.script = list(script)
        self.log = log if log is not None else []  # what happened, in order (shared with a test's other fakes)
        self.sent: list[tuple[int, Any]] = []
        self.done: dict[int, tuple[bytes | None, str | None]] = {}
        self.started = started
        self.alive = True
        self.finishing = False
        self.launcher = None
        self.stopped = self.closed = False

    # what Attempt uses of a group
    @contextlib.contextmanager
    def observed(self, observer: Callable[[GroupEvent], None]) -> Iterator[None]:
        yield  # the fake's own calls do not wait

    def start(self, **kwargs: Any) -> None:
        self.started = True

    def ask(self, command: bytes) -> None:
        pass

    def stopped_agents(self) -> list[tuple[str, int]]:
        return []

    def where(self, rank: int) -> str:
        return f"rank {rank}"

    def next_run(self, log_dir: Path | None, console: Any = None) -> int:
        return 0

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return [None] * self.world_size  # the backend's hooks

    def begin_run(self, run: Any, payload: Any, datasets: Any, port: int) -> None:
        pass

    def send(self, rank: int, message: Any) -> None:
        self.sent.append((rank, message))

    def notify(self, rank: int, message: Any) -> None:
        self.sent.append((rank, message))

    def host_of(self, rank: int) -> str:
        return "localhost"

    def poll(self, timeout_s: float = 0.5) -> list[GroupEvent]:
        if not self.script:
            raise AssertionError("the attempt waits for more than the script holds")
        item = self.script.pop(0)
        events: list[GroupEvent] = []
        if callable(item):
            item()
        elif isinstance(item, FailureSeen):
            self.alive = False
            return [item]
        elif isinstance(item, (MessagesHandled, StatesReported, TickDue)):
            events.append(item)
        elif isinstance(item, protocol.Done):
            self.done[item.rank] = (item.returned, item.note)
            events.append(MessagesHandled())
        else:
            events.append(MessagesHandled((item,)))
        return [*events, TickDue(0.0)]

    def fail(self, failures: list[WorkerFailure]) -> GroupFailed:
        self.alive = False
        return GroupFailed(failures)

    def failure(self, rank: int, exitcode: int | None, exc: BaseException, traceback_str: str = "") -> WorkerFailure:
        return WorkerFailure(rank=rank, host="fake", pid=None, exitcode=exitcode, exception=exc)

    def stop_workers(self) -> None:
        self.stopped = True

    def shutdown(self, grace_s: float | None = None) -> None:
        if not self.closed:
            self.log.append("group shut down")
        self.closed = True

    def sent_of(self, kind: type) -> list[tuple[int, Any]]:
        return [(rank, m) for rank, m in self.sent if isinstance(m, kind)]
