"""A TrainingOperator with its own ``train_batch`` and ``validate_batch`` (RaySGD's "custom
training and validation"), classifying points by the quadrant they are in.

Custom metrics from ``train_batch`` (here ``accuracy``) are averaged like the loss: over the
batches of each worker (weighted by ``num_samples``), then over the workers.

    python examples/raysgd_custom_batch.py --num-workers 2 --epochs 3
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ddptrain.util.sgd import TorchTrainer
from ddptrain.util.sgd.torch import TrainingOperator
from ddptrain.util.sgd.utils import NUM_SAMPLES


def quadrants(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    points = torch.randn(n, 2, generator=generator)
    labels = (points[:, 0] > 0).long() * 2 + (points[:, 1] > 0).long()
    return TensorDataset(points, labels)


class QuadrantOperator(TrainingOperator):
    def setup(self, config):
        model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4))
        optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=optimizer, criterion=nn.CrossEntropyLoss()
        )
        self.register_data(
            train_loader=DataLoader(quadrants(2048, 0), batch_size=64, shuffle=True),
            validation_loader=DataLoader(quadrants(512, 1), batch_size=128),
        )

    def train_batch(self, batch, batch_info):
        points, labels = (t.to(self.device) for t in batch)
        with self.timers.record("fwd"):
            logits = self.model(points)
            loss = self.criterion(logits, labels)
        with self.timers.record("grad"):
            self.optimizer.zero_grad()
            loss.backward()
        with self.timers.record("apply"):
            self.optimizer.step()
        accuracy = (logits.argmax(1) == labels).float().mean().item()
        return {"train_loss": loss.item(), "accuracy": accuracy, NUM_SAMPLES: len(labels)}

    def validate_batch(self, batch, batch_info):
        points, labels = (t.to(self.device) for t in batch)
        logits = self.model(points)
        return {
            "val_loss": self.criterion(logits, labels).item(),
            "val_accuracy": (logits.argmax(1) == labels).float().mean().item(),
            NUM_SAMPLES: len(labels),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    with TorchTrainer(training_operator_cls=QuadrantOperator, num_workers=args.num_workers, config={"lr": 0.01}) as t:
        for _ in range(args.epochs):
            stats = t.train()
            print(f"epoch {stats['epoch']}: loss {stats['train_loss']:.3f} accuracy {stats['accuracy']:.3f}")
        print(f"validation accuracy {t.validate()['val_accuracy']:.3f}")


if __name__ == "__main__":
    main()
