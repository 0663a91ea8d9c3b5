"""A Keras MLP in a TensorflowTrainer (a port of Ray Train's TensorFlow/Keras example).

Two CPU workers train one model with ``tf.distribute.MultiWorkerMirroredStrategy``; each reads
its half of a ddptrain dataset through ``get_dataset_shard("train").to_tf(...)``.
``ReportCheckpointCallback`` reports Keras' metrics and a checkpoint (``model.keras``) after
every epoch. With ``--crash-at N`` rank 1 is killed as epoch N of the first attempt begins;
``FailureConfig(max_failures=1)`` restarts the group, which resumes from ``get_checkpoint()``
and continues the epoch count. The driver then loads the final model from
``result.checkpoint``.

TensorFlow is imported inside the functions: the driver only needs it to load the model at
the end, and a training function that refers to no TensorFlow object at the top of the script
lets each worker import TensorFlow once, after ddptrain selected tf-keras
(``TF_USE_LEGACY_KERAS=1``) for it.

    pip install ddptrain[tensorflow]
    python examples/tensorflow_keras.py --epochs 4 --crash-at 2
"""

import argparse
import hashlib
import math
import os
import signal

import numpy as np

import ddptrain as train
from ddptrain.tensorflow import TensorflowCheckpoint, TensorflowTrainer

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up notices (the workers inherit it)

FEATURES = 8
BATCH_SIZE = 32


def make_data(n: int, seed: int) -> dict:
    """Two classes: is a fixed linear function of the features positive?"""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    w = np.linspace(-1.0, 1.0, FEATURES, dtype="float32")
    return {"x": x, "y": (x @ w > 0).astype("float32")}


def build_model(tf):
    model = tf.keras.Sequential(
        [
            tf.keras.Input(shape=(FEATURES,)),
            tf.keras.layers.Dense(16, activation="relu"),
            tf.keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=["accuracy"])
    return model


def train_func(config):
    import tensorflow as tf

    from ddptrain.tensorflow.keras import ReportCheckpointCallback

    rank = train.get_context().get_world_rank()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG, set by ddptrain
    shard = train.get_dataset_shard("train")
    # Keras splits each batch among the replicas of all workers: BATCH_SIZE is the global batch.
    steps_per_epoch = math.ceil(shard.count() / (BATCH_SIZE // strategy.num_replicas_in_sync))

    # Resume where the run stopped: after a restart, get_checkpoint() is the latest checkpoint,
    # a saved model with its optimizer state, whose step count gives the epoch reached.
    checkpoint = train.get_checkpoint()
    with strategy.scope():
        if checkpoint:
            model = TensorflowCheckpoint.from_directory(checkpoint.path).get_model()
        else:
            model = build_model(tf)
    steps_done = int(model.optimizer.iterations.numpy())
    first_epoch = steps_done // steps_per_epoch
    if rank == 0:
        print(f"attempt starts at epoch {first_epoch} (optimizer step {steps_done})", flush=True)
    first_attempt = checkpoint is None

    def on_epoch_begin(epoch, logs):
        if first_attempt and epoch == config["crash_at"] and rank == 1:
            print("rank 1: simulating a crash", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    data = shard.to_tf(feature_columns="x", label_columns="y", batch_size=BATCH_SIZE)
    model.fit(
        data,
        initial_epoch=first_epoch,
        epochs=config["epochs"],
        verbose=0,
        callbacks=[
            # Adds the epoch to Keras' logs, which the next callback reports (loss, accuracy, epoch).
            tf.keras.callbacks.LambdaCallback(
                on_epoch_begin=on_epoch_begin, on_epoch_end=lambda epoch, logs: logs.update(epoch=epoch)
            ),
            ReportCheckpointCallback(),
        ],
    )
    weights = b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())
    return hashlib.sha256(weights).hexdigest()  # every worker ends with the same weights


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()

    trainer = TensorflowTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "crash_at": args.crash_at},
        scaling_config=train.ScalingConfig(num_workers=args.num_workers),
        run_config=train.RunConfig(
            storage_path=args.storage_path,
            failure_config=train.FailureConfig(max_failures=1),
        ),
        datasets={"train": train.data.from_numpy(make_data(2048, seed=0))},
    )
    result = trainer.fit()
    print("epochs reported:", [m["epoch"] for m in result.metrics_history])
    print("final metrics:", {k: round(v, 3) for k, v in result.metrics.items()})
    print("workers agree on the weights:", len(set(result.return_values)) == 1)

    # Load the final model in the driver (with tf-keras, as the workers trained it).
    model = TensorflowCheckpoint.from_directory(result.checkpoint.path).get_model()
    test = make_data(512, seed=1)
    predictions = model.predict(test["x"], verbose=0)[:, 0] > 0.5
    accuracy = float(np.mean(predictions == test["y"].astype(bool)))
    print(f"loaded the model from {result.checkpoint.path}: test accuracy {accuracy:.2f}")


if __name__ == "__main__":
    main()
