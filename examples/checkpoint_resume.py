"""Checkpoints, a crash survived with FailureConfig, and resuming a run by its name.

Every epoch, each worker saves its state and reports it; rank 0's metrics and the merged
checkpoint are persisted under the run directory. On the first run, rank 1 is killed with
SIGKILL at ``--crash-at``; ``FailureConfig(max_failures=1)`` restarts the group from the latest
checkpoint. Run the script again with the same ``--name`` and a larger ``--epochs``: it
resumes from the last committed checkpoint and says so.

    python examples/checkpoint_resume.py --name demo --epochs 4 --crash-at 2
    python examples/checkpoint_resume.py --name demo --epochs 6
"""

import argparse
import os
import signal
import tempfile

import torch

import ddptrain as train
from ddptrain.torch import TorchTrainer, prepare_model


def train_func(config):
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start_epoch = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    model = prepare_model(model)
    rank = train.get_context().get_world_rank()
    if rank == 0:
        print(f"starting at epoch {start_epoch}")

    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(256, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    for epoch in range(start_epoch, config["epochs"]):
        crash_marker = os.path.join(config["storage"], f".{config['name']}_crashed")
        if epoch == config["crash_at"] and rank == 1 and not os.path.exists(crash_marker):
            open(crash_marker, "w").close()
            print("rank 1: simulating a crash", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:  # one copy of the model is enough
                torch.save(
                    {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                    os.path.join(d, "state.pt"),
                )
            train.report(
                {"epoch": epoch, "loss": loss.item()},
                checkpoint=train.Checkpoint.from_directory(d) if rank == 0 else None,
            )
    return start_epoch


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="checkpoint_resume_demo")
    parser.add_argument("--storage-path", default=os.path.expanduser("~/ddptrain_results"))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--crash-at", type=int, default=-1)
    args = parser.parse_args()

    trainer = TorchTrainer(
        train_func,
        train_loop_config={
            "epochs": args.epochs,
            "crash_at": args.crash_at,
            "storage": args.storage_path,
            "name": args.name,
        },
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(
            name=args.name,
            storage_path=args.storage_path,
            failure_config=train.FailureConfig(max_failures=1),
            checkpoint_config=train.CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min"
            ),
        ),
    )
    result = trainer.fit()
    print(f"last attempt started at epoch {result.return_value}")
    print(f"final metrics: {result.metrics}")
    print(f"latest checkpoint: {result.checkpoint.path}")
    print(f"best checkpoint by loss: {result.get_best_checkpoint('loss', 'min').path}")


if __name__ == "__main__":
    main()
