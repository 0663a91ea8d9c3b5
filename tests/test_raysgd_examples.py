"""The RaySGD examples run as a user would run them (slow: each starts its own workers).
``raysgd_custom_batch.py`` and ``raysgd_creators.py`` cover what ``test_raysgd.py`` tests
(a custom ``train_batch``, ``from_creators``) and are left to manual runs to save time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=240, env=dict(os.environ)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_raysgd_linear_trains_saves_and_continues_in_a_second_trainer() -> None:
    out = _run("raysgd_linear.py", "--num-workers", "2", "--epochs", "3")
    losses = [float(line.split("val_loss ")[1]) for line in out.splitlines() if line.startswith("epoch ")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "the second trainer continued at epoch 5" in out  # 3 epochs + 1 profiled, then one more


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_raysgd_gan_trains_two_models() -> None:
    out = _run("raysgd_gan.py", "--num-workers", "1", "--epochs", "2")
    assert "epoch 2: loss_d" in out and "models: Sequential, Sequential" in out
