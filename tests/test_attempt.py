"""The attempt's state machine, without processes: a fake worker group replays scripted poll
results into an :class:`~ddptrain.driver.attempt.Attempt` and records what the driver sends back."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from fake_group import FakeGroup

import ddptrain as train
from ddptrain.backend import BackendConfig
from ddptrain.driver.attempt import Attempt, Failed, Succeeded
from ddptrain.driver.group_events import FailureSeen
from ddptrain.driver.run import Run
from ddptrain.driver.worker_group import GroupFailed
from ddptrain.errors import WorkerFailure
from ddptrain.result import read_metric_lines
from ddptrain.storage import layout as storage
from ddptrain.wire import protocol


def run_attempt(run: Run, group: FakeGroup, keep: bool = False, clock: Callable[[], float] = time.monotonic) -> Any:
    """Attempt 0 of ``run`` on ``group``: its return values, or GroupFailed raised for a Failed."""
    outcome = Attempt(run.attempt_context(0), run, group, keep=keep, clock=clock).run()  # type: ignore[arg-type]
    if isinstance(outcome, Failed):
        raise GroupFailed(list(outcome.failures))
    assert isinstance(outcome, Succeeded) and outcome.keep_warm == keep
    return outcome.return_values


@pytest.fixture
def run(tmp_path: Path) -> Run:
    run = Run(
        payload=b"",
        train_loop_config=None,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=str(tmp_path), name="fake"),
        backend_config=BackendConfig(),
        dataset_config=train.DataConfig(),
    )
    Path(run.run_dir).mkdir(parents=True)
    run._prepare_dir()
    return run


def done(rank: int, value: Any = None) -> protocol.Done:
    return protocol.Done(rank, cloudpickle.dumps(value), None)


def staged(run: Run, tmp_path: Path, index: int, rank: int) -> str:
    source = tmp_path / f"ckpt_{index}_{rank}"
    source.mkdir()
    (source / f"rank{rank}.txt").write_text(f"report {index} of rank {rank}")
    return storage.stage_files(run.run_dir, str(source), 0, index, rank)


def test_a_report_round_commits_one_checkpoint_and_acks_the_ranks_that_sent_files(run: Run, tmp_path: Path) -> None:
    group = FakeGroup(
        2,
        [
            protocol.Report(0, 1, {"loss": 0.5}, staged(run, tmp_path, 1, 0), None),
            protocol.Report(1, 1, {"loss": 0.7}, staged(run, tmp_path, 1, 1), None),
            done(0, "a"),
            done(1, "b"),
        ],
    )
    values = run_attempt(run, group)
    assert values == ["a", "b"]
    acks = group.sent_of(protocol.Ack)
    path = str(Path(run.run_dir, "checkpoint_000001"))
    assert acks == [(0, protocol.Ack(1, path, None)), (1, protocol.Ack(1, path, None))]
    assert sorted(p.name for p in Path(path).iterdir()) == ["rank0.txt", "rank1.txt"]
    # Rank 0's metrics are persisted as they arrive, before the round is complete.
    assert [line["metrics"] for line in read_metric_lines(run.run_dir)] == [{"loss": 0.5}]
    assert group.sent_of(protocol.Train) == [(0, protocol.Train()), (1, protocol.Train())]
    assert group.stopped  # not kept: the workers were told to exit


def test_metrics_only_reports_get_no_ack(run: Run) -> None:
    group = FakeGroup(2, [protocol.Report(0, 1, {"x": 1}, None, None), protocol.Report(1, 1, {"x": 2}, None, None)])
    group.script += [done(0), done(1)]
    run_attempt(run, group)
    assert group.sent_of(protocol.Ack) == []
    assert run.metrics_history == [{"x": 1}]


def test_a_checkpoint_name_that_escapes_the_run_directory_is_refused_in_the_ack(run: Run, tmp_path: Path) -> None:
    group = FakeGroup(
        2,
        [
            protocol.Report(0, 1, {}, staged(run, tmp_path, 1, 0), "..escape"),
            protocol.Report(1, 1, {}, None, "..escape"),
            done(0),
            done(1),
        ],
    )
    run_attempt(run, group)
    [(rank, ack)] = group.sent_of(protocol.Ack)
    assert rank == 0 and ack.path is None and "plain folder name" in ack.problem
    assert run.checkpoints.latest is None


def test_a_collective_round_sends_rank_zeros_data_to_every_rank(run: Run) -> None:
    group = FakeGroup(2, [protocol.Collective(1, 1, None), protocol.Collective(0, 1, b"data"), done(0), done(1)])
    run_attempt(run, group)
    assert group.sent_of(protocol.CollectiveResult) == [
        (0, protocol.CollectiveResult(1, b"data")),
        (1, protocol.CollectiveResult(1, b"data")),
    ]


def test_a_rank_that_returns_while_another_waits_in_a_collective_fails_the_attempt(run: Run) -> None:
    group = FakeGroup(2, [protocol.Collective(0, 1, b"x"), done(1)])
    with pytest.raises(GroupFailed, match=r"rank\(s\) \[1\] returned from the training function while rank\(s\) \[0\]"):
        run_attempt(run, group)
    # Dead, and left to the controller to shut down (after it started the next attempt's agents).
    assert not group.alive and not group.closed


def test_get_all_reported_checkpoints_waits_for_the_callers_report_round(run: Run, tmp_path: Path) -> None:
    def no_reply_yet() -> None:
        assert group.sent_of(protocol.CheckpointsReply) == []

    group = FakeGroup(
        2,
        [
            protocol.Report(0, 1, {"step": 1}, staged(run, tmp_path, 1, 0), None),
            protocol.CheckpointsQuery(0, 1, None),
            no_reply_yet,
            protocol.Report(1, 1, {"step": 1}, None, None),
            done(0),
            done(1),
        ],
    )
    run_attempt(run, group)
    [(rank, reply)] = group.sent_of(protocol.CheckpointsReply)
    assert rank == 0
    assert reply.reported == [(str(Path(run.run_dir, "checkpoint_000001")), {"step": 1}, "COMMITTED")]
    # The reply came after the round's acks.
    kinds = [type(m) for _, m in group.sent]
    assert kinds.index(protocol.CheckpointsReply) > kinds.index(protocol.Ack)


def test_a_report_round_left_unfinished_is_named_when_training_ends(run: Run, caplog) -> None:
    group = FakeGroup(2, [protocol.Report(0, 1, {"x": 1}, None, None), done(0), done(1)])
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        run_attempt(run, group)
    assert any("never by rank(s) [1]" in r.getMessage() for r in caplog.records)


def test_a_kept_attempt_leaves_its_workers_running(run: Run) -> None:
    group = FakeGroup(2, [done(0), done(1)])
    run_attempt(run, group, keep=True)
    assert not group.stopped and not group.closed


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_a_checkpoint_query_is_answered_when_its_timeout_is_over_on_the_attempts_clock(run: Run) -> None:
    clock = FakeClock()
    group = FakeGroup(
        2,
        [
            protocol.Report(0, 1, {"step": 1}, None, None),
            protocol.CheckpointsQuery(0, 1, 5.0),  # waits for rank 1's report #1, at most 5 s
            lambda: clock.advance(4.0),
            lambda: assert_no_reply(group),
            lambda: clock.advance(2.0),  # the next tick finds the timeout over
            lambda: assert_reply(group),
            protocol.Report(1, 1, {"step": 1}, None, None),
            done(0),
            done(1),
        ],
    )
    run_attempt(run, group, clock=clock)
    assert group.sent_of(protocol.CheckpointsReply) == [(0, protocol.CheckpointsReply([]))]


def assert_no_reply(group: FakeGroup) -> None:
    assert group.sent_of(protocol.CheckpointsReply) == []


def assert_reply(group: FakeGroup) -> None:
    assert len(group.sent_of(protocol.CheckpointsReply)) == 1


def test_a_rank_late_to_a_report_is_named_after_the_warn_interval_on_the_attempts_clock(run: Run, caplog) -> None:
    clock = FakeClock()
    script = [protocol.Report(0, 1, {"x": 1}, None, None), lambda: clock.advance(4.0)]
    script += [lambda: clock.advance(2.0), protocol.Report(1, 1, {"x": 1}, None, None), done(0), done(1)]
    group = FakeGroup(2, script)
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        run_attempt(run, group, clock=clock)  # the interval: DDPTRAIN_REPORT_WARN_INTERVAL_S, 5 s
    late = [r.getMessage() for r in caplog.records if "have not reached report() call #1" in r.getMessage()]
    assert len(late) == 1 and "rank(s) [1]" in late[0] and "6.0 s ago" in late[0]


def test_a_failure_seen_ends_the_attempt_with_failed_and_the_reports_before_it_kept(run: Run) -> None:
    failure = WorkerFailure(rank=1, host="fake", pid=7, exitcode=-9, exception=RuntimeError("boom"))
    group = FakeGroup(2, [protocol.Report(0, 1, {"x": 1}, None, None), FailureSeen((failure,))])
    outcome = Attempt(run.attempt_context(0), run, group).run()  # type: ignore[arg-type]
    assert outcome == Failed((failure,), retryable=True)
    assert [line["metrics"] for line in read_metric_lines(run.run_dir)] == [{"x": 1}]


def test_a_failure_after_every_rank_returned_or_of_a_full_disk_is_not_retryable(run: Run) -> None:
    full = WorkerFailure(rank=0, host="fake", pid=7, exitcode=1, exception=OSError(errno.ENOSPC, "No space left"))
    outcome = Attempt(run.attempt_context(0), run, FakeGroup(2, [FailureSeen((full,))])).run()  # type: ignore[arg-type]
    assert isinstance(outcome, Failed) and outcome.disk_full and not outcome.retryable

    late = WorkerFailure(rank=0, host="fake", pid=7, exitcode=1, exception=RuntimeError("late"))
    group = FakeGroup(2, [])
    group.script = [lambda: setattr(group, "finishing", True), FailureSeen((late,))]
    outcome = Attempt(run.attempt_context(0), run, group).run()  # type: ignore[arg-type]
    assert outcome == Failed((late,), retryable=False)
