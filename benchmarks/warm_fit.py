"""A second ``fit()`` on warm workers (``ddptrain.reuse_workers()``) against a cold one.

In one process, per repeat: a 2-worker ``fit()`` outside ``reuse_workers()`` (cold: a new
agent, a torch import, new workers, a new process group), and, inside one
``reuse_workers()`` block, a first fit (cold, it starts the group) and a second fit (warm).
Each training function's first line records ``time.time()`` and returns it.

* ``cold_first_line_s``: fit() to the earliest rank's first line, no reuse;
* ``warm_first_line_s``: the same for the second fit inside the block;
* ``execute_roundtrip_ms``: a no-op ``WorkerGroup.execute`` on a launched 2-worker group
  (driver to both workers and back), median of 200 calls per repeat.

Headline ratio: median(warm) / median(cold). The order of the cold and the warm measurement
alternates across repeats.

    python benchmarks/warm_fit.py [--repeats N] [--quick]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time

import _bench

BENCH = "warm_fit"


def first_line() -> float:
    t = time.time()  # the training function's first line
    return t


def noop() -> None:
    return None


def timed_fit(storage: str, name: str) -> float:
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    trainer = TorchTrainer(
        first_line,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage, name=name),
    )
    before = time.time()
    stamps = trainer.fit().return_values
    return min(stamps) - before


def main() -> int:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=5, quick_repeats=2)
    import ddptrain as train
    from ddptrain.worker_group import WorkerGroup

    _bench.emit({"bench": BENCH, "metric": "environment", **_bench.environment(), "repeats": args.repeats})
    storage = tempfile.mkdtemp(prefix="ddptrain-bench-warm-")
    cold: list[float] = []
    warm: list[float] = []
    roundtrips: list[float] = []
    runs = 0
    try:
        timed_fit(storage, "warmup")  # page cache, first-use costs; not measured

        def measure_cold() -> None:
            nonlocal runs
            runs += 1
            cold.append(timed_fit(storage, f"run{runs}"))
            _bench.emit({"bench": BENCH, "metric": "cold_first_line_s", "repeat": repeat, "value": cold[-1]})

        def measure_warm() -> None:
            nonlocal runs
            with train.reuse_workers():
                runs += 2
                timed_fit(storage, f"run{runs - 1}")
                warm.append(timed_fit(storage, f"run{runs}"))
            _bench.emit({"bench": BENCH, "metric": "warm_first_line_s", "repeat": repeat, "value": warm[-1]})

        for repeat in range(args.repeats):
            order = (measure_cold, measure_warm) if repeat % 2 == 0 else (measure_warm, measure_cold)
            for measure in order:
                measure()
            with WorkerGroup.launch(train.ScalingConfig(num_workers=2)) as group:
                group.execute(noop)
                times = []
                for _ in range(20 if args.quick else 200):
                    start = time.perf_counter()
                    group.execute(noop)
                    times.append((time.perf_counter() - start) * 1000)
            roundtrips.append(_bench.median(times))
            _bench.emit({"bench": BENCH, "metric": "execute_roundtrip_ms", "repeat": repeat, "value": roundtrips[-1]})
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        left = _bench.check_leftovers(BENCH)
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "summary",
            "cold_first_line_s": _bench.summary(cold),
            "warm_first_line_s": _bench.summary(warm),
            "execute_roundtrip_ms": _bench.summary(roundtrips),
            "ratio_warm_over_cold": _bench.median(warm) / _bench.median(cold),
            "leftover_processes": len(left),
        }
    )
    ratio = _bench.median(warm) / _bench.median(cold)
    print(
        f"warm_fit: fit() to first line, 2 workers: cold {_bench.median(cold):.3f} s, warm "
        f"{_bench.median(warm):.3f} s ({ratio:.3f}x); WorkerGroup.execute round trip "
        f"{_bench.median(roundtrips):.2f} ms; leftover processes: {len(left)}"
    )
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
