"""The RaySGD examples' main() with a user's arguments (slow: each starts its own workers).
``raysgd_custom_batch.py`` and ``raysgd_creators.py`` cover what ``test_raysgd.py`` tests
(a custom ``train_batch``, ``from_creators``) and are left to manual runs to save time."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from example_runner import run_example_in_process


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> Callable[..., str]:
    """``run(name, *args)``: the example's main() in this process, its output (a script driver
    would import torch and start a fork server of its own before any worker)."""
    return lambda name, *args: run_example_in_process(name, *args, monkeypatch=monkeypatch, capfd=capfd)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_raysgd_linear_trains_saves_and_continues_in_a_second_trainer(run: Callable[..., str]) -> None:
    out = run("raysgd_linear.py", "--num-workers", "2", "--epochs", "3")
    losses = [float(line.split("val_loss ")[1]) for line in out.splitlines() if line.startswith("epoch ")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "the second trainer continued at epoch 5" in out  # 3 epochs + 1 profiled, then one more


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_raysgd_gan_trains_two_models(run: Callable[..., str]) -> None:
    out = run("raysgd_gan.py", "--num-workers", "1", "--epochs", "2")
    assert "epoch 2: loss_d" in out and "models: Sequential, Sequential" in out
