"""RaySGD's linear-regression TrainingOperator, on ddptrain (``ray.util.sgd`` → ``ddptrain.util.sgd``).

Trains ``y = 2x + 5`` with a ``TorchTrainer``, validates every epoch, saves, and loads the
checkpoint into a second trainer that carries on where the first stopped (the learning-rate
schedule included). The loss is ``MSELoss``: the RaySGD docs' ``BCELoss`` cannot take targets
of 5 to 25.

    python examples/raysgd_linear.py --num-workers 2 --epochs 5
"""

import argparse
import os
import tempfile

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from ddptrain.util.sgd import TorchTrainer  # was: from ray.util.sgd import TorchTrainer
from ddptrain.util.sgd.torch import TrainingOperator  # was: from ray.util.sgd.torch import ...
from ddptrain.util.sgd.utils import BATCH_SIZE  # was: from ray.util.sgd.utils import BATCH_SIZE


class LinearDataset(Dataset):
    """y = a * x + b, for x in [0, 10)."""

    def __init__(self, a: float, b: float, size: int = 1000) -> None:
        x = torch.arange(0, 10, 10 / size, dtype=torch.float32)
        self.x = x.unsqueeze(1)
        self.y = (a * x + b).unsqueeze(1)

    def __getitem__(self, index):
        return self.x[index], self.y[index]

    def __len__(self) -> int:
        return len(self.x)


class MyTrainingOperator(TrainingOperator):
    def setup(self, config):
        train_dataset, val_dataset = LinearDataset(2, 5), LinearDataset(2, 5, size=400)
        train_loader = DataLoader(train_dataset, batch_size=config[BATCH_SIZE], shuffle=True)
        val_loader = DataLoader(val_dataset, batch_size=config[BATCH_SIZE])
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-2))
        criterion = nn.MSELoss()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
        self.model, self.optimizer, self.criterion, self.scheduler = self.register(
            models=model, optimizers=optimizer, criterion=criterion, schedulers=scheduler
        )
        self.register_data(train_loader=train_loader, validation_loader=val_loader)


def make_trainer(num_workers: int) -> TorchTrainer:
    return TorchTrainer(
        training_operator_cls=MyTrainingOperator,
        num_workers=num_workers,
        use_gpu=False,
        scheduler_step_freq="epoch",
        config={"lr": 0.02, BATCH_SIZE: 64},  # each worker gets 64 // num_workers per batch
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    checkpoint = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
    with make_trainer(args.num_workers) as trainer:
        for _ in range(args.epochs):
            stats = trainer.train()
            val = trainer.validate()
            print(f"epoch {stats['epoch']}: train_loss {stats['train_loss']:.4f} val_loss {val['val_loss']:.4f}")
        print(f"profile of one epoch: {trainer.train(profile=True)['profile']}")
        trainer.save(checkpoint)
        model = trainer.get_model()  # an ordinary nn.Linear in this process
        print(f"learned y = {model.weight.item():.2f} x + {model.bias.item():.2f}")

    with make_trainer(args.num_workers) as trainer_2:
        trainer_2.load(checkpoint)
        stats = trainer_2.train()
        print(f"the second trainer continued at epoch {stats['epoch']}: train_loss {stats['train_loss']:.4f}")


if __name__ == "__main__":
    main()
