"""Writes ``run_3821c3e/``: run with the ddptrain of commit 3821c3e on ``PYTHONPATH`` (README.md here)."""

import os
import shutil
import sys

import ddptrain as train
from ddptrain.torch import TorchTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compat_train import train_func  # noqa: E402

if __name__ == "__main__":
    storage = sys.argv[1]
    shutil.rmtree(os.path.join(storage, "run_3821c3e"), ignore_errors=True)
    print("ddptrain from", train.__file__)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"epochs": 4, "fail_after": 2},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(
            name="run_3821c3e",
            storage_path=storage,
            checkpoint_config=train.CheckpointConfig(num_to_keep=2),
            failure_config=train.FailureConfig(max_failures=0),
        ),
    )
    try:
        trainer.fit()
    except train.TrainingFailedError as exc:
        print("failed as intended:", str(exc).splitlines()[0])
    else:
        raise SystemExit("the run should have failed after 2 epochs")
