"""Ray 2.6's ``LightningTrainer`` example (an MNIST classifier), with ddptrain imports.

Ray's docs train on MNIST from torchvision; here the images are synthetic 28x28 pictures whose
class is which of ten fixed patterns they resemble most, so nothing is downloaded. The rest is
Ray's example: a ``LightningModule`` class and its arguments, the ``Trainer``'s arguments and
``fit()``'s dataloaders go into a ``LightningConfigBuilder``; each worker builds them, and
Lightning's distributed sampler gives each its part of the dataloaders. ``.checkpointing()``
(not in Ray's example) keeps the two best checkpoints by validation accuracy. Under
``ddptrain run`` the same script runs with Ray's imports (``from ray.train.lightning import ...``).

    python examples/lightning_trainer.py --epochs 3
"""

import argparse
import os

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Accuracy

from ddptrain import RunConfig, ScalingConfig
from ddptrain.lightning import LightningConfigBuilder, LightningTrainer


class MNISTClassifier(pl.LightningModule):
    def __init__(self, lr, feature_dim):
        super().__init__()
        self.save_hyperparameters()
        self.fc1 = torch.nn.Linear(28 * 28, feature_dim)
        self.fc2 = torch.nn.Linear(feature_dim, 10)
        self.lr = lr
        self.accuracy = Accuracy(task="multiclass", num_classes=10, top_k=1)
        self.val_loss = []
        self.val_acc = []

    def forward(self, x):
        x = x.view(-1, 28 * 28)
        x = torch.relu(self.fc1(x))
        x = self.fc2(x)
        return x

    def training_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = torch.nn.functional.cross_entropy(y_hat, y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, val_batch, batch_idx):
        x, y = val_batch
        logits = self.forward(x)
        loss = F.nll_loss(logits, y)
        acc = self.accuracy(logits, y)
        self.val_loss.append(loss)
        self.val_acc.append(acc)
        return {"val_loss": loss, "val_accuracy": acc}

    def on_validation_epoch_end(self):
        avg_loss = torch.stack(self.val_loss).mean()
        avg_acc = torch.stack(self.val_acc).mean()
        self.log("ptl/val_loss", avg_loss, sync_dist=True)
        self.log("ptl/val_accuracy", avg_acc, sync_dist=True)
        self.val_acc.clear()
        self.val_loss.clear()

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        return optimizer


def synthetic_mnist(n, seed):
    """``n`` noisy copies of ten fixed 28x28 patterns, labelled with the pattern's index."""
    patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=generator)
    images = patterns[labels] + 1.5 * torch.randn(n, 1, 28, 28, generator=generator)
    return TensorDataset(images, labels)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()

    mnist_train = synthetic_mnist(512, seed=0)
    mnist_val = synthetic_mnist(128, seed=1)
    train_loader = DataLoader(mnist_train, batch_size=64, shuffle=True)
    val_loader = DataLoader(mnist_val, batch_size=64, shuffle=False)

    lightning_config = (
        LightningConfigBuilder()
        .module(cls=MNISTClassifier, lr=1e-3, feature_dim=128)
        .trainer(max_epochs=args.epochs, accelerator="cpu", logger=False, enable_progress_bar=False)
        .fit_params(train_dataloaders=train_loader, val_dataloaders=val_loader)
        .checkpointing(monitor="ptl/val_accuracy", mode="max", save_top_k=2)
        .build()
    )

    scaling_config = ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1})
    trainer = LightningTrainer(
        lightning_config=lightning_config,
        scaling_config=scaling_config,
        run_config=RunConfig(storage_path=args.storage_path),
    )
    result = trainer.fit()

    print("epochs reported:", [m["epoch"] for m in result.metrics_history])
    print(
        f"val accuracy: first {result.metrics_history[0]['ptl/val_accuracy']:.2f}, "
        f"last {result.metrics['ptl/val_accuracy']:.2f}"
    )
    print("best checkpoints kept:", len(result.best_checkpoints))
    with result.checkpoint.as_directory() as folder:
        model = MNISTClassifier.load_from_checkpoint(os.path.join(folder, "model"))
    print(f"loaded {type(model).__name__} (lr={model.hparams.lr}) from {result.checkpoint.path}")


if __name__ == "__main__":
    main()
