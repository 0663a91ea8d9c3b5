"""RaySGD's older creator functions, kept as they were: ``TrainingOperator.from_creators``
turns them into an operator class.

    python examples/raysgd_creators.py --num-workers 2 --epochs 3
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ddptrain.util.sgd import TorchTrainer
from ddptrain.util.sgd.torch import TrainingOperator
from ddptrain.util.sgd.utils import BATCH_SIZE


def model_creator(config):
    return nn.Linear(1, 1)


def optimizer_creator(model, config):
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-2))


def scheduler_creator(optimizer, config):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)


def data_creator(config):
    x = torch.rand(512, 1) * 10
    data = TensorDataset(x, 3 * x - 1)
    return DataLoader(data, batch_size=config[BATCH_SIZE], shuffle=True), DataLoader(data, batch_size=128)


MyTrainingOperator = TrainingOperator.from_creators(
    model_creator=model_creator,
    optimizer_creator=optimizer_creator,
    data_creator=data_creator,
    loss_creator=nn.MSELoss,
    scheduler_creator=scheduler_creator,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    trainer = TorchTrainer(
        training_operator_cls=MyTrainingOperator,
        num_workers=args.num_workers,
        scheduler_step_freq="epoch",  # a scheduler_creator was passed
        config={"lr": 0.01, BATCH_SIZE: 64},
    )
    try:
        for _ in range(args.epochs):
            print(f"epoch {trainer.train()['epoch']}: val_loss {trainer.validate()['val_loss']:.4f}")
        model = trainer.get_model()
        print(f"learned y = {model.weight.item():.2f} x + {model.bias.item():.2f}")
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    main()
