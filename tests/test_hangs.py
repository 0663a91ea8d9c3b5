"""Nothing hangs silently: ranks that return early, stopped or wedged workers, stacks on demand."""

from __future__ import annotations

import os
import time

import pytest
from forked_driver import ForkedDriver

import ddptrain as train
from ddptrain.torch import TorchTrainer


def one_rank_returns_early() -> str:
    import torch
    import torch.distributed as dist

    if train.get_context().get_world_rank() == 1:
        return "done"
    total = torch.ones(1)
    while True:  # rank 1 will never join this
        dist.all_reduce(total)


@pytest.mark.timeout(90)
def test_a_rank_waiting_for_one_that_returned_fails_within_seconds(storage: str) -> None:
    start = time.monotonic()
    with pytest.raises(train.TrainingFailedError) as info:
        TorchTrainer(
            one_rank_returns_early,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "Root cause (first failure): rank 0" in message
    assert "Connection closed by peer" in message or "Connection reset by peer" in message
    assert "rank(s) [1] had already returned from the training function" in message
    assert elapsed < 30, elapsed  # gloo's own timeout is 30 minutes


def ddp_loop_with_a_stuck_rank(config: dict) -> None:
    import os
    import signal
    import threading

    import torch
    import torch.distributed as dist

    rank = train.get_context().get_world_rank()
    total = torch.ones(1)
    for step in range(10_000):
        if rank == 1 and step == 5:
            if config["how"] == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:  # a deadlock: waits for a lock nobody will release
                lock = threading.Lock()
                lock.acquire()
                lock.acquire()
        dist.all_reduce(total)
        time.sleep(0.01)


def _run_in_thread(how: str, storage: str):
    import threading

    outcome: dict = {}

    def target() -> None:
        try:
            TorchTrainer(
                ddp_loop_with_a_stuck_rank,
                train_loop_config={"how": how},
                scaling_config=train.ScalingConfig(num_workers=2),
                run_config=train.RunConfig(name=how, storage_path=storage),
            ).fit()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def _kill_workers() -> None:
    import signal as signals

    from conftest import tagged_processes

    for pid in tagged_processes():
        try:
            os.kill(pid, signals.SIGCONT)
            os.kill(pid, signals.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(90)
def test_a_stopped_worker_is_named_with_its_state(storage: str, monkeypatch, caplog, capfd) -> None:
    import logging

    monkeypatch.setenv("DDPTRAIN_REPORT_WARN_INTERVAL_S", "1")
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        thread, outcome = _run_in_thread("stop", storage)
        deadline = time.monotonic() + 45
        while not any("stopped by a signal" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no warning about the stopped worker"
            time.sleep(0.2)
        seen = ""
        while "in all_reduce" not in seen:  # where its peer waits, printed with the warning
            assert time.monotonic() < deadline, f"no stack of rank 0: {seen[-2000:]}"
            time.sleep(0.2)
            seen += "\n".join(line for line in capfd.readouterr().err.splitlines() if line.startswith("[rank0]"))
        _kill_workers()
        thread.join(30)
    message = next(r.getMessage() for r in caplog.records if "stopped by a signal" in r.getMessage())
    assert "rank 1 (host" in message and "kill -CONT" in message
    assert isinstance(outcome.get("error"), train.TrainingFailedError)


@pytest.mark.timeout(90)
def test_a_wedged_group_shows_every_ranks_stack(storage: str, monkeypatch, caplog, capfd) -> None:
    import logging

    monkeypatch.setenv("DDPTRAIN_STALL_WARN_S", "3")
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        thread, outcome = _run_in_thread("deadlock", storage)
        deadline = time.monotonic() + 45
        seen = ""
        while "ddp_loop_with_a_stuck_rank" not in seen or seen.count("most recent call first") < 2:
            assert time.monotonic() < deadline, f"no stacks: {seen[-2000:]}"
            time.sleep(0.3)
            seen += capfd.readouterr().err
        _kill_workers()
        thread.join(30)
    warning = next(r.getMessage() for r in caplog.records if "no rank has reported or printed" in r.getMessage())
    assert "rank 0 (host" in warning and "rank 1 (host" in warning
    rank0 = "\n".join(line for line in seen.splitlines() if line.startswith("[rank0]"))
    rank1 = "\n".join(line for line in seen.splitlines() if line.startswith("[rank1]"))
    assert "in all_reduce" in rank0  # rank 0 waits in the collective...
    assert "in ddp_loop_with_a_stuck_rank" in rank1 and "all_reduce" not in rank1  # ...for rank 1, stuck elsewhere


@pytest.mark.timeout(120)
def test_ddptrain_stack_prints_every_ranks_stack_of_a_live_run(storage: str, tmp_path) -> None:
    import subprocess
    import sys

    script = tmp_path / "live.py"
    script.write_text(
        "import sys, time\n"
        "import ddptrain as train\n"
        "def sleepy_train_loop():\n"
        "    for step in range(600):\n"
        "        train.report({'step': step})\n"
        "        time.sleep(0.1)\n"
        "if __name__ == '__main__':\n"
        "    train.DataParallelTrainer(sleepy_train_loop, scaling_config=train.ScalingConfig(num_workers=2),\n"
        "        run_config=train.RunConfig(name='live', storage_path=sys.argv[1])).fit()\n"
    )
    live = ForkedDriver(script, [storage], stdout="devnull", stderr="devnull")  # a driver process of its own, forked
    try:
        metrics = os.path.join(storage, "live", "metrics.jsonl")
        deadline = time.monotonic() + 60
        while not (os.path.exists(metrics) and open(metrics).read().count("\n") >= 3):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        out = subprocess.run(
            [sys.executable, "-m", "ddptrain.cli", "stack", os.path.join(storage, "live")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        live.kill()
        live.wait()
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert f"=== rank {rank} (host" in out.stdout
    assert out.stdout.count("sleepy_train_loop") >= 2, out.stdout
    # A run that is not running is refused.
    gone = subprocess.run(
        [sys.executable, "-m", "ddptrain.cli", "stack", os.path.join(storage, "live")], capture_output=True, text=True
    )
    assert gone.returncode == 1 and "not running" in gone.stderr


def chatty_loop(config: dict) -> int:
    """Prints a lot (through its agent) and reports until told to stop; rank 0 leaves its agent's pid."""
    from pathlib import Path

    if train.get_context().get_world_rank() == 0:
        Path(config["agent"]).write_text(str(os.getppid()))
    steps = 0
    while not Path(config["done"]).exists():
        print("x" * 2000, flush=True)
        train.report({"step": steps})
        steps += 1
        time.sleep(0.05)
    return steps


@pytest.mark.timeout(90)
def test_a_stopped_agent_is_named_and_the_run_goes_on_once_it_resumes(
    storage: str, tmp_path, monkeypatch, caplog
) -> None:
    # A local agent stopped by a signal answers nothing: its workers block on their output and
    # the driver heard nothing of it (a stall warning came after 30 s with states from before).
    import logging
    import signal as signals
    import threading

    monkeypatch.setenv("DDPTRAIN_REPORT_WARN_INTERVAL_S", "1")
    agent_file, done = tmp_path / "agent", tmp_path / "done"
    outcome: dict = {}

    def fit() -> None:
        try:
            outcome["result"] = TorchTrainer(
                chatty_loop,
                train_loop_config={"agent": str(agent_file), "done": str(done)},
                scaling_config=train.ScalingConfig(num_workers=2),
                run_config=train.RunConfig(name="stopped-agent", storage_path=storage),
            ).fit()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    agent = 0
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        thread = threading.Thread(target=fit, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 45
            while not agent_file.exists() or not agent_file.read_text():
                assert time.monotonic() < deadline and thread.is_alive(), outcome
                time.sleep(0.1)
            agent = int(agent_file.read_text())
            os.kill(agent, signals.SIGSTOP)
            stopped_at = time.monotonic()
            while not any(
                "agent" in r.getMessage() and "stopped by a signal" in r.getMessage() for r in caplog.records
            ):
                assert time.monotonic() < stopped_at + 15, "nothing said the agent was stopped"
                time.sleep(0.2)
        finally:
            if agent:
                os.kill(agent, signals.SIGCONT)
            done.touch()
        thread.join(45)
    assert not thread.is_alive()
    warning = next(r.getMessage() for r in caplog.records if "stopped by a signal" in r.getMessage())
    assert f"the ddptrain agent on this machine (pid {agent})" in warning and f"kill -CONT {agent}" in warning
    assert "error" not in outcome, outcome["error"]
    assert outcome["result"].return_value > 0
