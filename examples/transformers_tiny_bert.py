"""Hugging Face Transformers in a TorchTrainer (a port of Ray Train's Transformers example).

A tiny BERT classifier is built from a config (nothing is downloaded) and trained by the HF
``Trainer`` on synthetic token ids. The data reaches each worker as its shard of a ddptrain
dataset (``get_dataset_shard``), which ``prepare_trainer`` lets the ``Trainer`` read without
splitting it again. ``RayTrainReportCallback`` reports each saved checkpoint; after a restart
(``--crash-at-step``) training resumes from ``get_checkpoint()`` and continues the step count.

    python examples/transformers_tiny_bert.py
    python examples/transformers_tiny_bert.py --crash-at-step 5
"""

import argparse
import os
import signal
import tempfile

import numpy as np
import torch
import transformers

import ddptrain as train
from ddptrain.huggingface.transformers import RayTrainReportCallback, prepare_trainer
from ddptrain.torch import TorchTrainer

SEQUENCE_LENGTH = 16


def make_dataset(rows: int, seed: int) -> train.data.Dataset:
    """Token ids; the label says whether token 7 appears in the sequence."""
    ids = np.random.default_rng(seed).integers(5, 64, size=(rows, SEQUENCE_LENGTH))
    ids[: rows // 2, 3] = 7
    ids[rows // 2 :][ids[rows // 2 :] == 7] = 8
    labels = (ids == 7).any(axis=1).astype(np.int64)
    return train.data.from_numpy({"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels})


def compute_metrics(prediction):
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


class CrashOnce(transformers.TrainerCallback):
    """Kills rank 1 at step ``crash_at`` of the first attempt."""

    def __init__(self, crash_at):
        self.crash_at = crash_at
        self.first_attempt = train.get_checkpoint() is None

    def on_train_begin(self, args, state, control, **kwargs):
        if args.process_index == 0:
            print(f"attempt starts at step {state.global_step}", flush=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_attempt and state.global_step == self.crash_at and args.process_index == 1:
            print("rank 1: simulating a crash", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def train_func(config):
    model_config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQUENCE_LENGTH,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(model_config)
    train_shard = train.get_dataset_shard("train")
    batch_size = 16
    steps_per_epoch = -(-train_shard.count() // batch_size)
    args = transformers.TrainingArguments(
        output_dir=config["output_dir"],
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=64,
        max_steps=steps_per_epoch * config["epochs"],  # the Trainer needs it for a dataset shard
        eval_strategy="epoch",
        save_strategy="epoch",  # a checkpoint, and so a report, per epoch
        logging_strategy="epoch",
        learning_rate=5e-3,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=train_shard,
        eval_dataset=train.get_dataset_shard("validation"),
        compute_metrics=compute_metrics,
        callbacks=[RayTrainReportCallback(), CrashOnce(config["crash_at_step"])],
    )
    trainer = prepare_trainer(trainer)

    checkpoint = train.get_checkpoint()
    resume = os.path.join(checkpoint.path, RayTrainReportCallback.CHECKPOINT_NAME) if checkpoint else None
    trainer.train(resume_from_checkpoint=resume)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as output_dir:
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"epochs": args.epochs, "crash_at_step": args.crash_at_step, "output_dir": output_dir},
            datasets={"train": make_dataset(256, 0), "validation": make_dataset(64, 1)},
            scaling_config=train.ScalingConfig(num_workers=args.num_workers, use_gpu=False),
            run_config=train.RunConfig(
                storage_path=args.storage_path,
                failure_config=train.FailureConfig(max_failures=1),
            ),
        )
        result = trainer.fit()
    print("steps reported:", [m["step"] for m in result.metrics_history])
    print("final eval accuracy:", round(result.metrics["eval_accuracy"], 3))

    # Load the model the Hugging Face way from the run's last checkpoint.
    with result.checkpoint.as_directory() as d:
        model = transformers.BertForSequenceClassification.from_pretrained(
            os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME)
        )
    batch = next(iter(make_dataset(64, 1).iter_torch_batches(batch_size=64)))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    accuracy = (logits.argmax(-1) == batch["labels"]).float().mean().item()
    print(f"loaded {type(model).__name__} from {result.checkpoint.path}: accuracy {accuracy:.2f}")


if __name__ == "__main__":
    main()
