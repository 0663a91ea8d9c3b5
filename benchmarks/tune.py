"""A sweep of 8 small trials with ``ddptrain.tune`` against the sequential loop around ``fit()``.

Each trial is a 1-worker ``TorchTrainer`` fit of a small MLP (a few hundred SGD steps on
synthetic data) whose training function reports the ``time.time()`` of its first line.
Measured per repeat, in the same script on the same machine:

* ``sequential_s``: the baseline a user writes without a sweep layer: an Optuna study
  (``study.optimize(objective, n_trials=8)``, TPE with a seed) whose objective builds a
  trainer and calls ``fit()``; without Optuna installed, a plain loop over the same 8 values;
* ``sweep_s``: ``Tuner(trainer, param_space=..., TuneConfig(max_concurrent_trials=2,
  search_alg=OptunaSearch(seed=0)))``.fit()`` (grid search without Optuna), 2 trials at a time
  on 2 cores. Headline ratio: median(sweep_s) / median(sequential_s); target **<= 0.6x**.
* ``trial_overhead_s``: from the moment a sweep starts a trial to the first line of its
  training function (1-trial sweeps); baseline ``fit_first_line_s``: from just before a plain
  ``fit()`` of the same trainer to that first line. Three of each per repeat, alternating, so
  both see the same load. The difference is what the sweep layer adds to each trial.

    python benchmarks/tune.py [--repeats N] [--quick]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from typing import Any

import _bench

BENCH = "tune"


def train_func(config: dict[str, Any]) -> None:
    first_line = time.time()
    import torch

    import ddptrain as train

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    for epoch in range(config["epochs"]):
        for i in range(0, 256, 32):
            loss = torch.nn.functional.mse_loss(model(x[i : i + 32]), y[i : i + 32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        train.report({"loss": loss.item(), "epoch": epoch, "first_line": first_line})


def make_trainer(storage: str, name: str, lr: float, epochs: int) -> Any:
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    return TorchTrainer(
        train_func,
        train_loop_config={"lr": lr, "epochs": epochs},
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(storage_path=storage, name=name),
    )


def have_optuna() -> bool:
    try:
        import optuna  # noqa: F401
    except ImportError:
        return False
    return True


def plain_first_line(storage: str, name: str) -> float:
    """From just before a plain ``fit()`` (1 epoch) to the first line of its training function."""
    trainer = make_trainer(storage, name, 1e-2, 1)
    before = time.time()
    result = trainer.fit()
    return float(result.metrics_history[0]["first_line"] - before)


def sequential(storage: str, tag: str, trials: int, epochs: int) -> float:
    """The baseline: one fit() after another (inside an Optuna study when Optuna is installed)."""

    def objective_lr(lr: float, index: int) -> float:
        result = make_trainer(storage, f"{tag}_seq{index}", lr, epochs).fit()
        return float(result.metrics["loss"])

    start = time.perf_counter()
    if have_optuna():
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
        study.optimize(lambda t: objective_lr(t.suggest_float("lr", 1e-3, 1e-1, log=True), t.number), n_trials=trials)
    else:
        for index in range(trials):
            objective_lr(1e-3 * (1.5**index), index)
    return time.perf_counter() - start


def sweep(storage: str, name: str, trials: int, epochs: int, concurrent: int) -> tuple[float, list[float]]:
    from ddptrain import tune

    trainer = make_trainer(storage, name, 1e-2, epochs)
    if have_optuna():
        from ddptrain.tune.search.optuna import OptunaSearch

        space: dict[str, Any] = {"train_loop_config": {"lr": tune.loguniform(1e-3, 1e-1)}}
        config = tune.TuneConfig(
            metric="loss",
            mode="min",
            num_samples=trials,
            search_alg=OptunaSearch(seed=0),
            max_concurrent_trials=concurrent,
        )
    else:
        space = {"train_loop_config": {"lr": tune.grid_search([1e-3 * (1.5**i) for i in range(trials)])}}
        config = tune.TuneConfig(metric="loss", mode="min", max_concurrent_trials=concurrent)
    tuner = tune.Tuner(trainer, param_space=space, tune_config=config, run_config=tune.RunConfig(verbose=0))
    start = time.perf_counter()
    results = tuner.fit()
    elapsed = time.perf_counter() - start
    assert len(results) == trials and results.num_errors == 0, results.errors
    overheads = []
    for result in results:
        first = result.metrics_history[0]
        trial_start = first["timestamp"] - first["time_total_s"]
        overheads.append(first["first_line"] - trial_start)
    return elapsed, overheads


def main() -> int:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=3, quick_repeats=1)
    import ddptrain.tune  # noqa: F401  (imports torch: keep it out of the timings)

    trials = 4 if args.quick else 8
    epochs = 3
    env = _bench.environment()
    _bench.emit({"bench": BENCH, "metric": "environment", **env, "repeats": args.repeats, "optuna": have_optuna()})
    load = _bench.ForeignLoad()
    storage = tempfile.mkdtemp(prefix="ddptrain-bench-tune-")
    seq_s: list[float] = []
    sweep_s: list[float] = []
    fit_first: list[float] = []
    trial_overhead: list[float] = []
    try:
        make_trainer(storage, "warmup", 1e-2, 1).fit()  # page cache, first-use costs
        for repeat in range(args.repeats):
            order = ["sequential", "sweep"] if repeat % 2 == 0 else ["sweep", "sequential"]
            for task in order:
                window = _bench.ForeignLoad()
                if task == "sequential":
                    value = sequential(storage, f"r{repeat}", trials, epochs)
                    seq_s.append(value)
                    metric = "sequential_s"
                else:
                    value, _ = sweep(storage, f"sweep{repeat}", trials, epochs, concurrent=2)
                    sweep_s.append(value)
                    metric = "sweep_s"
                _bench.emit(
                    {
                        "bench": BENCH,
                        "metric": metric,
                        "trials": trials,
                        "repeat": repeat,
                        "value": value,
                        "foreign_cores": window.result()["foreign_cores"],
                    }
                )
            # Interleaved, so that both see the same load: a plain fit(), then a 1-trial sweep.
            window = _bench.ForeignLoad()
            firsts, overheads = [], []
            for i in range(3):
                firsts.append(plain_first_line(storage, f"plain{repeat}_{i}"))
                overheads.extend(sweep(storage, f"overhead{repeat}_{i}", 1, 1, concurrent=1)[1])
            fit_first.extend(firsts)
            trial_overhead.extend(overheads)
            foreign_cores = window.result()["foreign_cores"]
            for metric, values in (("fit_first_line_s", firsts), ("trial_overhead_s", overheads)):
                _bench.emit(
                    {
                        "bench": BENCH,
                        "metric": metric,
                        "repeat": repeat,
                        "values": values,
                        "foreign_cores": foreign_cores,
                    }
                )
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        left = _bench.check_leftovers(BENCH)

    foreign = load.result()
    _bench.emit({"bench": BENCH, "metric": "foreign_load", **foreign})
    stats = {
        "sequential_s": _bench.summary(seq_s),
        "sweep_s": _bench.summary(sweep_s),
        "fit_first_line_s": _bench.summary(fit_first),
        "trial_overhead_s": _bench.summary(trial_overhead),
    }
    for metric, st in stats.items():
        _bench.emit({"bench": BENCH, "metric": metric, "summary": True, **st})
    ratio = stats["sweep_s"]["median"] / stats["sequential_s"]["median"]
    per_repeat = [round(w / q, 3) for w, q in zip(sweep_s, seq_s, strict=True)]
    added = stats["trial_overhead_s"]["median"] - stats["fit_first_line_s"]["median"]
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "ratios",
            "sweep_vs_sequential": ratio,
            "per_repeat_ratios": per_repeat,
            "trial_overhead_minus_fit_first_line_s": added,
            "target_sweep_vs_sequential": 0.6,
            "meets_target": ratio <= 0.6,
        }
    )
    baseline = "Optuna study around fit()" if have_optuna() else "loop around fit()"
    print(
        "\n".join(
            [
                f"tune: machine {env['cpus']} CPUs, torch {env['torch']}, {args.repeats} repeats, medians",
                f"  {trials} trials, sequential {baseline}: {stats['sequential_s']['median']:.2f} s; "
                f"sweep, 2 at a time: {stats['sweep_s']['median']:.2f} s -> {ratio:.2f}x "
                f"(target <= 0.6x: {'met' if ratio <= 0.6 else 'NOT met'}; per repeat {per_repeat})",
                f"  first line of the training function: {stats['trial_overhead_s']['median']:.3f} s after the "
                f"sweep starts a trial, {stats['fit_first_line_s']['median']:.3f} s after a "
                f"plain fit() starts (the sweep adds {added * 1000:.0f} ms)",
                f"  leftover processes: {len(left)}; other processes kept {foreign['foreign_cores']:.2f} "
                f"of {env['cpus']} cores busy during the run",
            ]
        )
    )
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
