"""Checkpoint persist speed: ``report(checkpoint=...)`` against a plain copy of the same bytes.

Inside the training function of a 2-worker run, each round writes a 200 MB checkpoint into a
temporary folder (not timed) and then, in alternating order, times

* ``report(checkpoint=...)`` until it returns, which is when the checkpoint is committed in
  the run directory, and
* the baseline: ``shutil.copytree`` of the same folder into the same file system, in the same
  process (when several ranks pass files, they copy at the same moment, as they report).

Both start at a ``barrier()`` and the slowest rank counts. Two layouts:

* ``rank0``: rank 0 passes the whole 200 MB, the other rank passes nothing;
* ``all_ranks``: every rank passes its half, merged into one checkpoint.

Ratio = report MB/s / copy MB/s, medians over all rounds (target >= 0.9).

    python benchmarks/checkpoint_persist.py [--repeats N] [--quick]
    DDPTRAIN_BENCH_DIR=/dev/shm python benchmarks/checkpoint_persist.py   # on tmpfs

On this machine's disk (ext4 mounted with ``discard`` on a virtual disk) single 200 MB copies
vary from 0.05 to 0.4 s whatever does them; measuring both sides in the same process, round
after round in alternating order, is what keeps the comparison fair.
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


def persist_loop(config: dict) -> list[tuple[float, float]]:
    import ddptrain as train

    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    size = config["size"] if config["layout"] == "rank0" else config["size"] // world
    passes = config["layout"] == "all_ranks" or rank == 0
    rounds = []
    for i in range(config["rounds"] + 1):  # the first round is a warm-up
        with tempfile.TemporaryDirectory(dir=config["tmp"]) as d:
            if passes:
                os.makedirs(os.path.join(d, f"rank_{rank}"))
                _write(os.path.join(d, f"rank_{rank}"), size)
            timed = {}
            for what in ("copy", "report") if i % 2 else ("report", "copy"):
                train.collective.barrier()  # every rank starts together
                start = time.perf_counter()
                if what == "report":
                    train.report({"round": i}, checkpoint=train.Checkpoint.from_directory(d) if passes else None)
                elif passes:
                    shutil.copytree(d, os.path.join(config["tmp"], f"copy_{rank}_{i}"))
                timed[what] = time.perf_counter() - start
            shutil.rmtree(os.path.join(config["tmp"], f"copy_{rank}_{i}"), ignore_errors=True)
        rounds.append((timed["copy"], timed["report"]))
    return rounds[1:]


def run(layout: str, size: int, rounds: int, storage: str, tmp: str, name: str) -> list[tuple[float, float]]:
    """(copy seconds, report seconds) per round, of the slowest rank."""
    import ddptrain as train

    result = train.DataParallelTrainer(
        persist_loop,
        train_loop_config={"layout": layout, "size": size, "tmp": tmp, "rounds": rounds},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name=name, storage_path=storage),
    ).fit()
    per_round = zip(*result.return_values)
    return [(max(c for c, _ in ranks), max(r for _, r in ranks)) for ranks in per_round]


def main() -> None:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=4, quick_repeats=1)
    size = (40 if args.quick else 200) * MB
    rounds = 2 if args.quick else 6
    load = _bench.ForeignLoad()
    work = tempfile.mkdtemp(prefix="ddptrain_bench_ckpt_", dir=os.environ.get("DDPTRAIN_BENCH_DIR"))
    storage, tmp = os.path.join(work, "runs"), os.path.join(work, "tmp")
    os.makedirs(storage)
    os.makedirs(tmp)
    samples: dict[str, list[tuple[float, float]]] = {"rank0": [], "all_ranks": []}
    try:
        for repeat in range(args.repeats):
            for layout in ("rank0", "all_ranks") if repeat % 2 == 0 else ("all_ranks", "rank0"):
                samples[layout].extend(run(layout, size, rounds, storage, tmp, f"{layout}_{repeat}"))
                shutil.rmtree(os.path.join(storage, f"{layout}_{repeat}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = size / MB
    lines = []
    for layout, pairs in samples.items():
        copy_s = [c for c, _ in pairs]
        report_s = [r for _, r in pairs]
        copy_rate, report_rate = mb / _bench.median(copy_s), mb / _bench.median(report_s)
        _bench.emit(
            {
                "bench": BENCH,
                "metric": layout,
                "mb": mb,
                "copy_seconds": _bench.summary(copy_s),
                "report_seconds": _bench.summary(report_s),
                "copy_mb_per_s": round(copy_rate, 1),
                "report_mb_per_s": round(report_rate, 1),
                "ratio": round(report_rate / copy_rate, 3),
            }
        )
        lines.append(
            f"  {layout:<10} report() {report_rate:7.1f} MB/s, plain copy {copy_rate:7.1f} MB/s: "
            f"{report_rate / copy_rate:.2f}x (target >= 0.9x)"
        )
    _bench.emit({"bench": BENCH, "metric": "environment", "dir": work, **_bench.environment(), **load.result()})
    left = _bench.check_leftovers(BENCH)
    print(f"\n{BENCH}: {mb:.0f} MB checkpoint, 2 workers, medians of {args.repeats * rounds} rounds per layout")
    print("\n".join(lines))
    if left:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
