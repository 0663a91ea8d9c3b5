"""An XGBoost binary classifier in an XGBoostTrainer (a port of Ray Train's XGBoost example).

Synthetic data, 2 CPU workers. Each worker builds a ``DMatrix`` from its shard of the train
and validation sets; XGBoost's collective makes the trees from the rows of both workers, and
the validation metrics cover both halves of the validation set. ``RayTrainReportCallback``
reports every round and checkpoints the booster every ``--frequency`` rounds; early stopping
ends training when the validation logloss stops improving. With ``--crash-at N`` rank 1 is
killed after round N of the first attempt (a marker file keeps the restart from crashing
again); ``FailureConfig(max_failures=1)`` restarts the group and training resumes from
``get_checkpoint()``, the round count going on. The final booster is loaded with
``RayTrainReportCallback.get_model(result.checkpoint)``.

    python examples/xgboost_classifier.py
    python examples/xgboost_classifier.py --rounds 60 --crash-at 25
"""

import argparse
import os
import shutil
import signal
import tempfile

import numpy as np
import xgboost

import ddptrain as train
from ddptrain.xgboost import RayTrainReportCallback, XGBoostTrainer

FEATURES = [f"x{i}" for i in range(10)]


def make_data(n: int, seed: int) -> dict:
    """Columns x0..x9 and a label y that depends on a few of them, with some noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(FEATURES))).astype("float32")
    y = (x[:, 0] + x[:, 1] * x[:, 2] + np.sin(2 * x[:, 3]) + 0.3 * rng.normal(size=n) > 0).astype("float32")
    return {**{name: x[:, i] for i, name in enumerate(FEATURES)}, "y": y}


class CrashOnce(xgboost.callback.TrainingCallback):
    """Kills rank 1 after round ``crash_at``, once: the marker file remembers it happened."""

    def __init__(self, crash_at, marker):
        super().__init__()
        self.crash_at, self.marker = crash_at, marker

    def after_iteration(self, model, epoch, evals_log):
        rank = train.get_context().get_world_rank()
        if epoch + 1 == self.crash_at and rank == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            print(f"rank 1: simulating a crash after round {epoch + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return False


def train_func(config):
    # 1. This worker's shards as DMatrix (Ray users call to_pandas() on the materialized shard).
    train_df = train.get_dataset_shard("train").materialize().to_pandas()
    valid_df = train.get_dataset_shard("valid").materialize().to_pandas()
    dtrain = xgboost.DMatrix(train_df[FEATURES], label=train_df["y"])
    dvalid = xgboost.DMatrix(valid_df[FEATURES], label=valid_df["y"])

    # 2. Resume: after a restart, get_checkpoint() holds the booster of the last checkpoint.
    booster = None
    checkpoint = train.get_checkpoint()
    if checkpoint:
        booster = RayTrainReportCallback.get_model(checkpoint)
    done = booster.num_boosted_rounds() if booster is not None else 0
    if train.get_context().get_world_rank() == 0:
        print(f"attempt starts at round {done}, {len(train_df)} training rows on this worker", flush=True)

    # 3. Plain xgboost.train: the XGBoostTrainer made it distributed.
    xgboost.train(
        config["params"],
        dtrain,
        num_boost_round=config["rounds"] - done,
        evals=[(dvalid, "valid")],
        early_stopping_rounds=config["early_stopping_rounds"],
        xgb_model=booster,
        verbose_eval=False,
        callbacks=[
            RayTrainReportCallback(frequency=config["frequency"]),
            CrashOnce(config["crash_at"], config["marker"]),
        ],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--frequency", type=int, default=10, help="checkpoint every N rounds")
    parser.add_argument("--crash-at", type=int, default=None, help="kill rank 1 after round N, once")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()

    params = {
        "objective": "binary:logistic",
        "tree_method": "hist",
        "eval_metric": ["error", "logloss"],  # early stopping watches the last one
        "max_depth": 4,
        "eta": 0.1,
    }
    marker_dir = tempfile.mkdtemp(prefix="xgboost-example-")
    marker = os.path.join(marker_dir, "crashed")
    trainer = XGBoostTrainer(
        train_func,
        train_loop_config={
            "params": params,
            "rounds": args.rounds,
            "frequency": args.frequency,
            "early_stopping_rounds": 10,
            "crash_at": args.crash_at,
            "marker": marker,
        },
        datasets={
            "train": train.data.from_numpy(make_data(8000, 0)),
            "valid": train.data.from_numpy(make_data(2000, 1)),  # split too: XGBoost combines the metrics
        },
        scaling_config=train.ScalingConfig(num_workers=args.num_workers),
        run_config=train.RunConfig(
            storage_path=args.storage_path,
            checkpoint_config=train.CheckpointConfig(num_to_keep=2),
            failure_config=train.FailureConfig(max_failures=1),
        ),
    )
    try:
        result = trainer.fit()
    finally:
        shutil.rmtree(marker_dir, ignore_errors=True)
    print("final metrics:", {k: round(v, 4) for k, v in result.metrics.items()})

    # The final model, on the driver: check the reported logloss on the whole validation set.
    booster = RayTrainReportCallback.get_model(result.checkpoint)
    valid = make_data(2000, 1)
    dvalid = xgboost.DMatrix(np.column_stack([valid[f] for f in FEATURES]), label=valid["y"], feature_names=FEATURES)
    p = np.clip(booster.predict(dvalid), 1e-7, 1 - 1e-7)
    logloss = float(-np.mean(valid["y"] * np.log(p) + (1 - valid["y"]) * np.log(1 - p)))
    accuracy = float(np.mean((p > 0.5) == valid["y"]))
    print(
        f"loaded a booster of {booster.num_boosted_rounds()} rounds from {result.checkpoint.path}: "
        f"validation logloss {logloss:.4f}, accuracy {accuracy:.3f}"
    )


if __name__ == "__main__":
    main()
