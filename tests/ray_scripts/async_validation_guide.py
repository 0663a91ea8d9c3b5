"""Ray Train's guide "Validating checkpoints asynchronously" (its report() form with
``validate_fn=``/``validate_config=``), as written there; only its ``...`` placeholders are
filled in (a tiny model, a small in-memory dataset instead of read_parquet, two epochs, CPU
workers) and ``len(dataset)`` is ``dataset.count()`` (a Ray Dataset has no ``len``)."""

import os
import tempfile

import numpy as np
import torch

import ray.data
import ray.train
import ray.train.torch


def new_model():
    return torch.nn.Linear(4, 2)


def validate_fn(checkpoint: ray.train.Checkpoint, config: dict) -> dict:
    # Load the checkpoint
    model = new_model()
    with checkpoint.as_directory() as checkpoint_dir:
        model_state_dict = torch.load(os.path.join(checkpoint_dir, "model.pt"))
        model.load_state_dict(model_state_dict)
    model.eval()

    # Perform validation on the data
    total_accuracy = 0
    dataset = config["dataset"]
    with torch.no_grad():
        for batch in dataset.iter_torch_batches(batch_size=128):
            images, labels = batch["image"], batch["label"]
            outputs = model(images)
            total_accuracy += (outputs.argmax(1) == labels).sum().item()
    return {"score": total_accuracy / dataset.count()}


def train_func(config: dict) -> None:
    epochs = range(2)
    model = ray.train.torch.prepare_model(new_model())
    rank = ray.train.get_context().get_world_rank()
    for epoch in epochs:
        # training step
        if rank == 0:
            training_metrics = {"loss": 1.0 / (epoch + 1), "epoch": epoch}
            local_checkpoint_dir = tempfile.mkdtemp()
            torch.save(
                model.module.state_dict(),
                os.path.join(local_checkpoint_dir, "model.pt"),
            )
            ray.train.report(
                training_metrics,
                checkpoint=ray.train.Checkpoint.from_directory(local_checkpoint_dir),
                checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                validate_fn=validate_fn,
                validate_config={
                    "dataset": config["validation_dataset"],
                    "train_run_name": ray.train.get_context().get_experiment_name(),
                    "epoch": epoch,
                },
            )
        else:
            ray.train.report({}, None)


def run_trainer() -> ray.train.Result:
    rows = [{"image": np.array([i % 3, 1, 0, i % 2], dtype=np.float32), "label": i % 2} for i in range(64)]
    train_dataset = ray.data.from_items(rows)
    validation_dataset = ray.data.from_items(rows)
    trainer = ray.train.torch.TorchTrainer(
        train_func,
        # Pass training dataset in datasets arg to split it across training workers
        datasets={"train": train_dataset},
        # Pass validation dataset in train_loop_config so validate_fn can choose how to use it later
        train_loop_config={"validation_dataset": validation_dataset},
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
    )
    return trainer.fit()


if __name__ == "__main__":
    result = run_trainer()
    print("best checkpoints:", [(os.path.basename(c.path), sorted(m)) for c, m in result.best_checkpoints])
