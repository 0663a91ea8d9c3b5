"""A LightGBM binary classifier in a LightGBMTrainer (a port of Ray Train's LightGBM example).

Synthetic data, 2 CPU workers. Each worker builds a ``lightgbm.Dataset`` from its half of the
training rows; ``get_network_params()`` connects the workers so the trees are built from
both halves. LightGBM does not combine evaluation metrics across workers, so the validation
set is not split (``DataConfig(datasets_to_split=["train"])``): every worker evaluates all of
it, the metrics reported cover it, and early stopping ends every worker at the same round.
``RayTrainReportCallback`` reports every round and checkpoints the booster every
``--frequency`` rounds (keep it at most the early-stopping patience, so the last checkpoint
holds the best round). With ``--crash-at N`` rank 1 is killed after round N of the first
attempt (a marker file keeps the restart from crashing again); ``FailureConfig(max_failures=1)``
restarts the group and training resumes from ``get_checkpoint()``, the round count going on.
The final booster is loaded with ``RayTrainReportCallback.get_model(result.checkpoint)``.

    python examples/lightgbm_classifier.py
    python examples/lightgbm_classifier.py --rounds 100 --crash-at 23
"""

import argparse
import os
import shutil
import signal
import tempfile

import lightgbm
import numpy as np

import ddptrain as train
from ddptrain.lightgbm import LightGBMTrainer, RayTrainReportCallback, get_network_params

FEATURES = [f"x{i}" for i in range(10)]


def make_data(n: int, seed: int) -> dict:
    """Columns x0..x9 and a label y that depends on a few of them, with some noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(FEATURES))).astype("float32")
    y = (x[:, 0] + x[:, 1] * x[:, 2] + np.sin(2 * x[:, 3]) + 0.3 * rng.normal(size=n) > 0).astype("float32")
    return {**{name: x[:, i] for i, name in enumerate(FEATURES)}, "y": y}


def crash_once(crash_at, marker):
    """A LightGBM callback that kills rank 1 after round ``crash_at``, once (the marker file
    remembers it happened)."""

    def callback(env):
        rank = train.get_context().get_world_rank()
        if env.iteration + 1 == crash_at and rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            print(f"rank 1: simulating a crash after round {env.iteration + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return callback


def train_func(config):
    # 1. This worker's rows of the training set, and the whole validation set.
    train_df = train.get_dataset_shard("train").materialize().to_pandas()
    valid_df = train.get_dataset_shard("valid").materialize().to_pandas()
    train_set = lightgbm.Dataset(train_df[FEATURES], label=train_df["y"])
    valid_set = lightgbm.Dataset(valid_df[FEATURES], label=valid_df["y"], reference=train_set)

    # 2. Resume: after a restart, get_checkpoint() holds the booster of the last checkpoint.
    booster = None
    checkpoint = train.get_checkpoint()
    if checkpoint:
        booster = RayTrainReportCallback.get_model(checkpoint)
    done = booster.current_iteration() if booster is not None else 0
    if train.get_context().get_world_rank() == 0:
        print(f"attempt starts at round {done}, {len(train_df)} training rows on this worker", flush=True)

    # 3. lightgbm.train with the network parameters added: the only change for distribution.
    lightgbm.train(
        {**config["params"], **get_network_params()},
        train_set,
        num_boost_round=config["rounds"] - done,
        valid_sets=[valid_set],
        valid_names=["valid"],
        init_model=booster,
        callbacks=[
            RayTrainReportCallback(frequency=config["frequency"]),
            lightgbm.early_stopping(config["early_stopping_rounds"], verbose=False),
            crash_once(config["crash_at"], config["marker"]),
        ],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--frequency", type=int, default=5, help="checkpoint every N rounds")
    parser.add_argument("--crash-at", type=int, default=None, help="kill rank 1 after round N, once")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()

    params = {
        "objective": "binary",
        "metric": ["binary_logloss", "binary_error"],
        "first_metric_only": True,  # early stopping watches the logloss
        "num_leaves": 31,
        "learning_rate": 0.05,
        "min_data_in_leaf": 50,
        "verbose": -1,
    }
    marker_dir = tempfile.mkdtemp(prefix="lightgbm-example-")
    marker = os.path.join(marker_dir, "crashed")
    trainer = LightGBMTrainer(
        train_func,
        train_loop_config={
            "params": params,
            "rounds": args.rounds,
            "frequency": args.frequency,
            "early_stopping_rounds": 20,
            "crash_at": args.crash_at,
            "marker": marker,
        },
        datasets={
            "train": train.data.from_numpy(make_data(8000, 0)),
            "valid": train.data.from_numpy(make_data(2000, 1)),
        },
        # LightGBM evaluates each worker's own rows only: every worker gets all validation rows.
        dataset_config=train.DataConfig(datasets_to_split=["train"]),
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

    # The model of the last checkpoint, on the driver.
    booster = RayTrainReportCallback.get_model(result.checkpoint)
    valid = make_data(2000, 1)
    p = np.clip(booster.predict(np.column_stack([valid[f] for f in FEATURES])), 1e-7, 1 - 1e-7)
    logloss = float(-np.mean(valid["y"] * np.log(p) + (1 - valid["y"]) * np.log(1 - p)))
    accuracy = float(np.mean((p > 0.5) == valid["y"]))
    print(
        f"loaded a booster of {booster.current_iteration()} rounds from {result.checkpoint.path}: "
        f"validation logloss {logloss:.4f}, accuracy {accuracy:.3f}"
    )


if __name__ == "__main__":
    main()
