"""A PyTorch Lightning classifier in a TorchTrainer (a port of Ray Train's Lightning example).

Lightning runs inside each worker with ddptrain's strategy, cluster environment and report
callback; ``prepare_trainer`` checks the setup. Each epoch's metrics and checkpoint
(``checkpoint.ckpt``) are reported. With ``--crash-at N`` rank 1 is killed at epoch N of the
first attempt; ``FailureConfig(max_failures=1)`` restarts the group, and Lightning resumes from
``get_checkpoint()`` and continues the epoch count. The same script runs on the standalone
``pytorch_lightning`` package with ``--package pytorch_lightning``.

    python examples/lightning_classifier.py --epochs 3 --crash-at 1
    python examples/lightning_classifier.py --package pytorch_lightning
"""

import argparse
import importlib
import os
import signal
import sys

import torch

import ddptrain as train
from ddptrain.torch import TorchTrainer

# The Lightning package is picked on the command line here; a user script just imports one.
_PACKAGE = "pytorch_lightning" if "pytorch_lightning" in sys.argv else "lightning.pytorch"
pl = importlib.import_module(_PACKAGE)

from ddptrain.lightning import (  # noqa: E402
    RayDDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    prepare_trainer,
)


class Classifier(pl.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.5):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        accuracy = (self(x).argmax(dim=1) == y).float().mean()
        self.log("val_accuracy", accuracy, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def make_data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """Three classes, told apart by which of the first three features is largest."""
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(x, x[:, :3].argmax(dim=1))


class CrashOnce(pl.Callback):
    """Says where each attempt starts; kills rank 1 at epoch ``crash_at`` of the first attempt."""

    def __init__(self, crash_at):
        self.crash_at = crash_at
        self.first_attempt = train.get_checkpoint() is None

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            print(f"attempt starts at epoch {trainer.current_epoch}", flush=True)

    def on_train_epoch_start(self, trainer, pl_module):
        if self.first_attempt and trainer.current_epoch == self.crash_at and trainer.global_rank == 1:
            print("rank 1: simulating a crash", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def train_func(config):
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(make_data(512, 0), batch_size=32, shuffle=True)
    val_loader = torch.utils.data.DataLoader(make_data(128, 1), batch_size=64)
    callbacks = [RayTrainReportCallback(), CrashOnce(config["crash_at"])]
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        devices="auto",
        accelerator="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,  # RayTrainReportCallback checkpoints
        logger=False,
    )
    trainer = prepare_trainer(trainer)

    # Resume where the run stopped: after a restart, get_checkpoint() is the latest checkpoint.
    checkpoint = train.get_checkpoint()
    ckpt_path = None
    if checkpoint:
        ckpt_path = os.path.join(checkpoint.path, RayTrainReportCallback.CHECKPOINT_NAME)
    trainer.fit(Classifier(), train_dataloaders=loader, val_dataloaders=val_loader, ckpt_path=ckpt_path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", choices=["lightning", "pytorch_lightning"], default="lightning")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()

    trainer = TorchTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "crash_at": args.crash_at},
        scaling_config=train.ScalingConfig(num_workers=args.num_workers, use_gpu=False),
        run_config=train.RunConfig(
            storage_path=args.storage_path,
            failure_config=train.FailureConfig(max_failures=1),
        ),
    )
    result = trainer.fit()
    print("epochs reported:", [m["epoch"] for m in result.metrics_history])
    print("final metrics:", {k: round(v, 3) if isinstance(v, float) else v for k, v in result.metrics.items()})

    # Load the model the Lightning way from the run's last checkpoint.
    with result.checkpoint.as_directory() as d:
        model = Classifier.load_from_checkpoint(os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME))
    x, y = make_data(128, 1).tensors
    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    print(f"loaded {type(model).__name__} ({_PACKAGE}) from {result.checkpoint.path}: accuracy {accuracy:.2f}")


if __name__ == "__main__":
    main()
