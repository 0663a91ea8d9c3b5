"""A small MLP trained with JAX and optax in a JaxTrainer: data parallel over 2 CPU workers.

Synthetic regression data, split between the workers by ``get_dataset_shard``. Every worker
joins one multi-process JAX runtime (``jax.distributed``, started by the JaxTrainer), so
``jax.devices()`` holds one CPU device per worker. Each step builds the global batch from the
workers' local batches with ``jax.make_array_from_process_local_data``; the jitted step computes
the loss on the whole batch, and XLA sums the gradients across the workers (over gloo). The
parameters are replicated: every worker holds the same copy. Rank 0 checkpoints them every
epoch. With ``--crash-at N`` rank 1 is killed in epoch N of the first attempt (a marker file
keeps the restart from crashing again); ``FailureConfig(max_failures=1)`` restarts the group
and training resumes from ``get_checkpoint()``.

    python examples/jax_mlp.py
    python examples/jax_mlp.py --epochs 6 --crash-at 3
"""

import argparse
import os
import pickle
import shutil
import signal
import tempfile

import jax  # importing JAX at the top is fine; computing with it here is not (see docs/jax.md)
import numpy as np
import optax

import ddptrain as train
from ddptrain.jax import JaxTrainer

FEATURES = 16


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (np.sin(x[:, 0]) + x[:, 1] * x[:, 2] - 0.5 * x[:, 3]).astype("float32")
    return {"x": x, "y": y}


def init_params(seed, sizes):
    rng = np.random.default_rng(seed)
    return [
        {"w": (rng.normal(size=(m, n)) / np.sqrt(m)).astype("float32"), "b": np.zeros(n, "float32")}
        for m, n in zip(sizes[:-1], sizes[1:])
    ]


def predict(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return (x @ params[-1]["w"] + params[-1]["b"])[:, 0]


def train_func(config):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    rank = train.get_context().get_world_rank()
    mesh = Mesh(np.array(jax.devices()), ("batch",))  # one CPU device per worker, all workers
    replicated, by_row = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    optimizer = optax.adam(config["lr"])

    # 1. Start: fresh parameters, or those of the last checkpoint after a restart.
    params, opt_state, start = init_params(0, [FEATURES, 64, 64, 1]), None, 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d, open(os.path.join(d, "state.pkl"), "rb") as f:
            state = pickle.load(f)
        params, opt_state, start = state["params"], state["opt_state"], state["epoch"] + 1
    if opt_state is None:
        opt_state = optimizer.init(params)

    # Every worker holds the same host values: make them global, replicated arrays.
    def replicate(tree):
        return jax.tree.map(lambda a: jax.make_array_from_process_local_data(replicated, np.asarray(a)), tree)

    def to_host(tree):  # this worker's copy of replicated arrays, as numpy
        return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), tree)

    params, opt_state = replicate(params), replicate(opt_state)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: ((predict(p, x) - y) ** 2).mean())(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    shard = train.get_dataset_shard("train")
    marker = config["marker"]
    for epoch in range(start, config["epochs"]):
        losses = []
        for batch in shard.iter_batches(batch_size=config["batch_size"], batch_format="numpy", drop_last=True):
            x = jax.make_array_from_process_local_data(by_row, batch["x"])  # the global batch
            y = jax.make_array_from_process_local_data(by_row, batch["y"])
            params, opt_state, loss = step(params, opt_state, x, y)
            losses.append(loss)
        if epoch == config["crash_at"] and rank == 1 and marker and not os.path.exists(marker):
            open(marker, "w").close()
            print(f"rank 1: simulating a crash in epoch {epoch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        metrics = {"epoch": epoch, "loss": float(np.mean([np.asarray(loss.addressable_data(0)) for loss in losses]))}
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:  # the parameters are replicated: one copy is enough
                with open(os.path.join(d, "state.pkl"), "wb") as f:
                    pickle.dump({"params": to_host(params), "opt_state": to_host(opt_state), "epoch": epoch}, f)
            train.report(metrics, checkpoint=train.Checkpoint.from_directory(d) if rank == 0 else None)
    return start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=128, help="rows per worker per step")
    parser.add_argument("--crash-at", type=int, default=None, help="kill rank 1 in epoch N, once")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()

    marker_dir = tempfile.mkdtemp(prefix="jax-example-")
    trainer = JaxTrainer(
        train_func,
        train_loop_config={
            "lr": 3e-3,
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "crash_at": args.crash_at,
            "marker": os.path.join(marker_dir, "crashed"),
        },
        datasets={"train": train.data.from_numpy(make_data(args.rows, 0))},
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
    print("losses:", [round(m["loss"], 4) for m in result.metrics_history])
    print("last attempt started at epoch", result.return_values[0])

    # The final parameters, on the driver (plain numpy: no JAX runtime needed to read them).
    with result.checkpoint.as_directory() as d, open(os.path.join(d, "state.pkl"), "rb") as f:
        state = pickle.load(f)
    test = make_data(2048, 1)
    mse = float(np.mean((np.asarray(predict(state["params"], test["x"])) - test["y"]) ** 2))
    print(f"checkpoint of epoch {state['epoch']} from {result.checkpoint.path}: test MSE {mse:.4f}")


if __name__ == "__main__":
    main()
