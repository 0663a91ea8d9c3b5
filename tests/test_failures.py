"""Failures: the first failed rank brings the whole group down, and fit() says why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain.torch import TorchConfig, TorchTrainer


class DataError(Exception):
    pass


def fail_on_rank_one(config: dict) -> None:
    import torch
    import torch.distributed as dist

    rank = train.get_context().get_world_rank()
    print(f"rank {rank} starting", flush=True)
    if rank == 1:
        time.sleep(0.3)
        mode = config["mode"]
        if mode == "raise":
            raise DataError("bad batch 17")
        if mode == "exit":
            os._exit(7)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "unpicklable":
            error = RuntimeError("holds a lock")
            error.lock = threading.Lock()  # type: ignore[attr-defined]
            raise error
    if config.get("rank0") == "sleep":
        time.sleep(600)  # not in a collective: only the driver can stop it
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here, waiting for rank 1


def run_failing(storage: str, mode: str, **extra: object) -> train.TrainingFailedError:
    trainer = TorchTrainer(
        fail_on_rank_one,
        train_loop_config={"mode": mode, **extra},
        torch_config=TorchConfig(timeout_s=900),
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="fail", storage_path=storage),
    )
    with pytest.raises(train.TrainingFailedError) as info:
        trainer.fit()
    return info.value


@pytest.mark.timeout(60)
def test_worker_exception_names_rank_traceback_and_log(storage: str) -> None:
    error = run_failing(storage, "raise")

    assert isinstance(error, train.WorkerGroupError)
    assert isinstance(error.__cause__, DataError)
    assert isinstance(error.worker_failures[1], DataError)
    message = str(error)
    assert "Root cause (first failure): rank 1" in message
    assert "DataError: bad batch 17" in message
    assert 'raise DataError("bad batch 17")' in message  # the user's own line
    assert "ddptrain/worker.py" not in message  # no library frames on top
    log = Path(storage, "fail", "logs", "attempt_0", "rank_1.log")
    assert str(log) in message
    assert "rank 1 starting" in log.read_text()
    assert "DataError: bad batch 17" in log.read_text()


@pytest.mark.timeout(60)
def test_worker_exit_code_is_reported(storage: str) -> None:
    error = run_failing(storage, "exit")
    assert "rank 1" in str(error) and "exit code 7" in str(error)
    assert isinstance(error.worker_failures[1], train.WorkerDiedError)
    assert error.worker_failures[1].exitcode == 7


@pytest.mark.timeout(60)
def test_worker_killed_by_signal_is_reported(storage: str) -> None:
    error = run_failing(storage, "kill")
    assert "killed by signal SIGKILL (9)" in str(error)
    assert error.worker_failures[1].exitcode == -9


@pytest.mark.timeout(60)
def test_survivor_outside_any_collective_is_stopped(storage: str) -> None:
    # Rank 0 sleeps for 10 minutes where no collective can notice; the driver stops it.
    error = run_failing(storage, "raise", rank0="sleep")
    assert list(error.worker_failures) == [1]


@pytest.mark.timeout(60)
def test_unpicklable_exception_keeps_its_traceback(storage: str) -> None:
    error = run_failing(storage, "unpicklable")
    stand_in = error.worker_failures[1]
    assert isinstance(stand_in, train.WorkerError)
    assert "RuntimeError: holds a lock" in str(stand_in)
    assert "error.lock = threading.Lock()" not in str(error)  # the raise line, not the setup line
    assert "raise error" in str(error)


class RecordingCallback(train.UserCallback):
    def __init__(self, path: str) -> None:
        self.path = path

    def after_exception(self, run_context, worker_exceptions) -> None:
        Path(self.path).write_text(",".join(f"{r}:{type(e).__name__}" for r, e in worker_exceptions.items()))


@pytest.mark.timeout(60)
def test_after_exception_callback_sees_the_failure(storage: str, tmp_path: Path) -> None:
    record = tmp_path / "exceptions.txt"
    with pytest.raises(train.TrainingFailedError):
        TorchTrainer(
            fail_on_rank_one,
            train_loop_config={"mode": "raise", "rank0": "sleep"},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage, callbacks=[RecordingCallback(str(record))]),
        ).fit()
    assert record.read_text() == "1:DataError"


DRIVER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import ddptrain as train

    def loop():
        print("worker up", flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        train.DataParallelTrainer(
            loop,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="bg", storage_path=sys.argv[1]),
        ).fit()
    """
)


def start_driver(tmp_path: Path, storage: str) -> subprocess.Popen[str]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), storage], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        seen += "worker up" in line
        if seen == 2:
            return proc
    proc.kill()
    raise AssertionError("the workers never started")


@pytest.mark.timeout(60)
def test_ctrl_c_in_the_driver_stops_every_worker(tmp_path: Path, storage: str) -> None:
    proc = start_driver(tmp_path, storage)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert "KeyboardInterrupt" in out
    # The autouse fixture fails the test if a worker or agent is still alive.


@pytest.mark.timeout(60)
def test_workers_exit_when_the_driver_is_killed(tmp_path: Path, storage: str) -> None:
    from conftest import tagged_processes

    proc = start_driver(tmp_path, storage)
    assert len(tagged_processes()) >= 4  # the driver, the agent and two workers
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while tagged_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tagged_processes() == []


def crash_with_a_child_holding_the_pipes() -> None:
    import subprocess

    if train.get_context().get_world_rank() == 1:
        # A long-lived child (think DataLoader worker) inherits stdout/stderr.
        subprocess.Popen(["sleep", "300"])
        raise DataError("crashed while a child process runs")
    time.sleep(300)


@pytest.mark.timeout(60)
def test_a_crash_is_seen_even_while_the_workers_children_hold_its_pipes(storage: str) -> None:
    start = time.monotonic()
    with pytest.raises(train.TrainingFailedError) as info:
        train.DataParallelTrainer(
            crash_with_a_child_holding_the_pipes,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert isinstance(info.value.__cause__, DataError)
    assert time.monotonic() - start < 30  # not the child's 300 s
