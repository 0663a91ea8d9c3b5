"""RaySGD's TorchTrainer after a worker loss: it goes on with the workers that can start and
grows back to ``num_workers`` when they can again; ``load_state_dict(blocking=False)`` returns
before the workers have loaded. Real worker processes, gloo, 2 workers."""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ddptrain import WorkerGroupError
from ddptrain.util.sgd import TorchTrainer, TrainingOperator
from ddptrain.util.sgd.torch import torch_trainer
from ddptrain.util.sgd.utils import BATCH_SIZE, NUM_SAMPLES

pytestmark = pytest.mark.slow


class LinearOperator(TrainingOperator):
    """16 samples split among the workers; rank 1 is SIGKILLed in ``train_batch`` while the
    file ``config["kill"]`` exists (it removes it first: once)."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(self.world_rank)  # different initial weights: DDP and restarts must sync them
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=optimizer, criterion=nn.MSELoss()
        )
        x = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
        self.register_data(train_loader=DataLoader(TensorDataset(x, 2 * x + 1), batch_size=config[BATCH_SIZE]))
        self.loaded: Any = None

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        kill = Path(self.config["kill"])
        if self.world_rank == 1 and kill.exists():
            kill.unlink()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().train_batch(batch, batch_info)

    def state_dict(self) -> dict[str, Any]:
        return {"loaded": self.loaded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        time.sleep(self.config.get("load_s", 0.0))
        self.loaded = state["loaded"]


def _no_rank_1_while(down: str) -> None:
    """Initialization hook: while the file ``down`` exists a second worker cannot start (its
    process dies as it starts, as on a host that went away)."""
    if os.environ.get("RANK") == "1" and os.path.exists(down):
        os.kill(os.getpid(), signal.SIGKILL)


def _params(op: TrainingOperator) -> list[float]:
    return [p.item() for p in op.model.parameters()]


def test_a_lost_worker_that_cannot_restart_shrinks_the_group_which_grows_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    kill, down = tmp_path / "kill", tmp_path / "down"
    config = {BATCH_SIZE: 8, "kill": str(kill)}
    with TorchTrainer(
        training_operator_cls=LinearOperator,
        num_workers=2,
        config=config,
        initialization_hook=functools.partial(_no_rank_1_while, str(down)),
    ) as trainer:
        assert trainer.train()["epoch"] == 1 and trainer.worker_count == 2

        kill.touch()
        down.touch()  # rank 1 dies, and no second worker can start for now
        with pytest.warns(RuntimeWarning, match="only 1 of 2 workers"):
            shrunk = trainer.train()
        assert not kill.exists()  # rank 1 really died
        assert trainer.worker_count == 1
        assert shrunk["epoch"] == 2 and shrunk[NUM_SAMPLES] == 16  # all the data on one worker
        assert trainer.apply_all_operators(lambda op: op.config[BATCH_SIZE]) == [8]

        down.unlink()  # the second worker could start again, but the trainer waits a while
        assert trainer.train()["epoch"] == 3 and trainer.worker_count == 1
        before = trainer.get_model().weight.item()

        monkeypatch.setattr(torch_trainer, "_GROW_INTERVAL_S", 0.0)  # as if that while had passed
        with caplog.at_level(logging.WARNING, logger=torch_trainer.__name__):
            grown = trainer.train()
        assert "back to 2 workers" in caplog.text
        assert trainer.worker_count == 2
        assert grown["epoch"] == 4 and grown[NUM_SAMPLES] == 16  # the epoch count goes on
        assert trainer.apply_all_operators(lambda op: op.config[BATCH_SIZE]) == [4, 4]
        weights = trainer.apply_all_operators(_params)
        assert weights[0] == weights[1]  # DDP again across both, from the shrunken group's state
        assert weights[0][0] != before  # and it trained on from there
        assert trainer.train()["epoch"] == 5 and trainer.worker_count == 2


def test_load_state_dict_non_blocking_returns_before_the_workers_loaded(tmp_path: Path) -> None:
    load_s = 2.0
    config = {BATCH_SIZE: 8, "kill": str(tmp_path / "kill"), "load_s": load_s}
    with TorchTrainer(training_operator_cls=LinearOperator, num_workers=2, config=config, wrap_ddp=False) as trainer:
        state = trainer.state_dict()
        state["operator"] = {"loaded": "first"}

        start = time.monotonic()
        trainer.load_state_dict(state, blocking=False)
        assert time.monotonic() - start < load_s / 2  # the workers are still loading
        state["operator"]["loaded"] = "changed after the call"  # does not reach them
        assert trainer.apply_all_operators(lambda op: op.loaded) == ["first", "first"]  # this call waited
        assert time.monotonic() - start >= load_s

        state["operator"] = {"loaded": "second"}
        start = time.monotonic()
        trainer.load_state_dict(state, blocking=True)
        assert time.monotonic() - start >= load_s
        assert trainer.apply_all_operators(lambda op: op.loaded) == ["second", "second"]

        # A load that fails on the workers fails the next call, which names the cause.
        trainer.load_state_dict({**state, "models": []}, blocking=False)
        with pytest.raises(WorkerGroupError, match="different TrainingOperator"):
            trainer.get_model()
        # The trainer goes on from the last state that loaded.
        assert trainer.apply_all_operators(lambda op: op.loaded) == ["second", "second"]
