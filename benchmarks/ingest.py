"""Ingest throughput of ``get_dataset_shard(...).iter_torch_batches(batch_size=1024)``.

A 1,000,000 x 32 float32 dataset (128 MB, column ``"data"``) is split across 2 workers
(500,000 rows each). Inside every worker, over the same shard memory, rounds of one pass
each time (in rotating order, after a warm-up pass of each):

* ``ddptrain``: ``for batch in shard.iter_torch_batches(batch_size=1024)``;
* ``floor``: the plain loop over the shard's numpy array,
  ``for s in range(0, n, 1024): batch = torch.from_numpy(array[s : s + 1024])``, i.e.
  numpy slicing ending in the same torch tensor;
* ``numpy_view``: ``array[s : s + 1024]`` alone (no tensor: the bare cost of slicing);
* each of ``ddptrain`` and ``floor`` twice: with an empty loop body (``_empty``: the cost of
  handing out batches, no byte of data is read) and with ``batch.sum()`` (``_read``: every
  byte of every batch is read once, as training reads it);
* ``ddptrain_shuffled_read``: ``local_shuffle_buffer_size=10_000`` (a gather per batch),
  for information.

A worker's figure is rows / pass time, its median over the rounds; the run's figure is the
mean of the two workers' (both run at once, one per core); quoted figures are medians over
fits. Target: ddptrain >= 0.8x the floor.

``first_batch_s``: from just before ``fit()`` to the first batch in the training loop
(latest worker), next to ``first_line_s``: the same ``TorchTrainer`` without datasets, to
the first line of its training function.

    python benchmarks/ingest.py [--repeats N] [--quick]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time

import _bench

BENCH = "ingest"
ROWS, COLS, BATCH = 1_000_000, 32, 1024
VARIANTS = ("ddptrain_empty", "floor_empty", "numpy_view", "ddptrain_read", "floor_read", "ddptrain_shuffled_read")


def ingest_loop(config: dict) -> dict:
    import statistics

    import torch

    import ddptrain as train

    first_batch = None
    shard = train.get_dataset_shard("train")
    for _ in shard.iter_torch_batches(batch_size=BATCH):
        first_batch = time.time()
        break
    array = next(iter(shard.iter_batches(batch_size=None)))["data"]  # the whole shard: a view
    n = len(array)

    def ddptrain_empty() -> None:
        for _batch in shard.iter_torch_batches(batch_size=BATCH):
            pass

    def floor_empty() -> None:
        for s in range(0, n, BATCH):
            _batch = torch.from_numpy(array[s : s + BATCH])

    def numpy_view() -> None:
        for s in range(0, n, BATCH):
            _batch = array[s : s + BATCH]

    def ddptrain_read() -> None:
        for batch in shard.iter_torch_batches(batch_size=BATCH):
            batch["data"].sum()

    def floor_read() -> None:
        for s in range(0, n, BATCH):
            torch.from_numpy(array[s : s + BATCH]).sum()

    def ddptrain_shuffled_read() -> None:
        for batch in shard.iter_torch_batches(batch_size=BATCH, local_shuffle_buffer_size=10_000):
            batch["data"].sum()

    loops = {f.__name__: f for f in (ddptrain_empty, floor_empty, numpy_view, ddptrain_read, floor_read)}
    loops["ddptrain_shuffled_read"] = ddptrain_shuffled_read
    for loop in loops.values():  # warm-up: every page mapped, every code path run once
        loop()
    rates: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for round_ in range(config["rounds"]):
        train.collective.barrier()  # both workers measure the same variant at the same time
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            loops[name]()
            rates[name].append(n / (time.perf_counter() - start))
    return {
        "first_batch": first_batch,
        "rows": n,
        "rates": {name: statistics.median(values) for name, values in rates.items()},
        "stats": shard.stats(),
    }


def first_line() -> float:
    return time.time()


def run_fit(dataset, storage: str, name: str, rounds: int) -> dict:
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    trainer = TorchTrainer(
        ingest_loop,
        train_loop_config={"rounds": rounds},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name=name, storage_path=storage),
        datasets={"train": dataset},
    )
    before = time.time()
    result = trainer.fit()
    values = result.return_values
    return {
        "first_batch_s": max(v["first_batch"] for v in values) - before,
        "rates": {name: sum(v["rates"][name] for v in values) / len(values) for name in VARIANTS},
        "rows_per_worker": values[0]["rows"],
        "stats_rank0": values[0]["stats"],
    }


def launch(storage: str, name: str) -> float:
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    before = time.time()
    result = TorchTrainer(
        first_line,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name=name, storage_path=storage),
    ).fit()
    return max(result.return_values) - before


def main() -> int:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=5, quick_repeats=1)
    import numpy as np

    import ddptrain as train

    env = _bench.environment()
    _bench.emit({"bench": BENCH, "metric": "environment", **env, "repeats": args.repeats})
    rounds = 3 if args.quick else 7
    load = _bench.ForeignLoad()
    storage = tempfile.mkdtemp(prefix="ddptrain-bench-ingest-")
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    first_batch: list[float] = []
    first_line_s: list[float] = []
    try:
        array = np.random.default_rng(0).standard_normal((ROWS, COLS), dtype=np.float32)
        start = time.perf_counter()
        dataset = train.data.from_numpy(array)
        build_s = time.perf_counter() - start
        del array  # the dataset holds its own copy, in shared memory
        _bench.emit({"bench": BENCH, "metric": "from_numpy_s", "value": build_s, "bytes": dataset.size_bytes()})
        launch(storage, "warmup")
        for repeat in range(args.repeats):
            window = _bench.ForeignLoad()
            measured = run_fit(dataset, storage, f"ingest{repeat}", rounds)
            foreign_cores = window.result()["foreign_cores"]
            first_batch.append(measured["first_batch_s"])
            for name, value in measured["rates"].items():
                rates[name].append(value)
            _bench.emit(
                {
                    "bench": BENCH,
                    "metric": "rows_per_s_per_worker",
                    "repeat": repeat,
                    **{name: round(v) for name, v in measured["rates"].items()},
                    "first_batch_s": measured["first_batch_s"],
                    "rows_per_worker": measured["rows_per_worker"],
                    "foreign_cores": foreign_cores,
                }
            )
            first_line_s.append(launch(storage, f"launch{repeat}"))
            _bench.emit({"bench": BENCH, "metric": "first_line_s", "repeat": repeat, "value": first_line_s[-1]})
        print(measured["stats_rank0"], file=sys.stderr)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        left = _bench.check_leftovers(BENCH)

    foreign = load.result()
    _bench.emit({"bench": BENCH, "metric": "foreign_load", **foreign})
    med = {name: _bench.median(values) for name, values in rates.items()}
    for name, values in rates.items():
        _bench.emit({"bench": BENCH, "metric": f"{name}_rows_per_s", "summary": True, **_bench.summary(values)})
    for metric, values in (("first_batch_s", first_batch), ("first_line_s", first_line_s)):
        _bench.emit({"bench": BENCH, "metric": metric, "summary": True, **_bench.summary(values)})
    ratios = {
        "read_vs_floor": med["ddptrain_read"] / med["floor_read"],
        "empty_vs_floor": med["ddptrain_empty"] / med["floor_empty"],
        "empty_vs_numpy_view": med["ddptrain_empty"] / med["numpy_view"],
    }
    _bench.emit({"bench": BENCH, "metric": "ratios", **ratios, "target": 0.8})
    per_batch = {name: 1e6 * BATCH / rate for name, rate in med.items()}
    lines = [
        f"ingest: {ROWS:,} x {COLS} float32, 2 workers, batch {BATCH}, {args.repeats} fits x {rounds} rounds, medians",
        f"  reading every batch (batch.sum()): ddptrain {med['ddptrain_read'] / 1e6:.1f} M rows/s per worker, "
        f"floor {med['floor_read'] / 1e6:.1f} M -> {ratios['read_vs_floor']:.2f}x "
        f"(target >= 0.8x: {'met' if ratios['read_vs_floor'] >= 0.8 else 'NOT met'})",
        f"  empty loop body: ddptrain {med['ddptrain_empty'] / 1e6:.0f} M rows/s ({per_batch['ddptrain_empty']:.2f} us "
        f"per batch), floor {med['floor_empty'] / 1e6:.0f} M ({per_batch['floor_empty']:.2f} us) -> "
        f"{ratios['empty_vs_floor']:.2f}x; numpy slicing alone {med['numpy_view'] / 1e6:.0f} M "
        f"({per_batch['numpy_view']:.2f} us) -> {ratios['empty_vs_numpy_view']:.2f}x",
        f"  shuffled (buffer 10,000), reading every batch: {med['ddptrain_shuffled_read'] / 1e6:.1f} M rows/s",
        f"  fit() -> first batch {_bench.median(first_batch):.2f} s; fit() -> first line without datasets "
        f"{_bench.median(first_line_s):.2f} s",
        f"  leftover processes: {len(left)}; other processes kept {foreign['foreign_cores']:.2f} of "
        f"{env['cpus']} cores busy",
    ]
    print("\n".join(lines))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
