"""Training throughput with asynchronous validation (``ValidationConfig``) against the same
loop without validation, and the validation process's start time.

One worker (``torch.set_num_threads(1)``, pinned to CPU 0 with ``os.sched_setaffinity``) runs
a fixed-step loop (a 384x384 float32 matmul chain) and reports a small checkpoint every
``--every`` steps, two ways, in rotating order within each repeat:

* ``none``: ``report(..., checkpoint=...)``,
* ``validated``: the same with ``validation=True``: the trainer's validation function spins
  the CPU for as long as ``--every`` steps took in the warm-up (so one validation is busy
  while the next ``--every`` steps run), in the validation process pinned to CPU 1
  (``DDPTRAIN_VALIDATION_CPUS=1``, set by this script).

Throughput = steps / the loop's wall time (the checkpoint's local folder is written in both).
After each variant the loop waits (untimed) for its validations
(``get_all_reported_checkpoints()``, VALIDATED). Ratio (validated/none): median over the
repeats, each from one repeat (target >= 0.9x). The validation process's start: from the
driver's ``Popen`` to the first line of the validation function (``start_s``; logged per
validation), medians.

    python benchmarks/async_validation.py [--repeats N] [--quick] [--every 50] [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import _bench

BENCH = "async_validation"


def spin(checkpoint, seconds: float) -> dict:  # noqa: ANN001 (a ddptrain.Checkpoint)
    """The validation function: the first line's time, then ``seconds`` of CPU."""
    began = time.time()
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return {"validation_began": began, "spins": n}


def training_loop(config: dict) -> list[dict[str, float]]:
    import torch

    import ddptrain as train

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights = torch.randn(384, 384) / 20
    x = torch.randn(384, 384)
    variants = ["none", "validated"]
    results = []
    for repeat in range(config["repeats"] + 1):  # repeat 0 is a warm-up
        order = variants[repeat % 2 :] + variants[: repeat % 2]
        timed: dict[str, float] = {}
        for variant in order:
            start = time.perf_counter()
            for step in range(1, config["steps"] + 1):
                y = x
                for _ in range(8):
                    y = torch.tanh(y @ weights)
                if step % config["every"]:
                    continue
                d = tempfile.mkdtemp(prefix="ddptrain_bench_ckpt_")
                torch.save(y[:4].clone(), os.path.join(d, "state.pt"))
                train.report(
                    {"variant": variant, "step": step},
                    checkpoint=train.Checkpoint(d),
                    validation=variant == "validated" and repeat > 0,
                )
                shutil.rmtree(d)
            elapsed = time.perf_counter() - start
            timed[variant] = config["steps"] / elapsed
            train.get_all_reported_checkpoints()  # untimed: this variant's validations are done
        if repeat:
            results.append(timed)
        else:  # the warm-up sets how long a validation spins: as long as `every` steps took
            config["spin_s"] = config["every"] / timed["none"]
            train.report({"spin_s": config["spin_s"]})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--every", type=int, default=None, help="steps between checkpoints (50; --quick 25)")
    parser.add_argument("--steps", type=int, default=None, help="steps per variant (300; --quick 100)")
    args = parser.parse_args()
    config = {
        "every": args.every or (25 if args.quick else 50),
        "steps": args.steps or (100 if args.quick else 300),
        "repeats": args.repeats or (1 if args.quick else 3),
    }
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 CPUs: the worker on CPU 0, the validation on CPU 1")
    os.environ["DDPTRAIN_VALIDATION_CPUS"] = "1"
    load = _bench.ForeignLoad()
    storage = tempfile.mkdtemp(prefix="ddptrain_bench_validation_")

    import ddptrain as train

    # The spin time is set by the warm-up in the worker: the validation function reads it
    # from the run's metrics (the worker's one metrics-only report), through a file here.
    spin_file = os.path.join(storage, "spin_s")

    def validate(checkpoint) -> dict:  # noqa: ANN001
        with open(spin_file) as f:
            return spin(checkpoint, float(f.read()))

    class Spin(train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint) -> None:  # noqa: ANN001
            if "spin_s" in metrics[0]:
                with open(spin_file, "w") as f:
                    f.write(str(metrics[0]["spin_s"]))

    try:
        result = train.DataParallelTrainer(
            training_loop,
            train_loop_config=config,
            scaling_config=train.ScalingConfig(num_workers=1),
            validation_config=train.ValidationConfig(validate),
            run_config=train.RunConfig(
                name="async_validation",
                storage_path=storage,
                checkpoint_config=train.CheckpointConfig(num_to_keep=1),
                callbacks=[Spin()],
            ),
        ).fit()
        rows: list[dict[str, float]] = result.return_value
        starts = _validation_starts(os.path.join(storage, "async_validation"))
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    ratio = _bench.median([r["validated"] / r["none"] for r in rows])
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "throughput_ratio",
            **config,
            "steps_per_s": {v: _bench.summary([r[v] for r in rows]) for v in ("none", "validated")},
            "validated_vs_none": round(ratio, 3),
            "validation_start_s": _bench.summary(starts),
        }
    )
    _bench.emit({"bench": BENCH, "metric": "environment", **_bench.environment(), **load.result()})
    left = _bench.check_leftovers(BENCH)
    print(
        f"\n{BENCH}: a checkpoint every {config['every']} steps, each validated for as long as "
        f"{config['every']} steps take; medians of {len(rows)} repeats"
    )
    print(f"  with validation {ratio:.2f}x the loop without (target >= 0.9x)")
    print(f"  validation process start (Popen to the function's first line): {_bench.median(starts):.2f} s")
    if left:
        raise SystemExit(1)


def _validation_starts(run_dir: str) -> list[float]:
    """Each validation's start: from its process's start (``started`` in its line of
    ``metrics.jsonl``) to the function's first line (its metric ``validation_began``)."""
    from ddptrain.storage.metrics import iter_validation_lines

    starts = []
    for line in iter_validation_lines(run_dir):
        validation = line["validation"]
        began, started = validation["metrics"].get("validation_began"), validation.get("started")
        if began is not None and started is not None:
            starts.append(began - started)
    return starts


if __name__ == "__main__":
    main()
