"""Weights & Biases tracking from a ddptrain run, as in Ray Train's "Using experiment tracking" guide.

Only rank 0 logs: ``setup_wandb`` gives the other ranks an object that ignores every call. Runs
offline unless you say otherwise (no account needed); ``wandb sync`` uploads the run later.

    pip install ddptrain[wandb]
    WANDB_MODE=offline python examples/tracking_wandb.py
"""

import argparse
import os

import torch

import ddptrain as train  # was: import ray.train
import ddptrain.torch  # was: import ray.train.torch
from ddptrain.integrations.wandb import setup_wandb  # was: from ray.air.integrations.wandb ...


def train_func(config):
    run = setup_wandb(config, project="ddptrain-examples")
    torch.manual_seed(0)
    model = ddptrain.torch.prepare_model(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    generator = torch.Generator().manual_seed(train.get_context().get_world_rank())
    x = torch.randn(256, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    for epoch in range(config["epochs"]):
        for batch in range(0, len(x), 32):
            loss = torch.nn.functional.mse_loss(model(x[batch : batch + 32]), y[batch : batch + 32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        run.log({"loss": loss.item(), "epoch": epoch})  # does nothing on rank 1
        train.report({"loss": loss.item(), "epoch": epoch})
    run.finish()  # a worker leaves without exit handlers: finish the run here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")  # workers inherit it

    result = ddptrain.torch.TorchTrainer(
        train_func,
        train_loop_config={"lr": 0.05, "epochs": args.epochs},
        scaling_config=train.ScalingConfig(num_workers=args.num_workers),
        run_config=train.RunConfig(storage_path=args.storage_path),
    ).fit()
    print(f"final metrics: {result.metrics}")
    print(f"W&B files: {os.path.join(os.environ.get('WANDB_DIR', '.'), 'wandb')}")


if __name__ == "__main__":
    main()
