"""RaySGD's documentation helpers (``ray.util.sgd.torch.examples.train_example``): a linear data
set and creator functions for ``TrainingOperator.from_creators``, with Ray 1.x's signatures and
defaults, so that the guide's snippets run with their imports unchanged under ``ddptrain run``.

Example:
    >>> from ddptrain.util.sgd.torch.examples.train_example import LinearDataset
    >>> len(LinearDataset(2, 5, size=100))
    100
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from ddptrain.util.sgd import TorchTrainer, TrainingOperator

__all__ = ["LinearDataset", "data_creator", "model_creator", "optimizer_creator", "scheduler_creator", "train_example"]


class LinearDataset(Dataset):
    """``y = a * x + b`` for ``size`` points ``x`` evenly spaced in ``[0, 10)``; each item is
    ``(x, y)`` as two float32 tensors of shape ``(1,)``."""

    def __init__(self, a: float, b: float, size: int = 1000) -> None:
        x = np.arange(0, 10, 10 / size, dtype=np.float32)
        self.x = torch.from_numpy(x)
        self.y = torch.from_numpy(a * x + b)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index, None], self.y[index, None]

    def __len__(self) -> int:
        return len(self.x)


def model_creator(config: dict[str, Any]) -> nn.Module:
    """``nn.Linear(1, config.get("hidden_size", 1))``."""
    return nn.Linear(1, config.get("hidden_size", 1))


def optimizer_creator(model: nn.Module, config: dict[str, Any]) -> torch.optim.Optimizer:
    """SGD over the model's parameters with ``lr=config.get("lr", 1e-2)``."""
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-2))


def scheduler_creator(optimizer: torch.optim.Optimizer, config: dict[str, Any]) -> Any:
    """``StepLR(step_size=5, gamma=0.9)``; use it with ``TorchTrainer(scheduler_step_freq="epoch")``."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)


def data_creator(config: dict[str, Any]) -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders over ``LinearDataset(2, 5)`` (sizes ``data_size``,
    default 1000, and ``val_size``, default 400; ``batch_size`` default 32)."""
    train_dataset = LinearDataset(2, 5, size=config.get("data_size", 1000))
    val_dataset = LinearDataset(2, 5, size=config.get("val_size", 400))
    batch_size = config.get("batch_size", 32)
    return DataLoader(train_dataset, batch_size=batch_size), DataLoader(val_dataset, batch_size=batch_size)


def train_example(num_workers: int = 1, use_gpu: bool = False) -> None:
    """Ray's example: five epochs of the creators above with an MSE loss, then a validation."""
    operator = TrainingOperator.from_creators(
        model_creator=model_creator,
        optimizer_creator=optimizer_creator,
        data_creator=data_creator,
        scheduler_creator=scheduler_creator,
        loss_creator=nn.MSELoss,
    )
    trainer = TorchTrainer(
        training_operator_cls=operator,
        num_workers=num_workers,
        use_gpu=use_gpu,
        config={"lr": 1e-2, "hidden_size": 1, "batch_size": 4},
        backend="gloo",
        scheduler_step_freq="epoch",
    )
    try:
        for _ in range(5):
            print(trainer.train())
        print(trainer.validate())
        model = trainer.get_model(to_cpu=True)
        print(f"trained weight: {model.weight.item(): .2f}, bias: {model.bias.item(): .2f}")
    finally:
        trainer.shutdown()
    print("success!")
