"""TensorflowTrainer, TensorflowConfig, ReportCheckpointCallback and DataIterator.to_tf with real
TensorFlow (tf-keras) in real worker processes.

TensorFlow is imported inside the functions only: the workers unpickle this module's functions
by reference, and must import TensorFlow after ddptrain selected tf-keras.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ddptrain as train

pytestmark = [
    pytest.mark.slow,
    pytest.mark.tensorflow,
    pytest.mark.skipif(
        importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("tf_keras") is None,
        reason="needs `pip install ddptrain[tensorflow]`",
    ),
]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _weights_digest(model: Any) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())).hexdigest()


def _dataset(rows: int = 256) -> train.data.Dataset:
    x = np.random.default_rng(0).normal(size=(rows, 4)).astype("float32")
    return train.data.from_numpy({"x": x, "y": (x[:, 0] + x[:, 1] > 0).astype("float32")})


def _train_func(config: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    from ddptrain.tensorflow import prepare_dataset_shard
    from ddptrain.tensorflow.keras import ReportCheckpointCallback

    rank = train.get_context().get_world_rank()
    tf.keras.utils.set_random_seed(rank)  # the strategy must make the ranks agree
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(8, activation="relu"), tf.keras.layers.Dense(1)]
        )
        model.compile(
            optimizer=tf.keras.optimizers.SGD(0.1),
            loss=tf.keras.losses.BinaryCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    data = prepare_dataset_shard(train.get_dataset_shard("train").to_tf("x", "y", batch_size=32))
    history = model.fit(data, epochs=config["epochs"], verbose=0, callbacks=[ReportCheckpointCallback()])
    return {
        "digest": _weights_digest(model),
        "history": history.history,
        "tf_config": json.loads(os.environ["TF_CONFIG"]),
        "keras": type(model).__module__,
    }


def test_two_workers_train_one_model_and_report_keras_logs_with_loadable_checkpoints(storage: str) -> None:
    from ddptrain.tensorflow import TensorflowCheckpoint, TensorflowTrainer

    result = TensorflowTrainer(
        _train_func,
        train_loop_config={"epochs": 2},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
        datasets={"train": _dataset()},
    ).fit()
    rank0, rank1 = result.return_values
    # The ranks started from different seeds: MultiWorkerMirroredStrategy synchronized them.
    assert rank0["digest"] == rank1["digest"]
    assert rank0["keras"].startswith("tf_keras.")  # TF_USE_LEGACY_KERAS=1 in the workers
    cluster = rank0["tf_config"]["cluster"]["worker"]
    assert rank1["tf_config"]["cluster"]["worker"] == cluster and len(set(cluster)) == 2
    assert [r["tf_config"]["task"] for r in (rank0, rank1)] == [
        {"type": "worker", "index": 0},
        {"type": "worker", "index": 1},
    ]
    # Every epoch's Keras logs were reported as they are (rank 0's become the run's metrics).
    assert [set(m) for m in result.metrics_history] == [{"loss", "accuracy"}] * 2
    for key in ("loss", "accuracy"):
        assert [m[key] for m in result.metrics_history] == pytest.approx(rank0["history"][key])
    assert isinstance(result.metrics["loss"], float)
    assert len(result.best_checkpoints) == 2
    assert "model.keras" in os.listdir(result.checkpoint.path)
    # The driver loads the last checkpoint with the workers' Keras: the final weights.
    model = TensorflowCheckpoint.from_directory(result.checkpoint.path).get_model()
    assert type(model).__module__.startswith("tf_keras.")
    assert _weights_digest(model) == rank0["digest"]


@pytest.mark.timeout(300)
def test_example_restarts_after_a_worker_is_killed_and_continues_the_epoch_count(storage: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "tensorflow_keras.py"), "--epochs", "3", "--crash-at", "1"]
        + ["--storage-path", storage],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "[rank0] attempt starts at epoch 0" in out
    assert "rank 1: simulating a crash" in out
    assert "[rank0] attempt starts at epoch 1" in out  # resumed from epoch 0's checkpoint
    assert "epochs reported: [0, 1, 2]" in out
    assert "workers agree on the weights: True" in out
    assert "loaded the model from" in out and "test accuracy" in out
    (run_dir,) = Path(storage).iterdir()
    attempts = [json.loads(line)["attempt"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert attempts == [0, 1, 1]


def _never_runs() -> None:
    raise AssertionError("the training function must not start")


def test_a_port_in_use_fails_at_once_naming_port_and_host(storage: str) -> None:
    from ddptrain.tensorflow import TensorflowConfig, TensorflowTrainer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(train.TrainingFailedError) as info:
            TensorflowTrainer(
                _never_runs,
                tensorflow_config=TensorflowConfig(port=port),
                scaling_config=train.ScalingConfig(num_workers=2),
                run_config=train.RunConfig(storage_path=storage),
            ).fit()
    assert time.monotonic() - started < 60
    message = str(info.value)
    assert f"port {port} for the TensorFlow server of rank 0 on host {socket.gethostname()} is in use" in message
    assert "TensorflowConfig(port=...)" in message


def test_workers_without_tensorflow_fail_with_the_extra_to_install(storage: str, tmp_path: Path) -> None:
    from ddptrain.tensorflow import TensorflowTrainer

    # Every Python started with this PYTHONPATH (the workers' agent) cannot import TensorFlow.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nfor name in ('tensorflow', 'tf_keras'):\n    sys.modules[name] = None\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    with pytest.raises(train.TrainingFailedError) as info:
        TensorflowTrainer(
            _never_runs,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage, worker_runtime_env={"env_vars": {"PYTHONPATH": path}}),
        ).fit()
    assert "pip install ddptrain[tensorflow]" in str(info.value)


def test_import_ddptrain_tensorflow_imports_no_tensorflow_and_a_missing_one_names_the_extra() -> None:
    code = textwrap.dedent(
        """
        import sys
        import ddptrain
        from ddptrain.tensorflow import TensorflowConfig, TensorflowTrainer
        TensorflowTrainer(lambda: None, tensorflow_config=TensorflowConfig())
        print("loaded:", [m for m in ("tensorflow", "keras", "tf_keras") if m in sys.modules])
        for name in list(sys.modules):
            if name.startswith("ddptrain.tensorflow"):
                del sys.modules[name]
        sys.modules["tensorflow"] = None
        try:
            import ddptrain.tensorflow
        except ImportError as e:
            print("error:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "loaded: []" in out.stdout
    assert "error: ddptrain.tensorflow needs tensorflow" in out.stdout
    assert "pip install ddptrain[tensorflow]" in out.stdout


def test_tensorflow_config_and_callback_arguments_are_checked() -> None:
    from ddptrain.tensorflow import TensorflowConfig
    from ddptrain.tensorflow.keras import ReportCheckpointCallback

    with pytest.raises(ValueError, match=r"`port` must be a port number in \[1, 65535\].*got 70000"):
        TensorflowConfig(port=70000)
    with pytest.raises(ValueError, match="`checkpoint_on` must be one or more Keras hooks.*epoch_ends"):
        ReportCheckpointCallback(checkpoint_on="epoch_ends")
    callback = ReportCheckpointCallback(metrics={"acc": "accuracy"})
    assert callback._get_reported_metrics({"accuracy": np.float32(0.5), "loss": 1.0}) == {"acc": 0.5}
    with pytest.raises(KeyError, match="logged no 'accuracy'"):
        callback._get_reported_metrics({"loss": 1.0})


# ----------------------------------------------------------------- to_tf


def _iterator() -> Any:
    rows = 10
    return train.data.from_numpy(
        {
            "a": np.arange(rows, dtype=np.float32),
            "b": np.arange(rows, dtype=np.int64) * 10,
            "img": np.arange(rows * 6, dtype=np.float64).reshape(rows, 2, 3),
            "y": np.arange(rows, dtype=np.int32) % 2,
        }
    ).iterator()


def test_to_tf_batches_a_column_as_one_tensor_with_its_dtype_and_row_shape() -> None:
    import tensorflow as tf

    data = _iterator().to_tf("img", "y", batch_size=4)
    assert data.element_spec == (
        tf.TensorSpec((None, 2, 3), tf.float64),
        tf.TensorSpec((None,), tf.int32),
    )
    batches = list(data)
    assert [x.shape[0] for x, _ in batches] == [4, 4, 2]
    assert np.array_equal(np.concatenate([y.numpy() for _, y in batches]), np.arange(10) % 2)
    assert np.array_equal(batches[1][0].numpy()[0], np.arange(24, 30, dtype=np.float64).reshape(2, 3))
    # Each pass (each Keras epoch) reads the shard again; drop_last leaves out the short batch.
    assert len(list(data)) == 3
    assert [x.shape[0] for x, _ in _iterator().to_tf("a", "y", batch_size=4, drop_last=True)] == [4, 4]
    options = data.options().experimental_distribute
    assert options.auto_shard_policy == tf.data.experimental.AutoShardPolicy.OFF


def test_to_tf_lists_of_columns_give_dicts_and_additional_columns_come_third() -> None:
    import tensorflow as tf

    data = _iterator().to_tf(["a", "b"], ["y"], additional_columns="a", batch_size=5)
    features, labels, extra = next(iter(data))
    assert set(features) == {"a", "b"} and set(labels) == {"y"}
    assert features["a"].dtype == tf.float32 and features["b"].dtype == tf.int64
    assert features["b"].numpy().tolist() == [0, 10, 20, 30, 40]
    assert extra.numpy().tolist() == [0, 1, 2, 3, 4]
    # A Keras model with named inputs takes the dict (tf-keras, the workers' Keras).
    import tf_keras as keras

    inputs = {name: keras.Input(shape=(), name=name) for name in ("a", "b")}
    merged = keras.layers.Concatenate()([keras.layers.Reshape((1,))(inputs[name]) for name in ("a", "b")])
    model = keras.Model(inputs, keras.layers.Dense(1)(merged))
    model.compile("sgd", "mse")
    pairs = _iterator().to_tf(["a", "b"], "y", batch_size=5)
    pairs = pairs.map(lambda f, y: ({k: tf.cast(v, "float32") for k, v in f.items()}, y))
    assert len(model.fit(pairs, epochs=2, verbose=0).history["loss"]) == 2


def test_to_tf_strings_shuffling_and_bad_columns() -> None:
    import tensorflow as tf

    rows = train.data.from_items([{"text": t, "y": i} for i, t in enumerate(["a", "bé", "c", "d"])]).iterator()
    data = rows.to_tf("text", "y", batch_size=4)
    assert data.element_spec[0] == tf.TensorSpec((None,), tf.string)
    assert next(iter(data))[0].numpy().tolist() == [b"a", "bé".encode(), b"c", b"d"]
    shuffled = _iterator().to_tf("a", "y", batch_size=10, local_shuffle_buffer_size=10, local_shuffle_seed=1)
    ((values, _),) = list(shuffled)
    assert sorted(values.numpy().tolist()) == list(range(10)) and values.numpy().tolist() != list(range(10))
    with pytest.raises(ValueError, match="'nope', which the dataset does not have; its columns are"):
        _iterator().to_tf("nope", "y")
    objects = train.data.from_items([{"o": {"k": 1}, "y": 0}]).iterator()
    with pytest.raises(ValueError, match="column 'o' holds dict objects.*feature_type_spec"):
        objects.to_tf("o", "y")
