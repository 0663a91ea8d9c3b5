"""Ray 2.6's ``TransformersTrainer`` example (causal language modelling), with ddptrain imports.

Ray's docs train GPT-2 on wikitext-2 (``ray.data.from_huggingface``); here a tiny GPT-2 is
built from a config and trained on synthetic token blocks, so nothing is downloaded. The rest
is Ray's example: ``trainer_init_per_worker`` gets this worker's shards of ``datasets["train"]``
and ``datasets["evaluation"]`` and returns a ``transformers.Trainer``; evaluation, logging and
saving happen every epoch, and each saved checkpoint is reported. Under ``ddptrain run`` the
same script runs with Ray's imports (``from ray.train.huggingface import TransformersTrainer``).

    python examples/transformers_trainer.py --epochs 2
"""

import argparse
import os
import tempfile

import numpy as np
import transformers
from transformers import AutoModelForCausalLM, GPT2Config

import ddptrain.data
from ddptrain import RunConfig, ScalingConfig
from ddptrain.huggingface import TransformersTrainer

# If using GPUs, set this to True.
use_gpu = False
block_size = 16


def synthetic_blocks(rows: int, seed: int) -> np.ndarray:
    """Token blocks that count up from a random start (mod 64): a pattern a tiny model learns."""
    starts = np.random.default_rng(seed).integers(0, 64, size=(rows, 1))
    return (starts + np.arange(block_size)) % 64


def trainer_init_per_worker(train_dataset, eval_dataset, **config):
    model_config = GPT2Config(
        vocab_size=64, n_positions=block_size, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = AutoModelForCausalLM.from_config(model_config)
    args = transformers.TrainingArguments(
        output_dir=config["output_dir"],
        eval_strategy="epoch",  # Ray 2.6's `evaluation_strategy` (renamed in transformers 4.41)
        save_strategy="epoch",
        logging_strategy="epoch",
        num_train_epochs=config["epochs"],
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        learning_rate=5e-3,
        weight_decay=0.01,
        use_cpu=not use_gpu,  # Ray 2.6's `no_cuda` (removed in transformers 5)
        report_to="none",
        disable_tqdm=True,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()

    blocks = synthetic_blocks(128, seed=0)
    ray_train_ds = ddptrain.data.from_numpy({"input_ids": blocks, "labels": blocks})
    held_out = synthetic_blocks(32, seed=1)
    ray_evaluation_ds = ddptrain.data.from_numpy({"input_ids": held_out, "labels": held_out})

    output_dir = tempfile.mkdtemp(prefix="gpt2-synthetic-")
    scaling_config = ScalingConfig(num_workers=2, use_gpu=use_gpu)
    trainer = TransformersTrainer(
        trainer_init_per_worker=trainer_init_per_worker,
        trainer_init_config={"output_dir": output_dir, "epochs": args.epochs},
        scaling_config=scaling_config,
        datasets={"train": ray_train_ds, "evaluation": ray_evaluation_ds},
        run_config=RunConfig(storage_path=args.storage_path),
    )
    result = trainer.fit()

    print("steps reported:", [m["step"] for m in result.metrics_history])
    print(f"eval_loss: first {result.metrics_history[0]['eval_loss']:.3f}, last {result.metrics['eval_loss']:.3f}")
    with result.checkpoint.as_directory() as folder:
        model = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "checkpoint"))
    print(f"loaded {type(model).__name__} from {result.checkpoint.path}")


if __name__ == "__main__":
    main()
