"""The controller's restart policy (``ddptrain.driver.controller``). With real worker processes on
this machine: every attempt gets a placement plan of its own, and a next attempt that cannot
start ends the run with an error that says so. Without processes (fake groups replaying
scripted poll results): every decision it takes on an attempt's outcome."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from fake_group import FakeGroup

import ddptrain as train
from ddptrain.backend import BackendConfig
from ddptrain.driver import preemption
from ddptrain.driver.controller import Controller
from ddptrain.driver.group_events import FailureSeen, TickDue
from ddptrain.driver.run import Run
from ddptrain.errors import HostLostError, LaunchError, RunPreemptedError, WorkerFailure, WorkerGroupError
from ddptrain.result import Result
from ddptrain.wire import protocol


def _record_and_fail_once(config: dict) -> None:
    """Every rank records what its attempt looks like; rank 0 of the first attempt rewrites the
    host file, then fails the attempt."""
    ctx = train.get_context()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    out = Path(config["out"], f"a{attempt}_r{ctx.get_world_rank()}.json")
    out.write_text(json.dumps({"local_world_size": ctx.get_local_world_size(), "node_rank": ctx.get_node_rank()}))
    if attempt == 0 and ctx.get_world_rank() == 0:
        Path(config["hostfile"]).write_text(config["next_hosts"])
        raise RuntimeError("first attempt fails on purpose")


def _trainer(tmp_path: Path, storage: str, next_hosts: str) -> train.DataParallelTrainer:
    hostfile = tmp_path / "hosts"
    # Two "hosts" that are both this machine (no SSH): one worker each.
    hostfile.write_text(f"localhost slots=1\n{socket.gethostname()} slots=1\n")
    out = tmp_path / "records"
    out.mkdir()
    return train.DataParallelTrainer(
        _record_and_fail_once,
        train_loop_config={"out": str(out), "hostfile": str(hostfile), "next_hosts": next_hosts},
        scaling_config=train.ScalingConfig(num_workers=2, hosts=str(hostfile)),
        run_config=train.RunConfig(
            name="replan", storage_path=storage, failure_config=train.FailureConfig(max_failures=1)
        ),
    )


@pytest.mark.timeout(180)
def test_each_restart_reads_the_host_file_again(tmp_path: Path, storage: str) -> None:
    result = _trainer(tmp_path, storage, next_hosts="localhost slots=2\n").fit()

    assert result.error is None
    records = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "records").iterdir()}
    # Attempt 0 ran one worker on each of two hosts; attempt 1 both on the one host the file now lists.
    assert [records[f"a0_r{r}"] for r in (0, 1)] == [{"local_world_size": 1, "node_rank": r} for r in (0, 1)]
    assert [records[f"a1_r{r}"] for r in (0, 1)] == [{"local_world_size": 2, "node_rank": 0}] * 2
    run = json.loads((Path(storage) / "replan" / "run.json").read_text())
    assert run["hosts"] == ["localhost"] and run["status"] == "FINISHED"


@pytest.mark.timeout(180)
def test_a_next_attempt_that_cannot_start_ends_the_run_saying_why(tmp_path: Path, storage: str) -> None:
    # The host file now asks for more slots than it has: the next plan is refused (twice: early,
    # during the teardown, and again once the group is down), and the run ends with that reason
    # next to the attempt's own failure.
    with pytest.raises(WorkerGroupError) as caught:
        _trainer(tmp_path, storage, next_hosts="localhost slots=1\n").fit()

    message = str(caught.value)
    assert "first attempt fails on purpose" in message
    assert "The next attempt could not start:" in message and "slot" in message
    run = json.loads((Path(storage) / "replan" / "run.json").read_text())
    assert run["status"] == "ERRORED" and [e["attempt"] for e in run["attempt_errors"]] == [0]
    assert not (tmp_path / "records" / "a1_r0.json").exists()


def test_no_host_is_reached_before_the_runs_lock_is_taken(storage: str) -> None:
    """A fit whose run another driver holds fails on the lock, before its plan probes any host
    (with use_gpu, a host list without slots is asked for its GPUs over SSH)."""
    run_dir = os.path.join(storage, "busy")
    os.makedirs(run_dir)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom ddptrain.storage.lock import RunLock\n"
            f"with RunLock({run_dir!r}, 'busy'):\n    print('held', flush=True)\n    time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(train.DdpTrainError, match=r"'busy' .* in use by a live driver") as info:
            train.DataParallelTrainer(
                lambda: None,
                scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True, hosts=["ghost.invalid"]),
                run_config=train.RunConfig(name="busy", storage_path=storage),
            ).fit()
        assert "ghost" not in str(info.value)
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()


# ----------------------------------------------------------------- the decisions, without processes
class FakeAgents:
    """The agents of one plan (what the controller does with a Launcher: shut it down)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def shutdown(self, grace_s: float) -> None:
        self.log.append("agents shut down")


class Fakes:
    """Each attempt's group replays the next script; ``log`` says what happened, in order."""

    def __init__(self, *scripts: list[Any], unreachable: list[str] | None = None) -> None:
        self.scripts = list(scripts)
        self.log: list[str] = []
        self.groups: list[FakeGroup] = []
        self.run: Run | None = None
        self.watched: list[list[str]] = []  # the hosts each attempt's watch looked at
        self.back: list[str] = []  # what the watches say answers again
        self.unreachable: list[str] = unreachable or []  # hosts whose agents cannot start

    def start_agents(self, plan: Any) -> FakeAgents:
        down = [h.name for h in plan.placement.hosts if h.name in self.unreachable] if plan.placement else []
        if down:
            raise LaunchError(f"host {down[0]!r} does not answer", hosts=down)
        self.log.append("agents started")
        return FakeAgents(self.log)

    def new_group(self, plan: Any, agents: Any) -> FakeGroup:
        group = FakeGroup(plan.world_size, self.scripts.pop(0), started=False, log=self.log)
        self.groups.append(group)
        return group

    def fit(self, storage: str, max_failures: int, scaling_config: train.ScalingConfig | None = None) -> Result:
        run = Run(
            payload=b"",
            train_loop_config=None,
            scaling_config=scaling_config or train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(
                storage_path=storage, name="fake", failure_config=train.FailureConfig(max_failures=max_failures)
            ),
            backend_config=BackendConfig(),
            dataset_config=train.DataConfig(),
        )
        self.run = run
        return Controller(
            run,
            start_agents=self.start_agents,  # type: ignore[arg-type]
            new_group=self.new_group,  # type: ignore[arg-type]
            new_watch=self.new_watch,
        ).fit()

    def new_watch(self, hosts: list[Any], interval_s: float) -> Any:
        self.watched.append([h.name for h in hosts])
        fakes = self

        class Watch:
            def start(self) -> Any:
                return self

            def back(self) -> list[str]:
                return fakes.back

            def stop(self) -> None:
                pass

        return Watch()


def _fails(message: str = "boom", exception: BaseException | None = None) -> list[Any]:
    error = exception if exception is not None else RuntimeError(message)
    return [FailureSeen((WorkerFailure(rank=1, host="fake", pid=7, exitcode=1, exception=error),))]


def _succeeds() -> list[Any]:
    return [protocol.Done(0, cloudpickle.dumps("r0"), None), protocol.Done(1, cloudpickle.dumps("r1"), None)]


def _run_json(storage: str) -> dict[str, Any]:
    return json.loads((Path(storage) / "fake" / "run.json").read_text())


def test_failed_attempts_are_restarted_within_max_failures(storage: str) -> None:
    fakes = Fakes(_fails("one"), _fails("two"), _succeeds())
    result = fakes.fit(storage, max_failures=2)
    assert result.return_values == ["r0", "r1"]
    assert len(fakes.groups) == 3 and all(g.closed for g in fakes.groups[:2])
    run = _run_json(storage)
    assert run["status"] == "FINISHED" and [e["attempt"] for e in run["attempt_errors"]] == [0, 1]


def test_the_next_attempts_agents_start_on_the_first_failure_before_the_teardown(storage: str) -> None:
    fakes = Fakes(_fails(), _succeeds())
    fakes.fit(storage, max_failures=1)
    assert fakes.log[:3] == ["agents started", "agents started", "group shut down"]


def test_the_run_gives_up_once_max_failures_is_spent_naming_every_attempts_root_cause(storage: str) -> None:
    fakes = Fakes(_fails("first"), _fails("second"))
    with pytest.raises(WorkerGroupError) as caught:
        fakes.fit(storage, max_failures=1)
    assert "Root cause of every attempt (2)" in str(caught.value) and "second" in str(caught.value)
    # No third attempt's agents: the second failure spent the budget.
    assert fakes.log == ["agents started", "agents started", "group shut down", "group shut down"]
    assert all(g.closed for g in fakes.groups) and _run_json(storage)["status"] == "ERRORED"


def test_a_full_disk_is_never_retried(storage: str) -> None:
    fakes = Fakes(_fails(exception=OSError(errno.ENOSPC, "No space left on device")), _succeeds())
    with pytest.raises(WorkerGroupError, match="A file system is full: the group was not restarted"):
        fakes.fit(storage, max_failures=5)
    assert fakes.log == ["agents started", "group shut down"]


def test_a_failure_after_every_rank_returned_is_not_retried(storage: str) -> None:
    fakes = Fakes([], _succeeds())
    fakes.scripts[0] = [lambda: setattr(fakes.groups[0], "finishing", True), *_fails("after the end")]
    with pytest.raises(WorkerGroupError, match="after the end"):
        fakes.fit(storage, max_failures=5)
    assert fakes.log == ["agents started", "group shut down"]


# ----------------------------------------------------------------- preemption notices, without processes
@pytest.fixture
def no_notice() -> Any:
    preemption.clear()
    yield
    preemption.clear()


def _notice(deadline_s: float) -> Any:
    return lambda: preemption.request_preemption("a test's notice", deadline_s=deadline_s)


def test_a_preemption_notice_reaches_every_worker_and_ends_the_run_as_preempted(storage: str, no_notice: Any) -> None:
    fakes = Fakes([_notice(0.0)], _succeeds())
    with pytest.raises(RunPreemptedError, match=r"'fake' was preempted \(a test's notice\).*from scratch") as caught:
        fakes.fit(storage, max_failures=5)
    notices = [(rank, m) for rank, m in fakes.groups[0].sent if isinstance(m, protocol.Preempt)]
    assert [rank for rank, _ in notices] == [0, 1]
    assert notices[0][1].node_to_ranks == {"localhost": [0, 1]} and notices[0][1].reason == "a test's notice"
    assert caught.value.checkpoint is None and len(fakes.groups) == 1 and fakes.groups[0].closed
    run = _run_json(storage)
    assert run["status"] == "PREEMPTED" and run["preempted"] == {"reason": "a test's notice", "checkpoint": None}
    assert preemption.pending() is None  # a later fit() starts without it


def test_a_failure_during_the_preemption_window_is_not_retried(storage: str, no_notice: Any) -> None:
    fakes = Fakes([_notice(60.0), *_fails("killed with its host")], _succeeds())
    with pytest.raises(RunPreemptedError):
        fakes.fit(storage, max_failures=5)
    assert fakes.log == ["agents started", "group shut down"] and _run_json(storage)["status"] == "PREEMPTED"


def test_a_second_notice_stops_the_run_at_once(storage: str, no_notice: Any) -> None:
    second = _notice(60.0)
    fakes = Fakes([_notice(60.0), TickDue(0.0), second])
    with pytest.raises(RunPreemptedError):
        fakes.fit(storage, max_failures=0)
    assert fakes.groups[0].script == []  # stopped on the poll after the second notice, not at the deadline


# ----------------------------------------------------------------- elastic world size, without processes
THREE_HOSTS = ["h1 slots=2", "h2 slots=2", "h3 slots=2"]


def _host_lost(host: str, rank: int) -> list[Any]:
    error = HostLostError(host, 6.0, 5.0, [rank])
    return [FailureSeen((WorkerFailure(rank=rank, host=host, pid=7, exitcode=None, exception=error),))]


def _all_done(world_size: int) -> list[Any]:
    return [protocol.Done(rank, cloudpickle.dumps(rank), None) for rank in range(world_size)]


def test_an_elastic_run_leaves_a_lost_host_out_of_the_next_attempt(storage: str) -> None:
    fakes = Fakes(_host_lost("h3", 4), _all_done(4))
    elastic = train.ScalingConfig(num_workers=(2, 6), hosts=THREE_HOSTS)
    result = fakes.fit(storage, max_failures=1, scaling_config=elastic)
    assert [g.world_size for g in fakes.groups] == [6, 4] and result.return_values == [0, 1, 2, 3]
    run = _run_json(storage)
    assert run["status"] == "FINISHED" and run["num_workers"] == 4 and run["hosts"] == ["h1", "h2"]
    [resize] = run["resizes"]
    assert (resize["from"], resize["to"], resize["attempt"]) == (6, 4, 1) and "h3" in resize["why"]
    assert [e["attempt"] for e in run["attempt_errors"]] == [0]  # the failure counted against max_failures (as Ray)


def test_an_elastic_run_below_min_workers_ends_saying_what_it_needs(
    storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDPTRAIN_ELASTIC_MIN_WORKERS_TIMEOUT_S", "0")  # no wait for the lost hosts (test_elastic waits)
    fakes = Fakes(_host_lost("h2", 2), _host_lost("h1", 0))
    elastic = train.ScalingConfig(num_workers=(4, 6), hosts=THREE_HOSTS)
    needs = r"needs at least 4 workers, but the hosts not left out \(h1, h2 stopped answering\) hold 2"
    with pytest.raises(WorkerGroupError, match=needs):
        fakes.fit(storage, max_failures=5, scaling_config=elastic)
    assert [g.world_size for g in fakes.groups] == [6, 4]


def test_a_fixed_size_run_retries_on_the_same_hosts(storage: str) -> None:
    fakes = Fakes(_host_lost("h3", 4), _all_done(6))
    fixed = train.ScalingConfig(num_workers=6, hosts=THREE_HOSTS)
    fakes.fit(storage, max_failures=1, scaling_config=fixed)
    assert [g.world_size for g in fakes.groups] == [6, 6] and "resizes" not in _run_json(storage)


def _world(config: dict) -> None:
    ctx = train.get_context()
    shard = train.get_dataset_shard("train")
    rows = sum(len(batch["id"]) for batch in shard.iter_batches(batch_size=64))
    train.report({"world": ctx.get_world_size(), "rank_rows": rows})


@pytest.mark.timeout(120)
def test_an_elastic_local_run_starts_with_as_many_workers_as_this_machine_has_cpus(storage: str) -> None:
    expected = min(3, os.cpu_count() or 1)
    result = train.DataParallelTrainer(
        _world,
        scaling_config=train.ScalingConfig(num_workers=(1, 3)),
        datasets={"train": train.data.range(60)},
        run_config=train.RunConfig(name="elastic-local", storage_path=storage),
    ).fit()
    assert result.metrics == {"world": expected, "rank_rows": 60 // expected}  # shards split by the current size
    lines = [json.loads(line) for line in (Path(storage) / "elastic-local" / "metrics.jsonl").read_text().splitlines()]
    assert [line["world_size"] for line in lines] == [expected]
    assert json.loads((Path(storage) / "elastic-local" / "run.json").read_text())["num_workers"] == expected


def test_an_elastic_run_grows_back_at_the_next_checkpoint_once_a_left_out_host_answers(
    storage: str, tmp_path: Path
) -> None:
    from test_attempt import staged

    def checkpoint_round() -> None:  # every rank of the 4-worker group reports, rank 0 with files
        assert fakes.run is not None
        fakes.back = ["h3"]
        reports = [
            protocol.Report(r, 0, {"step": 5}, staged(fakes.run, tmp_path, 0, 0) if r == 0 else None, None)
            for r in range(4)
        ]
        fakes.groups[1].script[0:0] = [TickDue(0.0), *reports]

    fakes = Fakes(_host_lost("h3", 4), [checkpoint_round], _all_done(6))
    elastic = train.ScalingConfig(num_workers=(2, 6), hosts=THREE_HOSTS, elastic_resize_monitor_interval_s=0.1)
    result = fakes.fit(storage, max_failures=1, scaling_config=elastic)
    assert [g.world_size for g in fakes.groups] == [6, 4, 6] and len(result.return_values) == 6
    assert fakes.watched == [["h3"]]  # only while a host was left out
    run = _run_json(storage)
    assert [(r["from"], r["to"], r["attempt"]) for r in run["resizes"]] == [(6, 4, 1), (4, 6, 2)]
    assert "h3 came back" in run["resizes"][1]["why"]
    assert [e["attempt"] for e in run["attempt_errors"]] == [0]  # growing is not a failure: max_failures=1 held


def test_an_elastic_run_starts_without_the_hosts_that_do_not_answer(storage: str) -> None:
    fakes = Fakes(_all_done(4))
    fakes.unreachable = ["h2"]
    elastic = train.ScalingConfig(num_workers=(2, 6), hosts=THREE_HOSTS)
    fakes.fit(storage, max_failures=0, scaling_config=elastic)
    assert [g.world_size for g in fakes.groups] == [4] and fakes.watched == [["h2"]]
    run = _run_json(storage)
    assert run["hosts"] == ["h1", "h3"] and "h2 left out (their agents could not start)" in run["resizes"][0]["why"]
    with pytest.raises(LaunchError, match="does not answer"):  # a fixed size still needs every host
        Fakes(_all_done(6), unreachable=["h2"]).fit(storage, 0, train.ScalingConfig(num_workers=6, hosts=THREE_HOSTS))
