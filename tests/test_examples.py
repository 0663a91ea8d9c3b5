"""The examples run as a user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from example_runner import run_example_in_process

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, storage: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**__import__("os").environ, "DDPTRAIN_STORAGE_PATH": storage},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(300)
def test_torch_quickstart(storage: str) -> None:
    out = run_example("torch_quickstart.py", storage, "--num-workers", "2", "--epochs", "2")
    assert "[rank0] {'loss':" in out
    assert "loaded the checkpoint from" in out


@pytest.mark.timeout(300)
def test_data_parallel_trainer_examples(storage: str) -> None:
    out = run_example("data_parallel_trainer.py", storage)
    assert "each worker's batch: [{'item': [1]}, {'item': [2]}, {'item': [3]}]" in out
    assert "predefined loop returned: [1, 1]" in out
    assert "MY_ENV_VAR on the workers: ['default_value', 'default_value']" in out


@pytest.mark.timeout(300)
def test_dataset_shard_example(storage: str) -> None:
    out = run_example("dataset_shard.py", storage, "--epochs", "2")
    assert "each worker's item: [1, 2, 3]" in out
    assert "rows of 'train' per worker: [2000, 2000]" in out
    losses = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if line.startswith("epoch ")]
    assert len(losses) == 2 and losses[-1] < 0.1  # the model learned from the batches


@pytest.mark.timeout(300)
def test_checkpoint_resume(storage: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    # Both drivers are the example's main() in this process (the tests above run scripts as a
    # user types them): what this test is about is the crash, the restart and the resume by name.
    args = ("--storage-path", storage, "--name", "demo")
    first = run_example_in_process(
        "checkpoint_resume.py", *args, "--epochs", "3", "--crash-at", "1", monkeypatch=monkeypatch, capfd=capfd
    )
    assert "last attempt started at epoch 1" in first
    second = run_example_in_process(
        "checkpoint_resume.py", *args, "--epochs", "5", monkeypatch=monkeypatch, capfd=capfd
    )
    assert "last attempt started at epoch 3" in second
    assert "final metrics: {'epoch': 4" in second
