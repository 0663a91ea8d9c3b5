"""Restarts from warm agents: after a worker crash, the next attempt's workers are forked by the
failed attempt's agent (same pid: no new agent, no new SSH connection, no torch import), which
killed every old worker and what they started first; the attempt resumes from the latest
checkpoint as always."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

import ddptrain as train
from ddptrain.torch import TorchTrainer


def crash_then_resume(config: dict[str, str]) -> dict[str, Any]:
    rank = train.get_context().get_world_rank()
    agent = os.getppid()
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:  # the second attempt
        return {"agent": agent, "resumed_from": int(Path(checkpoint.path, "step").read_text())}
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "step").write_text("0")
        train.report({"step": 0}, checkpoint=train.Checkpoint.from_directory(folder) if rank == 0 else None)
    first = Path(config["first"])
    if rank == 0:  # a process of its own, which the agent must not keep either
        child = subprocess.Popen(["sleep", "60"])
        first.write_text(json.dumps({"agent": agent, "child": child.pid}))
        time.sleep(60)  # until the driver stops it
    deadline = time.monotonic() + 30
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    os._exit(3)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # dead, its parent has not reaped it yet
    except FileNotFoundError:
        return True


def _fit(storage: str, tmp_path: Path, **scaling: Any) -> tuple[dict[str, int], list[dict[str, Any]]]:
    first = tmp_path / "first.json"
    result = train.DataParallelTrainer(
        crash_then_resume,
        train_loop_config={"first": str(first)},
        scaling_config=train.ScalingConfig(num_workers=2, **scaling),
        run_config=train.RunConfig(
            name="warm", storage_path=storage, failure_config=train.FailureConfig(max_failures=1)
        ),
    ).fit()
    run = json.loads((Path(storage) / "warm" / "run.json").read_text())
    assert len(run["attempt_errors"]) == 1, run  # the crash was a failure, and one restart followed
    return json.loads(first.read_text()), result.return_values


def test_a_restart_forks_the_next_workers_from_the_same_local_agent(storage: str, tmp_path: Path) -> None:
    first, values = _fit(storage, tmp_path)
    assert [v["agent"] for v in values] == [first["agent"]] * 2, (first, values)
    assert [v["resumed_from"] for v in values] == [0, 0]
    assert _gone(first["child"]), "a process the first attempt's worker started outlived its attempt"


def test_warm_restarts_can_be_turned_off(storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPTRAIN_WARM_RESTARTS", "0")
    first, values = _fit(storage, tmp_path)
    assert values[0]["agent"] != first["agent"] and values[0]["resumed_from"] == 0


@pytest.mark.ssh
def test_a_restart_forks_the_next_workers_from_the_same_ssh_agent(ssh: Any, storage: str, tmp_path: Path) -> None:
    first, values = _fit(storage, tmp_path, hosts=["h0 slots=2"])
    assert [v["agent"] for v in values] == [first["agent"]] * 2, (first, values)
    assert [v["resumed_from"] for v in values] == [0, 0]
    assert _gone(first["child"]), "a process the first attempt's worker started outlived its attempt"


def all_ranks_die_once(config: dict[str, str]) -> dict[str, Any]:
    """Rank 1 is killed in a collective, and rank 0's collective fails with it: no worker of the
    agent is left when the driver decides to restart."""
    import torch
    import torch.distributed as dist

    marker = Path(config["marker"])
    if not marker.exists() and train.get_context().get_world_rank() == 1:
        marker.write_text(str(os.getppid()))  # the first attempt's agent
        os.kill(os.getpid(), 9)
    dist.all_reduce(torch.ones(1))
    return {"agent": os.getppid()}


def _hosts(request: pytest.FixtureRequest, where: str) -> dict[str, list[str]]:
    """The ScalingConfig arguments that put both workers on ``where``: this machine, or one
    SSH host (its sshd fixture started)."""
    if where != "ssh host":
        return {}
    request.getfixturevalue("ssh")
    return {"hosts": ["h0 slots=2"]}


@pytest.mark.parametrize("where", ["local", "ssh host"])
def test_a_restart_after_every_worker_died_forks_them_from_the_same_agent(
    request: pytest.FixtureRequest, storage: str, tmp_path: Path, where: str
) -> None:
    hosts = _hosts(request, where)
    marker = tmp_path / "killed"
    result = TorchTrainer(
        all_ranks_die_once,
        train_loop_config={"marker": str(marker)},
        scaling_config=train.ScalingConfig(num_workers=2, **hosts),
        run_config=train.RunConfig(
            name="all", storage_path=storage, failure_config=train.FailureConfig(max_failures=1)
        ),
    ).fit()
    run = json.loads((Path(storage) / "all" / "run.json").read_text())
    assert len(run["attempt_errors"]) == 1, run
    assert [v["agent"] for v in result.return_values] == [int(marker.read_text())] * 2


def fails_once_naming_its_agent(config: dict[str, str]) -> dict[str, Any]:
    """Attempt 0: rank 0 writes its agent's pid and fails. Later attempts return their agent."""
    marker = Path(config["agent"])
    if train.get_context().get_world_rank() == 0 and not marker.exists():
        marker.write_text(str(os.getppid()))
        raise ValueError("the first attempt fails")
    return {"agent": os.getppid()}


class KillsTheKeptAgent(train.UserCallback):
    """Once attempt 0 failed, and its agent was kept for the next attempt: SIGKILL that agent,
    before the next attempt's work reaches it (the driver calls this in between)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        marker = Path(self.marker)
        if marker.exists() and not Path(f"{self.marker}.killed").exists():
            Path(f"{self.marker}.killed").write_text("")
            os.kill(int(marker.read_text()), 9)


@pytest.mark.parametrize("where", ["local", "ssh host"])
def test_a_kept_agent_killed_before_the_next_attempt_is_a_failure_that_is_retried(
    request: pytest.FixtureRequest, storage: str, tmp_path: Path, where: str
) -> None:
    """The next attempt's work could not be written to the dead agent: that ended the run with
    "the agent did not start", even with failures left (found by SIGKILLing random processes
    of a run). It is now a failure of the attempt, and the next one starts a new agent."""
    hosts = _hosts(request, where)
    marker = tmp_path / "agent"
    result = TorchTrainer(
        fails_once_naming_its_agent,
        train_loop_config={"agent": str(marker)},
        scaling_config=train.ScalingConfig(num_workers=2, **hosts),
        run_config=train.RunConfig(
            name="gone",
            storage_path=storage,
            failure_config=train.FailureConfig(max_failures=2),
            callbacks=[KillsTheKeptAgent(str(marker))],
        ),
    ).fit()
    run = json.loads((Path(storage) / "gone" / "run.json").read_text())
    errors = run["attempt_errors"]
    assert len(errors) == 2 and "the first attempt fails" in str(errors[0]), run
    # The dead agent's pipe may still take the bootstrap: its death is then seen a moment later.
    said = str(errors[1])  # the bootstrap found it gone, or its end was read just after it
    assert "was gone before it got its work" in said or "died (killed by signal SIGKILL" in said, said
    killed = int(marker.read_text())
    assert all(v["agent"] != killed for v in result.return_values)
