"""Elastic runs on SSH hosts in network namespaces (``tests/sshd.py``): a host whose link goes
down mid-run is left out and the run goes on with fewer workers from the latest checkpoint;
once its link is back, the run grows again at the next checkpoint (a resize, not a failure)."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ddptrain as train
from ddptrain.torch import TorchTrainer


def _steps_until_told(config: dict) -> None:
    import torch
    import torch.distributed as dist

    ctx = train.get_context()
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with open(os.path.join(checkpoint.path, "state.json")) as f:
            start = json.load(f)["step"] + 1
    for step in range(start, 10_000):
        finish = torch.tensor([float(os.path.exists(config["finish"]))])
        dist.all_reduce(finish, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if finish.item():
            return
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "state.json").write_text(json.dumps({"step": step}))
            saved = train.Checkpoint.from_directory(folder) if ctx.get_world_rank() == 0 else None
            train.report({"step": step, "world": ctx.get_world_size()}, checkpoint=saved)
        time.sleep(0.2)


def _lines(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_lost_host_is_left_out_and_taken_back_when_it_answers_again(
    make_netns: Any, storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hosts = make_netns(count=3)
    monkeypatch.setenv("DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S", "2")
    monkeypatch.setenv("DDPTRAIN_SSH_CONNECT_TIMEOUT_S", "3")
    finish = tmp_path / "finish"
    metrics = Path(storage) / "elastic" / "metrics.jsonl"
    seen: list[str] = []

    def steer() -> None:  # cut n2 once 3 workers report; bring it back once 2 do; finish once 3 do again
        try:
            for world, then in ((3, "cut"), (2, "back"), (3, "finish")):
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    lines = _lines(metrics)
                    after = [line for line in lines if line["time"] > (float(seen[-1].split()[1]) if seen else 0)]
                    if sum(line["world_size"] == world for line in after) >= 3:
                        break
                    time.sleep(0.1)
                else:
                    return
                seen.append(f"{then} {time.time()}")
                if then == "cut":
                    hosts.set_link(2, False)
                elif then == "back":
                    hosts.set_link(2, True)
                else:
                    finish.touch()
        finally:
            finish.touch()
            hosts.set_link(2, True)

    steering = threading.Thread(target=steer, daemon=True)
    steering.start()
    result = TorchTrainer(
        _steps_until_told,
        train_loop_config={"finish": str(finish)},
        scaling_config=train.ScalingConfig(
            num_workers=(2, 3), hosts=["n0 slots=1", "n1 slots=1", "n2 slots=1"], elastic_resize_monitor_interval_s=1.0
        ),
        run_config=train.RunConfig(
            name="elastic", storage_path=storage, failure_config=train.FailureConfig(max_failures=1)
        ),
    ).fit()
    steering.join(10)
    assert [s.split()[0] for s in seen] == ["cut", "back", "finish"], seen
    lines = _lines(metrics)
    by_attempt: dict[int, list[int]] = {}
    for line in lines:
        by_attempt.setdefault(line["attempt"], []).append(line["metrics"]["step"])
    worlds = {line["attempt"]: line["world_size"] for line in lines}
    assert worlds == {0: 3, 1: 2, 2: 3}, worlds
    # No gap, and nothing repeated beyond the last checkpoint (each step reported one had):
    # a restarted attempt starts right after the previous one's last step, or repeats it (its
    # report was written, its checkpoint not committed before the group stopped).
    for attempt in (1, 2):
        last, first = by_attempt[attempt - 1][-1], by_attempt[attempt][0]
        assert first in (last, last + 1), (attempt, by_attempt)
        assert by_attempt[attempt] == list(range(first, first + len(by_attempt[attempt])))
    run = json.loads((Path(storage) / "elastic" / "run.json").read_text())
    assert [(r["from"], r["to"]) for r in run["resizes"]] == [(3, 2), (2, 3)]
    assert "n2" in run["resizes"][0]["why"] and "n2 came back" in run["resizes"][1]["why"]
    assert len(run["attempt_errors"]) == 1  # the lost host; growing back spent no failure
    assert result.metrics["world"] == 3


def _steps_until_alone(config: dict) -> None:
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        start = json.loads(Path(checkpoint.path, "state.json").read_text())["step"] + 1
    for step in range(start, 10_000):
        if world == 1 and step >= start + 3:
            return
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "state.json").write_text(json.dumps({"step": step}))
            saved = train.Checkpoint.from_directory(folder) if rank == 0 else None
            train.report({"step": step}, checkpoint=saved)
        if world == 2 and rank == 1 and step == start + 2:
            Path(config["agent"]).write_text(str(os.getppid()))  # the agent on h1
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_a_sigterm_to_one_hosts_agent_resizes_the_run_without_that_host(ssh: Any, storage: str, tmp_path: Path) -> None:
    agent_file = tmp_path / "agent"

    def preempt_h1() -> None:
        deadline = time.monotonic() + 60
        while not agent_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if agent_file.exists():
            os.kill(int(agent_file.read_text()), signal.SIGTERM)

    sender = threading.Thread(target=preempt_h1, daemon=True)
    sender.start()
    result = TorchTrainer(
        _steps_until_alone,
        train_loop_config={"agent": str(agent_file)},
        scaling_config=train.ScalingConfig(
            num_workers=(1, 2), hosts=["h0 slots=1", "h1 slots=1"], elastic_resize_monitor_interval_s=600.0
        ),
        run_config=train.RunConfig(name="spot", storage_path=storage),
    ).fit()
    sender.join(10)
    run = json.loads((Path(storage) / "spot" / "run.json").read_text())
    assert run["status"] == "FINISHED" and not run.get("attempt_errors"), run  # not preempted, not a failure
    assert [(r["from"], r["to"]) for r in run["resizes"]] == [(2, 1)], run["resizes"]
    assert "h1" in run["resizes"][0]["why"] and "preempted" in run["resizes"][0]["why"], run["resizes"]
    lines = _lines(Path(storage) / "spot" / "metrics.jsonl")
    assert {(line["attempt"], line["world_size"]) for line in lines} == {(0, 2), (1, 1)}
    by_attempt: dict[int, list[int]] = {}
    for line in lines:
        by_attempt.setdefault(line["attempt"], []).append(line["metrics"]["step"])
    # Resumed from the checkpoint committed after the notice: no gap; a step repeats only if
    # its report was written and its checkpoint not committed before the group stopped.
    first, last = by_attempt[0], by_attempt[1]
    assert first == list(range(len(first))) and last[0] in (first[-1], first[-1] + 1), by_attempt
    assert last == list(range(last[0], last[0] + 3)) and result.metrics["step"] == last[-1], by_attempt
    # The world size of each report, next to the reports as they were made (no key added to them).
    sizes = [line["world_size"] for line in lines]
    assert result.report_world_sizes == sizes and sizes[0] == 2 and sizes[-1] == 1, (result.report_world_sizes, sizes)
    assert all(set(m) == {"step"} for m in result.metrics_history)
    assert train.Result.from_path(Path(storage) / "spot").report_world_sizes == sizes


def _return_world() -> int:
    return train.get_context().get_world_size()


@pytest.mark.timeout(180)
def test_a_run_waits_for_min_workers_within_a_bound(
    make_netns: Any, storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hosts = make_netns(count=2)
    monkeypatch.setenv("DDPTRAIN_SSH_CONNECT_TIMEOUT_S", "2")
    monkeypatch.setenv("DDPTRAIN_ELASTIC_MIN_WORKERS_TIMEOUT_S", "3")

    def fit(name: str) -> train.Result:
        return TorchTrainer(
            _return_world,
            scaling_config=train.ScalingConfig(num_workers=(2, 2), hosts=["n0 slots=1", "n1 slots=1"]),
            run_config=train.RunConfig(name=name, storage_path=storage),
        ).fit()

    hosts.set_link(1, False)
    try:
        # n1 never answers: a clear error once the wait for it is over, not at once, not never.
        started = time.monotonic()
        with pytest.raises(train.LaunchError) as error:
            fit("never")
        took = time.monotonic() - started
        message = str(error.value)
        assert "needs at least 2 workers" in message and "Waited 3 s for host(s) n1" in message, message
        assert "DDPTRAIN_ELASTIC_MIN_WORKERS_TIMEOUT_S" in message, message
        assert 3 <= took < 30, took

        # n1 answers again during the wait (after its connect timed out): the run starts on both.
        monkeypatch.setenv("DDPTRAIN_ELASTIC_MIN_WORKERS_TIMEOUT_S", "60")
        timer = threading.Timer(3.0, hosts.set_link, (1, True))
        started = time.monotonic()
        timer.start()
        assert fit("back").return_values == [2, 2]
        assert time.monotonic() - started >= 3.0
        timer.join()
    finally:
        hosts.set_link(1, True)
