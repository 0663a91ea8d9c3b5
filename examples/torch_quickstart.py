"""The PyTorch quickstart of the Ray Train docs, on ddptrain.

Compared with the Ray version only the imports changed, plus a small synthetic dataset
and model instead of FashionMNIST and ResNet-18 (no downloads).

    python examples/torch_quickstart.py --num-workers 2 --epochs 3
"""

import argparse
import os
import tempfile

import torch
from torch.nn import CrossEntropyLoss
from torch.optim import Adam
from torch.utils.data import DataLoader, TensorDataset

import ddptrain as train  # was: import ray.train
import ddptrain.torch  # was: import ray.train.torch


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(28 * 28, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )


def make_data(num_samples: int = 2048) -> TensorDataset:
    """A stand-in for FashionMNIST: 28x28 images whose label is encoded in their pixels."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (num_samples,), generator=generator)
    images = torch.randn(num_samples, 1, 28, 28, generator=generator) * 0.5
    images[torch.arange(num_samples), 0, labels, :] += 2.0
    return TensorDataset(images, labels)


def train_func(config):
    # Model, loss, optimizer
    model = make_model()
    # [1] Prepare model.
    model = ddptrain.torch.prepare_model(model)
    criterion = CrossEntropyLoss()
    optimizer = Adam(model.parameters(), lr=0.001)

    # Data
    train_loader = DataLoader(make_data(), batch_size=128, shuffle=True)
    # [2] Prepare dataloader.
    train_loader = ddptrain.torch.prepare_data_loader(train_loader)

    # Training
    for epoch in range(config["epochs"]):
        if train.get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)

        for images, labels in train_loader:
            outputs = model(images)
            loss = criterion(outputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        # [3] Report metrics and checkpoint.
        metrics = {"loss": loss.item(), "epoch": epoch}
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            state = model.module.state_dict() if hasattr(model, "module") else model.state_dict()
            torch.save(state, os.path.join(temp_checkpoint_dir, "model.pt"))
            train.report(metrics, checkpoint=train.Checkpoint.from_directory(temp_checkpoint_dir))
        if train.get_context().get_world_rank() == 0:
            print(metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()

    # [4] Configure scaling and resource requirements.
    scaling_config = train.ScalingConfig(num_workers=args.num_workers, use_gpu=False)

    # [5] Launch distributed training job.
    trainer = ddptrain.torch.TorchTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs},
        scaling_config=scaling_config,
        run_config=train.RunConfig(storage_path=args.storage_path),
    )
    result = trainer.fit()
    print(f"final metrics: {result.metrics}")
    print(f"run directory: {result.path}")

    # [6] Load the trained model.
    with result.checkpoint.as_directory() as checkpoint_dir:
        model_state_dict = torch.load(os.path.join(checkpoint_dir, "model.pt"))
        model = make_model()
        model.load_state_dict(model_state_dict)
    images, labels = make_data(512)[:]
    accuracy = (model(images).argmax(1) == labels).float().mean().item()
    print(f"loaded the checkpoint from {result.checkpoint.path}; accuracy {accuracy:.2f}")


if __name__ == "__main__":
    main()
