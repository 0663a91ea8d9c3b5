"""XGBoost ``hist`` rounds/s: ``XGBoostTrainer`` against plain XGBoost, with and without its tracker.

The same boosting (binary logistic, ``tree_method="hist"``, depth 6, 256 bins, one validation
set evaluated every round, synthetic data) runs three ways:

* (a) ``ddptrain``: ``XGBoostTrainer`` with 2 workers, 1 thread each, each on half the rows
  (its dataset shard) and half the validation rows, with ``RayTrainReportCallback`` reporting
  the metrics of every round (no checkpoints);
* (b) ``single``: ``xgboost.train`` in one process on all rows with ``nthread=2``, the same
  total number of threads;
* (c) ``rabit``: 2 worker processes of this script under XGBoost's own ``RabitTracker``,
  started by hand here, 1 thread each, each on half the rows: the distributed baseline.

Measured: ``rounds_per_s``, timed rounds over the time from the end of the last warm-up round
to the end of the last timed round, on the slowest rank. The order of the variants rotates
across repeats. Ratios: median(a) / median(b) and median(a) / median(c).

    python benchmarks/xgboost.py [--repeats N] [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import _bench

# This script's name shadows the `xgboost` package: take its folder off the import path (after
# `_bench` is imported from it), here and in the workers, which get the driver's path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import numpy as np  # noqa: E402
import xgboost  # noqa: E402

BENCH = "xgboost"
WORLD = 2
FEATURES = 32
PARAMS = {"objective": "binary:logistic", "tree_method": "hist", "max_depth": 6, "max_bin": 256, "eta": 0.1}
_CHILD_VAR = "DDPTRAIN_BENCH_XGBOOST_CHILD"  # set in the hand-launched rabit workers: their settings


def make_data(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    logit = x[:, 0] + x[:, 1] * x[:, 2] - np.abs(x[:, 3]) + np.sin(2 * x[:, 4])
    y = (logit + 0.5 * rng.normal(size=rows) > 0).astype("float32")
    return x, y


class RoundClock(xgboost.callback.TrainingCallback):
    """The time at the end of every round."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: list[float] = []

    def after_iteration(self, model: Any, epoch: int, evals_log: Any) -> bool:
        self.ends.append(time.perf_counter())
        return False


def boost(config: dict[str, Any], dtrain: Any, dvalid: Any, nthread: int, callbacks: list[Any]) -> list[float]:
    clock = RoundClock()
    xgboost.train(
        {**PARAMS, "nthread": nthread},
        dtrain,
        num_boost_round=config["warmup"] + config["rounds"],
        evals=[(dvalid, "valid")],
        verbose_eval=False,
        callbacks=[*callbacks, clock],
    )
    return clock.ends


def rate(config: dict[str, Any], ends_per_rank: list[list[float]]) -> float:
    """Timed rounds per second on the slowest rank."""
    warmup, rounds = config["warmup"], config["rounds"]
    return min(rounds / (ends[warmup + rounds - 1] - ends[warmup - 1]) for ends in ends_per_rank)


# ----------------------------------------------------------------- (a) XGBoostTrainer
def ddptrain_train_fn(config: dict[str, Any]) -> list[float]:
    import ddptrain
    from ddptrain.xgboost import RayTrainReportCallback

    def dmatrix(name: str) -> Any:
        df = ddptrain.get_dataset_shard(name).materialize().to_pandas()
        return xgboost.DMatrix(df.drop(columns="y").to_numpy(), label=df["y"].to_numpy())

    return boost(config, dmatrix("train"), dmatrix("valid"), 1, [RayTrainReportCallback(frequency=0)])


def run_ddptrain(config: dict[str, Any], storage: str, name: str) -> float:
    import ddptrain
    from ddptrain.xgboost import XGBoostTrainer

    def dataset(x: np.ndarray, y: np.ndarray) -> Any:
        return ddptrain.data.from_numpy({**{f"f{i}": x[:, i] for i in range(FEATURES)}, "y": y})

    result = XGBoostTrainer(
        ddptrain_train_fn,
        train_loop_config=config,
        datasets={
            "train": dataset(*make_data(config["rows"], 0)),
            "valid": dataset(*make_data(config["rows"] // 4, 1)),
        },
        scaling_config=ddptrain.ScalingConfig(num_workers=WORLD),
        run_config=ddptrain.RunConfig(name=name, storage_path=storage),
    ).fit()
    return rate(config, result.return_values)


# ----------------------------------------------------------------- (b) one process
def run_single(config: dict[str, Any]) -> float:
    x, y = make_data(config["rows"], 0)
    xv, yv = make_data(config["rows"] // 4, 1)
    ends = boost(config, xgboost.DMatrix(x, label=y), xgboost.DMatrix(xv, label=yv), WORLD, [])
    return rate(config, [ends])


# ----------------------------------------------------------------- (c) RabitTracker by hand
def rabit_child(settings: dict[str, Any]) -> None:
    """A hand-launched worker: its half of the rows, the collective, the same boosting."""
    from xgboost import collective

    config, rank = settings["config"], settings["rank"]
    x, y = make_data(config["rows"], 0)
    xv, yv = make_data(config["rows"] // 4, 1)
    part, vpart = len(x) // WORLD, len(xv) // WORLD
    rows, vrows = slice(rank * part, (rank + 1) * part), slice(rank * vpart, (rank + 1) * vpart)
    dtrain, dvalid = xgboost.DMatrix(x[rows], label=y[rows]), xgboost.DMatrix(xv[vrows], label=yv[vrows])
    with collective.CommunicatorContext(**settings["tracker"], dmlc_task_id=f"{rank:04d}"):
        ends = boost(config, dtrain, dvalid, 1, [])
    with open(settings["out"], "w") as f:
        json.dump(ends, f)


def run_rabit(config: dict[str, Any], folder: str) -> float:
    from xgboost.tracker import RabitTracker

    tracker = RabitTracker(n_workers=WORLD, host_ip="127.0.0.1", sortby="task")
    tracker.start()
    args = {"dmlc_communicator": "rabit", **tracker.worker_args()}
    outs = [os.path.join(folder, f"rabit_rank{rank}.json") for rank in range(WORLD)]
    children = []
    try:
        for rank in range(WORLD):
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                _CHILD_VAR: json.dumps({"config": config, "rank": rank, "tracker": args, "out": outs[rank]}),
            }
            children.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env))
        for child in children:
            if child.wait(timeout=600) != 0:
                raise RuntimeError(f"a rabit worker exited with code {child.returncode}")
        tracker.wait_for(timeout=60)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    ends_per_rank = []
    for out in outs:
        with open(out) as f:
            ends_per_rank.append(json.load(f))
    return rate(config, ends_per_rank)


def main() -> int:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=5, quick_repeats=1)
    config = {
        "rows": 20_000 if args.quick else 200_000,
        "warmup": 3 if args.quick else 5,
        "rounds": 10 if args.quick else 40,
    }
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ddptrain  # noqa: F401

    env = _bench.environment()
    env["xgboost"] = xgboost.__version__
    _bench.emit({"bench": BENCH, "metric": "environment", **env, "repeats": args.repeats, "processes": WORLD, **config})
    load = _bench.ForeignLoad()
    variants = ["ddptrain", "single", "rabit"]
    measured: dict[str, list[float]] = {v: [] for v in variants}
    folder = tempfile.mkdtemp(prefix="ddptrain-bench-xgboost-")
    try:
        for repeat in range(args.repeats):
            order = variants[repeat % 3 :] + variants[: repeat % 3]
            for variant in order:
                window = _bench.ForeignLoad()
                if variant == "ddptrain":
                    value = run_ddptrain(config, folder, f"run{repeat}")
                elif variant == "single":
                    value = run_single(config)
                else:
                    value = run_rabit(config, folder)
                measured[variant].append(value)
                _bench.emit(
                    {
                        "bench": BENCH,
                        "metric": "rounds_per_s",
                        "variant": variant,
                        "repeat": repeat,
                        "position": order.index(variant),
                        "value": value,
                        **window.result(),
                    }
                )
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        left = _bench.check_leftovers(BENCH)

    _bench.emit({"bench": BENCH, "metric": "foreign_load", **load.result()})
    stats = {variant: _bench.summary(values) for variant, values in measured.items()}
    for variant, st in stats.items():
        _bench.emit({"bench": BENCH, "metric": "rounds_per_s", "variant": variant, "summary": True, **st})
    over_single = stats["ddptrain"]["median"] / stats["single"]["median"]
    over_rabit = stats["ddptrain"]["median"] / stats["rabit"]["median"]
    _bench.emit(
        {"bench": BENCH, "metric": "ratios", "ddptrain_over_single": over_single, "ddptrain_over_rabit": over_rabit}
    )
    labels = {
        "ddptrain": "(a) XGBoostTrainer, 2 workers x 1 thread",
        "single": "(b) xgboost.train, 1 process x 2 threads",
        "rabit": "(c) RabitTracker by hand, 2 processes x 1 thread",
    }
    lines = [
        f"xgboost: hist, depth 6, {config['rows']:,} rows x {FEATURES} features "
        f"(+ {config['rows'] // 4:,} validation), "
        f"{config['rounds']} timed rounds after {config['warmup']}, {args.repeats} repeats, medians "
        f"({env['cpus']} CPUs, xgboost {env['xgboost']})",
    ]
    for variant, label in labels.items():
        st = stats[variant]
        lines.append(f"  {label}: {st['median']:.2f} rounds/s (min {st['min']:.2f}, max {st['max']:.2f})")
    lines.append(f"  ratio (a)/(b) {over_single:.3f}, (a)/(c) {over_rabit:.3f}")
    print("\n".join(lines), file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    child = os.environ.pop(_CHILD_VAR, None)
    if child is not None:
        rabit_child(json.loads(child))
    else:
        sys.exit(main())
