"""Peak memory of a run with 4 local workers and a 1 GiB dataset, against the dataset's size.

The dataset is 8,388,608 x 32 float32 (exactly 1 GiB), built with ``from_numpy`` before
``fit()``. Every worker reads its shard once with ``iter_torch_batches`` (summing every
batch, so every page is touched), waits at a barrier for the others, and stays up for
another half second. Variants:

* ``split``: the dataset split across the 4 workers (the default): each reads 256 MiB;
* ``whole``: ``DataConfig(datasets_to_split=[])``: each of the 4 workers reads all 1 GiB;
* ``baseline``: the same run with a 4-row dataset: the processes' own memory.

While ``fit()`` runs, a thread samples every 50 ms the driver, the agent and the workers
(``/proc/<pid>/smaps_rollup``) and the machine (``/proc/meminfo``). Figures, peaks per fit:

* ``pss_sum``: the sum of the processes' PSS (a page shared by k processes counts 1/k in
  each), i.e. the RAM these processes hold between them; ``extra`` is a variant's peak
  minus the baseline's, and the ratio ``extra / dataset size`` has the target <= 1.3x;
* ``rss_sum``: the sum of RSS, which counts a shared page once per process that maps it;
* ``shmem``: the machine's shared memory (``Shmem`` in ``/proc/meminfo``, where the
  dataset's pages live) minus its value before the dataset was built: one copy, whatever
  the number of workers.

    python benchmarks/memory.py [--repeats N] [--quick]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time

import _bench

BENCH = "memory"
COLS = 32
WORKERS = 4


def read_shard(config: dict) -> int:
    import ddptrain as train

    shard = train.get_dataset_shard("train")
    for batch in shard.iter_torch_batches(batch_size=65536):
        batch["data"].sum()
    train.collective.barrier()
    time.sleep(0.5)  # every worker holds its pages while the sampler looks
    return shard.count()


def _kb(path: str, fields: tuple[str, ...]) -> dict[str, int]:
    values = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in fields:
                    values[name] = int(rest.split()[0])
    except OSError:
        pass
    return values


def shmem_kb() -> int:
    return _kb("/proc/meminfo", ("Shmem",))["Shmem"]


class Sampler:
    """Peaks of the summed PSS and RSS of this process and its tagged children, and of the
    machine's shared memory, while it runs."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.peaks = {"pss_sum": 0, "rss_sum": 0, "shmem": 0, "processes": 0}
        self._stop = threading.Event()
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        pids = [os.getpid(), *_bench.tagged_processes()]
        pss = rss = 0
        for pid in pids:
            figures = _kb(f"/proc/{pid}/smaps_rollup", ("Pss", "Rss"))
            pss += figures.get("Pss", 0)
            rss += figures.get("Rss", 0)
        for key, value in (
            ("pss_sum", pss),
            ("rss_sum", rss),
            ("shmem", shmem_kb()),
            ("processes", len(pids)),
        ):
            self.peaks[key] = max(self.peaks[key], value)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._interval_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(dataset, split: bool, storage: str, name: str, shmem_before_kb: int) -> dict[str, float]:
    import ddptrain as train

    trainer = train.DataParallelTrainer(
        read_shard,
        scaling_config=train.ScalingConfig(num_workers=WORKERS),
        run_config=train.RunConfig(name=name, storage_path=storage),
        datasets={"train": dataset},
        dataset_config=train.DataConfig(datasets_to_split="all" if split else []),
    )
    with Sampler() as sampler:
        result = trainer.fit()
    rows = dataset.count() // WORKERS if split else dataset.count()
    assert result.return_values == [rows] * WORKERS, result.return_values
    peaks = sampler.peaks
    return {
        "pss_sum_mib": peaks["pss_sum"] / 1024,
        "rss_sum_mib": peaks["rss_sum"] / 1024,
        "shmem_mib": (peaks["shmem"] - shmem_before_kb) / 1024,
        "processes": peaks["processes"],
    }


def main() -> int:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=3, quick_repeats=1)
    import numpy as np

    import ddptrain as train

    rows = 1 << 21 if args.quick else 1 << 23  # x 32 float32: 256 MiB with --quick, else 1 GiB
    env = _bench.environment()
    _bench.emit({"bench": BENCH, "metric": "environment", **env, "repeats": args.repeats})
    load = _bench.ForeignLoad()
    storage = tempfile.mkdtemp(prefix="ddptrain-bench-memory-")
    results: dict[str, dict[str, list[float]]] = {}
    try:
        tiny = train.data.from_numpy(np.ones((WORKERS, COLS), np.float32))
        measure(tiny, True, storage, "warmup", shmem_kb())
        shmem_before = shmem_kb()
        pss_before = _kb("/proc/self/smaps_rollup", ("Pss",))["Pss"]
        with Sampler() as building:
            array = np.ones((rows, COLS), np.float32)
            dataset = train.data.from_numpy(array)
            del array  # the dataset has its own copy, in shared memory
        size_mib = dataset.size_bytes() / 2**20
        # The array (private, in PSS) and its copy (shared memory, not mapped yet) peak together,
        # just before `del array`.
        build_peak_mib = (building.peaks["pss_sum"] - pss_before + building.peaks["shmem"] - shmem_before) / 1024
        _bench.emit({"bench": BENCH, "metric": "dataset_mib", "value": size_mib, "build_peak_pss_mib": build_peak_mib})
        variants = {"baseline": (tiny, True), "split": (dataset, True), "whole": (dataset, False)}
        for repeat in range(args.repeats):
            for variant, (data, split) in variants.items():
                window = _bench.ForeignLoad()
                figures = measure(data, split, storage, f"{variant}{repeat}", shmem_before)
                for key, value in figures.items():
                    results.setdefault(variant, {}).setdefault(key, []).append(value)
                _bench.emit(
                    {
                        "bench": BENCH,
                        "metric": "peak_memory",
                        "variant": variant,
                        "repeat": repeat,
                        **{k: round(v, 1) for k, v in figures.items()},
                        "foreign_cores": window.result()["foreign_cores"],
                    }
                )
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        left = _bench.check_leftovers(BENCH)

    foreign = load.result()
    _bench.emit({"bench": BENCH, "metric": "foreign_load", **foreign})
    med = {v: {k: _bench.median(values) for k, values in figures.items()} for v, figures in results.items()}
    for variant, figures in results.items():
        for key, values in figures.items():
            _bench.emit({"bench": BENCH, "metric": key, "variant": variant, "summary": True, **_bench.summary(values)})
    base = med["baseline"]["pss_sum_mib"]
    lines = [
        f"memory: {WORKERS} workers, dataset {size_mib:.0f} MiB, {args.repeats} repeats, medians of peaks",
        f"  baseline (4-row dataset): PSS sum {base:.0f} MiB, RSS sum {med['baseline']['rss_sum_mib']:.0f} MiB",
    ]
    ratios = {}
    for variant in ("split", "whole"):
        extra = med[variant]["pss_sum_mib"] - base
        ratios[variant] = extra / size_mib
        lines.append(
            f"  {variant}: PSS sum {med[variant]['pss_sum_mib']:.0f} MiB = baseline + {extra:.0f} MiB "
            f"= {ratios[variant]:.2f}x the dataset (target <= 1.3x: {'met' if ratios[variant] <= 1.3 else 'NOT met'}); "
            f"RSS sum {med[variant]['rss_sum_mib']:.0f} MiB; machine's shared memory "
            f"+{med[variant]['shmem_mib']:.0f} MiB"
        )
    _bench.emit({"bench": BENCH, "metric": "extra_pss_vs_dataset", **ratios, "target": 1.3})
    lines.append(
        f"  building it from a numpy array in the driver: peak +{build_peak_mib:.0f} MiB (the array and its "
        "shared copy, for a moment)"
    )
    lines.append(
        f"  leftover processes: {len(left)}; other processes kept {foreign['foreign_cores']:.2f} of "
        f"{env['cpus']} cores busy"
    )
    print("\n".join(lines))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
