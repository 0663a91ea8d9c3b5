"""Datasets and ``get_dataset_shard``: the Ray Train docs examples, on ddptrain.

1. ``DataParallelTrainer`` with a dataset split across workers (Ray's DataParallelTrainer
   docs): three items, three workers, one item each.
2. ``TorchTrainer`` with ``datasets={"train": train_ds, "valid": valid_ds}`` and
   ``get_dataset_shard("train").iter_torch_batches(batch_size=64)`` in the training loop
   (Ray's Trainer overview). Here "valid" is not split, so every worker evaluates all of it.

    python examples/dataset_shard.py [--num-workers 2] [--epochs 3]
"""

import argparse

import numpy as np
import torch

import ddptrain as train  # was: from ray import train
import ddptrain.data  # was: import ray.data
import ddptrain.torch  # was: import ray.train.torch
from ddptrain import DataConfig, ScalingConfig  # was: from ray.train import ...
from ddptrain.data_parallel_trainer import DataParallelTrainer  # was: ray.train.data_parallel_trainer
from ddptrain.torch import TorchTrainer  # was: from ray.train.torch import TorchTrainer


# 1. The DataParallelTrainer docs example --------------------------------------------------
def train_loop_for_worker():
    dataset_shard_for_this_worker = train.get_dataset_shard("train")

    # 3 items for 3 workers, each worker gets 1 item
    batches = list(dataset_shard_for_this_worker.iter_batches(batch_size=1))
    assert len(batches) == 1
    return int(batches[0]["item"][0])


# 2. iter_torch_batches in a TorchTrainer loop -------------------------------------------------
def make_data(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    y = x @ np.arange(1, 9, dtype=np.float32) / 8 + rng.normal(scale=0.1, size=rows).astype(np.float32)
    return ddptrain.data.from_numpy({"x": x, "y": y})  # was: ray.data.from_numpy / from_items


def train_loop_per_worker(config):
    model = train.torch.prepare_model(torch.nn.Linear(8, 1))  # was: ray.train.torch.prepare_model
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    train_shard = train.get_dataset_shard("train")
    valid_shard = train.get_dataset_shard("valid")
    for epoch in range(config["epochs"]):
        for batch in train_shard.iter_torch_batches(
            batch_size=64, local_shuffle_buffer_size=1_000, local_shuffle_seed=epoch
        ):
            loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            sizes_and_losses = [
                (len(b["y"]), torch.nn.functional.mse_loss(model(b["x"]).squeeze(1), b["y"]).item())
                for b in valid_shard.iter_torch_batches(batch_size=256)
            ]
        valid_loss = sum(n * loss for n, loss in sizes_and_losses) / valid_shard.count()
        train.report({"epoch": epoch, "train_loss": loss.item(), "valid_loss": valid_loss})
    return train_shard.count()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    train_dataset = ddptrain.data.from_items([1, 2, 3])  # was: ray.data.from_items
    assert train_dataset.count() == 3
    trainer = DataParallelTrainer(
        train_loop_for_worker,
        scaling_config=ScalingConfig(num_workers=3),
        datasets={"train": train_dataset},
    )
    result = trainer.fit()
    print("each worker's item:", result.return_values)

    train_ds, valid_ds = make_data(4_000, seed=0), make_data(1_000, seed=1)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"lr": 0.05, "epochs": args.epochs},
        scaling_config=ScalingConfig(num_workers=args.num_workers),
        datasets={"train": train_ds, "valid": valid_ds},
        dataset_config=DataConfig(datasets_to_split=["train"]),  # "valid" goes whole to every worker
    )
    result = trainer.fit()
    print("rows of 'train' per worker:", result.return_values)
    for metrics in result.metrics_history:
        print(
            f"epoch {metrics['epoch']}: train loss {metrics['train_loss']:.4f}, valid loss {metrics['valid_loss']:.4f}"
        )
