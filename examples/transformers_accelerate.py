"""Hugging Face Accelerate in a TorchTrainer: plain ``Accelerator()``, no wrapper.

``Accelerator()`` finds the worker group from the torchrun variables every worker has. Each
epoch ``accelerator.save_state`` writes the model and optimizer (rank 0) and every rank's
random state into a folder that every rank reports: ddptrain merges them into one
checkpoint, which ``accelerator.load_state`` reads back after a restart (``--crash-at``).

    python examples/transformers_accelerate.py
    python examples/transformers_accelerate.py --crash-at 1
"""

import argparse
import json
import os
import signal
import tempfile

import torch
from accelerate import Accelerator

import ddptrain as train
from ddptrain.torch import TorchTrainer


def train_func(config):
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # DDP + a sharded loader

    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        accelerator.load_state(checkpoint.path)
        with open(os.path.join(checkpoint.path, "progress.json")) as f:
            start = json.load(f)["epoch"] + 1
    accelerator.print(
        f"{accelerator.num_processes} processes ({accelerator.distributed_type}); starting at epoch {start}"
    )

    for epoch in range(start, config["epochs"]):
        if epoch == config["crash_at"] and checkpoint is None and accelerator.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
        with tempfile.TemporaryDirectory() as d:
            accelerator.save_state(d)  # every rank writes its random state; rank 0 the rest
            if accelerator.is_main_process:
                with open(os.path.join(d, "progress.json"), "w") as f:
                    json.dump({"epoch": epoch}, f)
            train.report({"epoch": epoch, "loss": loss.item()}, checkpoint=train.Checkpoint.from_directory(d))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()

    result = TorchTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "crash_at": args.crash_at},
        scaling_config=train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=train.RunConfig(storage_path=args.storage_path, failure_config=train.FailureConfig(max_failures=1)),
    ).fit()
    print("epochs reported:", [m["epoch"] for m in result.metrics_history])
    print("final loss:", round(result.metrics["loss"], 4))
    print("checkpoint files:", sorted(os.listdir(result.checkpoint.path)))


if __name__ == "__main__":
    main()
