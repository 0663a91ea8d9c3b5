"""The training function of the saved run in ``run_3821c3e/`` (see README.md here).

It lives in a module, not in the script that made the run, so that ``trainer.pkl`` refers to it
by name: the pickle then loads on any Python version, not only the one that wrote it.
"""

from __future__ import annotations

import os
import tempfile

import torch

import ddptrain as train


def train_func(config: dict) -> None:
    """A tiny linear model, one report with a checkpoint per epoch. A run that starts without a
    checkpoint fails after ``fail_after`` epochs (so the saved run was interrupted); one that
    resumes goes on to ``epochs``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "model.pt"))
        model.load_state_dict(state["model"])
        start = state["epoch"] + 1
    rank = train.get_context().get_world_rank()
    for epoch in range(start, config["epochs"]):
        with torch.no_grad():
            model.weight += 0.5
        loss = float(model.weight.detach().sum())
        with tempfile.TemporaryDirectory() as folder:
            if rank == 0:
                torch.save({"model": model.state_dict(), "epoch": epoch}, os.path.join(folder, "model.pt"))
            train.report(
                {"epoch": epoch, "loss": loss, "resumed": checkpoint is not None},
                checkpoint=train.Checkpoint.from_directory(folder) if rank == 0 else None,
            )
        if checkpoint is None and epoch + 1 == config["fail_after"]:
            raise RuntimeError("interrupted on purpose: the saved run is one to resume")
