"""Lightning training under ``TorchTrainer`` against Lightning's own DDP launcher.

The same LightningModule (an MLP, 32 features -> 256 hidden -> 10 classes, batch 64 per
process, SGD, one thread per process, synthetic data) is fitted on 2 CPU processes (gloo)

* (a) inside ``TorchTrainer`` with ``ScalingConfig(num_workers=2)``, ``RayDDPStrategy``,
  ``RayLightningEnvironment``, ``devices="auto"`` and ``prepare_trainer``;
* (b) by Lightning alone: ``Trainer(strategy="ddp", devices=2, accelerator="cpu")`` in a
  child process of this script, which starts the second rank by running this script again
  (Lightning's ``_SubprocessScriptLauncher``).

Measured per fit:

* ``samples_per_s``: ``processes * batch * steps / slowest rank's time`` over the timed steps,
  which start at a barrier after the warm-up steps and end with the last step;
* ``first_step_s``: from right before ``fit()`` (``TorchTrainer.fit()`` in the driver for (a),
  ``Trainer.fit()`` in the launching rank for (b)) to the start of the first training step on
  the latest rank. (a) also builds the ``Trainer`` in this time, in the worker; (b) built it
  before. Both processes had already imported torch and Lightning when the clock starts.

The order of (a) and (b) alternates across repeats. Ratios: median(a) / median(b), the
issue's target for samples/s being >= 0.97.

    python benchmarks/lightning.py [--repeats N] [--quick]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import _bench

# This script's name shadows the `lightning` package: take its folder off the import path
# (after `_bench` is imported from it), here and in the workers, which get the driver's path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

# Imported here, as a user script does: the ddptrain agent then imports Lightning once, when it
# loads the training function, and its forked workers share it.
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from ddptrain.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer  # noqa: E402

BENCH = "lightning"
WORLD = 2
BATCH = 64
_CHILD_VAR = "DDPTRAIN_BENCH_LIGHTNING_OUT"  # set in the Lightning-launcher child: its output folder


def make_module():
    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(1234)
    return MLP()


def make_loader(config: dict):
    steps = config["warmup"] + config["steps"]
    generator = torch.Generator().manual_seed(1234)
    rows = steps * BATCH * WORLD
    data = torch.utils.data.TensorDataset(
        torch.randn(rows, 32, generator=generator), torch.randint(0, 10, (rows,), generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=BATCH)  # Lightning adds the DistributedSampler


def make_timing(config: dict, record: dict):
    class Timing(pl.Callback):
        """Records the first step's start and times the steps after the warm-up."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                record["first_step_at"] = time.time()
            if batch_idx == config["warmup"]:
                trainer.strategy.barrier()
                record["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == config["warmup"] + config["steps"] - 1:
                record["timed_s"] = time.perf_counter() - record.pop("start")
                record["steps"] = config["steps"]

    return Timing()


def _trainer_kwargs(config: dict) -> dict:
    return {
        "max_epochs": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
    }


# ----------------------------------------------------------------------------- (a) ddptrain
def ddptrain_train_fn(config: dict) -> dict:
    torch.set_num_threads(1)
    record: dict = {}
    trainer = pl.Trainer(
        devices="auto",
        accelerator="cpu",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=[make_timing(config, record)],
        **_trainer_kwargs(config),
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(make_module(), train_dataloaders=make_loader(config))
    return record


def run_ddptrain(config: dict, storage: str, name: str) -> tuple[float, list[dict]]:
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    trainer = TorchTrainer(
        ddptrain_train_fn,
        train_loop_config=config,
        scaling_config=train.ScalingConfig(num_workers=WORLD),
        run_config=train.RunConfig(storage_path=storage, name=name),
    )
    before = time.time()
    return before, list(trainer.fit().return_values)


# ----------------------------------------------------------------------------- (b) Lightning alone
def lightning_child(out_dir: str) -> None:
    """Runs in the child (rank 0) and, started again by Lightning, as rank 1."""
    torch.set_num_threads(1)
    config = json.loads(os.environ["DDPTRAIN_BENCH_LIGHTNING_CONFIG"])
    record: dict = {}
    trainer = pl.Trainer(
        devices=WORLD,
        accelerator="cpu",
        strategy="ddp",
        callbacks=[make_timing(config, record)],
        **_trainer_kwargs(config),
    )
    module, loader = make_module(), make_loader(config)
    before = time.time()
    trainer.fit(module, train_dataloaders=loader)
    record["before"] = before
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(record, f)


def run_lightning(config: dict) -> tuple[float, list[dict]]:
    out_dir = tempfile.mkdtemp(prefix="ddptrain-bench-lightning-")
    try:
        env = {**os.environ, _CHILD_VAR: out_dir, "DDPTRAIN_BENCH_LIGHTNING_CONFIG": json.dumps(config)}
        env.setdefault("OMP_NUM_THREADS", "1")
        subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, check=True, stdout=subprocess.DEVNULL)
        per_rank = []
        for rank in range(WORLD):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
        return per_rank[0]["before"], per_rank
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def measure(before: float, per_rank: list[dict]) -> tuple[float, float]:
    """(samples/s of all processes over the timed steps, seconds from fit() to the last rank's first step)."""
    samples = sum(r["steps"] * BATCH for r in per_rank)
    return samples / max(r["timed_s"] for r in per_rank), max(r["first_step_at"] for r in per_rank) - before


def main() -> int:
    args = _bench.parse_args(__doc__.splitlines()[0], default_repeats=4, quick_repeats=1)
    config = {"steps": 100 if args.quick else 600, "warmup": 10 if args.quick else 30}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ddptrain  # noqa: F401

    env = _bench.environment()
    env["lightning"] = pl.__version__
    _bench.emit({"bench": BENCH, "metric": "environment", **env, "repeats": args.repeats, "processes": WORLD, **config})
    load = _bench.ForeignLoad()
    storage = tempfile.mkdtemp(prefix="ddptrain-bench-lightning-")
    measured: dict[str, dict[str, list[float]]] = {
        v: {"samples_per_s": [], "first_step_s": []} for v in ("ddptrain", "lightning")
    }
    try:
        for repeat in range(args.repeats):
            order = ["ddptrain", "lightning"] if repeat % 2 == 0 else ["lightning", "ddptrain"]
            for variant in order:
                window = _bench.ForeignLoad()
                if variant == "ddptrain":
                    before, per_rank = run_ddptrain(config, storage, f"run{repeat}")
                else:
                    before, per_rank = run_lightning(config)
                rate, first_step = measure(before, per_rank)
                measured[variant]["samples_per_s"].append(rate)
                measured[variant]["first_step_s"].append(first_step)
                for metric, value in (("samples_per_s", rate), ("first_step_s", first_step)):
                    _bench.emit(
                        {
                            "bench": BENCH,
                            "metric": metric,
                            "variant": variant,
                            "repeat": repeat,
                            "position": order.index(variant),
                            "value": value,
                            **window.result(),
                        }
                    )
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        left = _bench.check_leftovers(BENCH)

    foreign = load.result()
    _bench.emit({"bench": BENCH, "metric": "foreign_load", **foreign})
    stats = {
        (variant, metric): _bench.summary(values)
        for variant, metrics in measured.items()
        for metric, values in metrics.items()
    }
    for (variant, metric), st in stats.items():
        _bench.emit({"bench": BENCH, "metric": metric, "variant": variant, "summary": True, **st})
    rate_ratio = stats["ddptrain", "samples_per_s"]["median"] / stats["lightning", "samples_per_s"]["median"]
    start_ratio = stats["ddptrain", "first_step_s"]["median"] / stats["lightning", "first_step_s"]["median"]
    paired = [a / b for a, b in zip(measured["ddptrain"]["samples_per_s"], measured["lightning"]["samples_per_s"])]
    _bench.emit(
        {
            "bench": BENCH,
            "metric": "ratio_ddptrain_over_lightning",
            "samples_per_s": rate_ratio,
            "samples_per_s_paired_median": _bench.median(paired),
            "paired": paired,
            "first_step_s": start_ratio,
            "target_samples_per_s": 0.97,
            "meets_target": rate_ratio >= 0.97,
        }
    )

    def line(variant: str, label: str) -> str:
        rate, start = stats[variant, "samples_per_s"], stats[variant, "first_step_s"]
        return (
            f"  {label} {rate['median']:,.0f} samples/s (min {rate['min']:,.0f}, max {rate['max']:,.0f}); "
            f"fit() to first step {start['median']:.2f} s (min {start['min']:.2f}, max {start['max']:.2f})"
        )

    print(
        "\n".join(
            [
                f"lightning: MLP 32-256-10, batch {BATCH} x {WORLD} processes, {config['steps']} timed steps after "
                f"{config['warmup']} warm-up, {args.repeats} repeats, medians ({env['cpus']} CPUs, torch "
                f"{env['torch']}, lightning {env['lightning']})",
                line("ddptrain", "ddptrain TorchTrainer + RayDDPStrategy:"),
                line("lightning", "Lightning strategy='ddp', devices=2:  "),
                f"  ratio ddptrain/Lightning: samples/s {rate_ratio:.3f} (target >= 0.97: "
                f"{'met' if rate_ratio >= 0.97 else 'NOT met'}; per-repeat median {_bench.median(paired):.3f}), "
                f"time to first step {start_ratio:.2f}x",
                f"  leftover processes: {len(left)}; other processes kept {foreign['foreign_cores']:.2f} "
                f"of {env['cpus']} cores busy during the run",
            ]
        )
    )
    return 1 if left else 0


if __name__ == "__main__":
    if os.environ.get(_CHILD_VAR):
        lightning_child(os.environ[_CHILD_VAR])
        sys.exit(0)
    sys.exit(main())
