"""RaySGD's ``TorchTrainer`` (``ddptrain.util.sgd``): the cost of a ``train()`` call, and epoch
throughput against the same loop written as a ``ddptrain.torch.TorchTrainer`` function.

Both sides train the same 2-layer MLP (32 → 64 → 1, MSE, SGD) with DDP on 2 CPU workers,
on the same 4,096 samples (batches of 64 per worker: 32 batches per worker per epoch).

* ``call_1batch_s``: one ``trainer.train(num_steps=1)`` call seen from the driver (one
  batch per worker); ``epoch_1batch_s``: the same epoch timed inside rank 0
  (``profile=True``'s ``mean_train_epoch_s``). ``overhead_s`` = call - epoch: what a
  ``train()`` call costs beyond the user's epoch (two messages per worker through the store,
  rank 0's state returned to the driver for fault tolerance, the metric reduction). Median
  of 50 calls per repeat.
* ``sgd_epoch_s``: a full-epoch ``trainer.train(profile=True)`` call, seen from the driver
  (median of ``EPOCHS`` epochs per repeat, after one warm-up epoch);
  ``sgd_epoch_in_worker_s``: the same epochs timed inside rank 0 (``mean_train_epoch_s``).
* Baseline ``func_epoch_s``: the same epochs inside one ``TorchTrainer(train_func).fit()``,
  timed by rank 0 around each epoch (after one warm-up epoch): no driver round trip at all.
  Headline ratio: median(sgd_epoch_s) / median(func_epoch_s); target **<= 1.05**.

The two sides alternate their order across repeats; trainers are started outside the timings.

    python benchmarks/raysgd.py [--repeats N] [--quick]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from typing import Any

import _bench

BENCH = "raysgd"
SAMPLES = 4096
BATCH = 64
EPOCHS = 8
CALLS = 50


def _data() -> Any:
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 32, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def _model() -> Any:
    import torch.nn as nn

    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


def _operator_cls() -> type:
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader

    from ddptrain.util.sgd import TrainingOperator

    class MLPOperator(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            torch.manual_seed(0)
            model = _model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            self.model, self.optimizer, self.criterion = self.register(
                models=model, optimizers=optimizer, criterion=nn.MSELoss()
            )
            self.register_data(train_loader=DataLoader(_data(), batch_size=BATCH, shuffle=True))

    return MLPOperator


def train_func(config: dict[str, Any]) -> list[float]:
    """The same epochs as the operator's default ``train_epoch``, written by hand."""
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader

    import ddptrain.torch

    torch.manual_seed(0)
    model = ddptrain.torch.prepare_model(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.MSELoss()
    loader = ddptrain.torch.prepare_data_loader(DataLoader(_data(), batch_size=BATCH, shuffle=True))
    durations = []
    for epoch in range(config["epochs"] + 1):
        start = time.perf_counter()
        loader.sampler.set_epoch(epoch)
        model.train()
        for features, target in loader:
            loss = criterion(model(features), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss.item()  # the operator reads every batch's loss too
        durations.append(time.perf_counter() - start)
    return durations[1:]  # the first epoch is a warm-up


def measure_sgd(operator: type) -> dict[str, list[float]]:
    from ddptrain.util.sgd import TorchTrainer

    with TorchTrainer(training_operator_cls=operator, num_workers=2, use_gpu=False) as trainer:
        trainer.train(num_steps=1)  # warm-up: DDP's first buckets, the first messages
        calls, epochs = [], []
        for _ in range(CALLS):
            start = time.perf_counter()
            stats = trainer.train(num_steps=1, profile=True)
            calls.append(time.perf_counter() - start)
            epochs.append(stats["profile"]["mean_train_epoch_s"])
        trainer.train()  # warm-up of a full epoch
        full, inside = [], []
        for _ in range(EPOCHS):
            start = time.perf_counter()
            stats = trainer.train(profile=True)
            full.append(time.perf_counter() - start)
            inside.append(stats["profile"]["mean_train_epoch_s"])
    overheads = [c - e for c, e in zip(calls, epochs, strict=True)]
    return {
        "call_1batch_s": calls,
        "epoch_1batch_s": epochs,
        "overhead_s": overheads,
        "sgd_epoch_s": full,
        "sgd_epoch_in_worker_s": inside,
    }


def measure_func(storage: str, name: str) -> list[float]:
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    result = TorchTrainer(
        train_func,
        train_loop_config={"epochs": EPOCHS},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage, name=name),
    ).fit()
    return list(result.return_values[0])


def main() -> int:
    global CALLS, EPOCHS
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=5, quick_repeats=1)
    if args.quick:
        CALLS, EPOCHS = 10, 3
    env = _bench.environment()
    _bench.emit({"bench": BENCH, "metric": "environment", **env, "repeats": args.repeats})
    load = _bench.ForeignLoad()
    storage = tempfile.mkdtemp(prefix="ddptrain-bench-raysgd-")
    operator = _operator_cls()
    medians: dict[str, list[float]] = {
        k: []
        for k in (
            "call_1batch_s",
            "epoch_1batch_s",
            "overhead_s",
            "sgd_epoch_s",
            "sgd_epoch_in_worker_s",
            "func_epoch_s",
        )
    }
    try:
        for repeat in range(args.repeats):
            order = ["sgd", "func"] if repeat % 2 == 0 else ["func", "sgd"]
            for side in order:
                window = _bench.ForeignLoad()
                if side == "sgd":
                    measured = measure_sgd(operator)
                else:
                    measured = {"func_epoch_s": measure_func(storage, f"run{repeat}")}
                foreign = window.result()["foreign_cores"]
                for metric, values in measured.items():
                    value = _bench.median(values)
                    medians[metric].append(value)
                    _bench.emit(
                        {"bench": BENCH, "metric": metric, "repeat": repeat, "value": value, "foreign_cores": foreign}
                    )
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        left = _bench.check_leftovers(BENCH)

    foreign = load.result()
    _bench.emit({"bench": BENCH, "metric": "foreign_load", **foreign})
    stats = {metric: _bench.summary(values) for metric, values in medians.items()}
    for metric, st in stats.items():
        _bench.emit({"bench": BENCH, "metric": metric, "summary": True, **st})
    ratio = stats["sgd_epoch_s"]["median"] / stats["func_epoch_s"]["median"]
    _bench.emit(
        {"bench": BENCH, "metric": "sgd_vs_func_epoch", "ratio": ratio, "target": 1.05, "meets_target": ratio <= 1.05}
    )
    print(
        "\n".join(
            [
                f"raysgd: machine {env['cpus']} CPUs, torch {env['torch']}, {args.repeats} repeats, medians",
                f"  train(num_steps=1) call {stats['call_1batch_s']['median'] * 1e3:.1f} ms, of which the epoch "
                f"{stats['epoch_1batch_s']['median'] * 1e3:.1f} ms: overhead "
                f"{stats['overhead_s']['median'] * 1e3:.1f} ms per call",
                f"  full epoch ({SAMPLES} samples, 2 workers): train() {stats['sgd_epoch_s']['median'] * 1e3:.1f} ms, "
                f"train_func loop {stats['func_epoch_s']['median'] * 1e3:.1f} ms: {ratio:.3f}x "
                f"(target <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'}); the operator's epoch inside rank 0 "
                f"{stats['sgd_epoch_in_worker_s']['median'] * 1e3:.1f} ms",
                f"  leftover processes: {len(left)}; other processes kept {foreign['foreign_cores']:.2f} "
                f"of {env['cpus']} cores busy during the run",
            ]
        )
    )
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
