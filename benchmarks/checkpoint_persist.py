"""Checkpoint persist speed: ``report(checkpoint=...)`` against a plain copy of the same bytes.

A 200 MB checkpoint is written into a temporary folder inside the training function (not
timed); then ``report()`` is timed until it returns, which is when the checkpoint is committed
in the run directory. Two layouts, with 2 workers:

* ``rank0``: rank 0 passes the whole 200 MB, the other rank passes nothing;
* ``all_ranks``: every rank passes its 1/N share (200 MB in total), merged into one checkpoint.

Baseline, in the same script and the same repeats: ``shutil.copytree`` of a 200 MB folder into
the same file system as the run directory. Ratio = report MB/s / copy MB/s (target >= 0.9).

    python benchmarks/checkpoint_persist.py [--repeats N] [--quick]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import _bench

BENCH = "checkpoint_persist"
MB = 1024 * 1024


def _write(folder: str, size: int) -> None:
    block = os.urandom(MB)
    with open(os.path.join(folder, "weights.bin"), "wb") as f:
        for _ in range(size // MB):
            f.write(block)


def persist_loop(config: dict) -> float:
    import ddptrain as train

    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    size = config["size"] if config["layout"] == "rank0" else config["size"] // world
    passes = config["layout"] == "all_ranks" or rank == 0
    with tempfile.TemporaryDirectory(dir=config["tmp"]) as d:
        if passes:
            os.makedirs(os.path.join(d, f"rank_{rank}"))
            _write(os.path.join(d, f"rank_{rank}"), size)
        start = time.perf_counter()
        train.report({"x": 1}, checkpoint=train.Checkpoint.from_directory(d) if passes else None)
        return time.perf_counter() - start


def timed_report(layout: str, size: int, storage: str, tmp: str, name: str) -> float:
    import ddptrain as train

    result = train.DataParallelTrainer(
        persist_loop,
        train_loop_config={"layout": layout, "size": size, "tmp": tmp},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name=name, storage_path=storage),
    ).fit()
    return max(result.return_values)


def timed_copy(size: int, tmp: str, storage: str) -> float:
    source = tempfile.mkdtemp(dir=tmp)
    _write(source, size)
    target = os.path.join(storage, f"copy_{time.monotonic_ns()}")
    start = time.perf_counter()
    shutil.copytree(source, target)
    elapsed = time.perf_counter() - start
    shutil.rmtree(source)
    shutil.rmtree(target)
    return elapsed


def main() -> None:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=5, quick_repeats=2)
    size = (40 if args.quick else 200) * MB
    load = _bench.ForeignLoad()
    work = tempfile.mkdtemp(prefix="ddptrain_bench_ckpt_")
    storage, tmp = os.path.join(work, "runs"), os.path.join(work, "tmp")
    os.makedirs(storage)
    os.makedirs(tmp)
    times: dict[str, list[float]] = {"copy": [], "rank0": [], "all_ranks": []}
    try:
        timed_copy(size, tmp, storage)  # warm-up
        for repeat in range(args.repeats):
            order = ["copy", "rank0", "all_ranks"]
            order = order[repeat % 3 :] + order[: repeat % 3]
            for what in order:
                if what == "copy":
                    times[what].append(timed_copy(size, tmp, storage))
                else:
                    times[what].append(timed_report(what, size, storage, tmp, f"{what}_{repeat}"))
                    shutil.rmtree(os.path.join(storage, f"{what}_{repeat}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = size / MB
    copy_rate = mb / _bench.median(times["copy"])
    for what in ("copy", "rank0", "all_ranks"):
        rate = mb / _bench.median(times[what])
        _bench.emit({"bench": BENCH, "metric": what, "mb": mb, "seconds": _bench.summary(times[what]),
                     "mb_per_s_median": round(rate, 1), "ratio_vs_copy": round(rate / copy_rate, 3)})
    _bench.emit({"bench": BENCH, "metric": "environment", **_bench.environment(), **load.result()})
    left = _bench.check_leftovers(BENCH)
    print(f"\n{BENCH}: {mb:.0f} MB checkpoint, medians of {args.repeats} runs")
    print(f"  plain copy            {copy_rate:8.1f} MB/s")
    for what in ("rank0", "all_ranks"):
        rate = mb / _bench.median(times[what])
        print(f"  report() {what:<12} {rate:8.1f} MB/s   ratio {rate / copy_rate:.2f}x (target >= 0.9x)")
    if left:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
