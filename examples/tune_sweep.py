"""Hyperparameter sweep of a TorchTrainer with ddptrain.tune (Ray Tune's Tuner API).

Each trial is a real 2-worker ``fit()`` of a small classifier; trials run two at a time
(each worker asks for half a CPU), ASHA stops the clearly bad learning rates at its rungs,
and the best trial's checkpoint is loaded at the end. Compared with Ray only the imports
changed (``ray.tune`` -> ``ddptrain.tune``, ``ray.train`` -> ``ddptrain``).

    python examples/tune_sweep.py --epochs 4 [--lrs 0.2,0.05,0.001,0.0001]
    python examples/tune_sweep.py --optuna --num-samples 6   # needs `pip install "ddptrain[tune]"`
"""

import argparse
import os
import tempfile

import torch

import ddptrain as train  # was: import ray.train
import ddptrain.torch  # was: import ray.train.torch
from ddptrain import tune  # was: from ray import tune


def make_data(num_samples: int = 512) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 16, generator=generator)
    y = (x[:, :4].sum(dim=1) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def train_func(config):
    model = ddptrain.torch.prepare_model(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"])
    loader = ddptrain.torch.prepare_data_loader(torch.utils.data.DataLoader(make_data(), batch_size=32, shuffle=True))
    for epoch in range(config["epochs"]):
        if train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        correct = total = 0
        for x, y in loader:
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            correct += (logits.argmax(dim=1) == y).sum().item()
            total += len(y)
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if train.get_context().get_world_rank() == 0:
                torch.save(model.state_dict(), os.path.join(d, "model.pt"))
                checkpoint = train.Checkpoint.from_directory(d)
            train.report({"loss": loss.item(), "accuracy": correct / total}, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--optuna", action="store_true", help="search with Optuna's TPE instead of a grid")
    parser.add_argument("--num-samples", type=int, default=6, help="trials with --optuna")
    parser.add_argument("--lrs", default="0.2,0.05,0.001,0.0001", help="the learning rates of the grid")
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()

    trainer = ddptrain.torch.TorchTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "momentum": 0.9},
        scaling_config=train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
    )
    if args.optuna:
        from ddptrain.tune.search.optuna import OptunaSearch  # was: from ray.tune.search.optuna import ...

        param_space = {"train_loop_config": {"lr": tune.loguniform(1e-4, 1.0)}}
        search = {"search_alg": OptunaSearch(seed=0), "num_samples": args.num_samples}
    else:
        param_space = {"train_loop_config": {"lr": tune.grid_search([float(lr) for lr in args.lrs.split(",")])}}
        search = {}
    tuner = tune.Tuner(
        trainer,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric="accuracy",
            mode="max",
            scheduler=tune.ASHAScheduler(max_t=args.epochs, grace_period=1, reduction_factor=2),
            max_concurrent_trials=2,
            **search,
        ),
        run_config=train.RunConfig(name="tune_sweep", storage_path=args.storage_path),
    )
    results = tuner.fit()

    best = results.get_best_result()
    print(f"best lr: {best.config['train_loop_config']['lr']}, accuracy {best.metrics['accuracy']:.3f}")
    for result in results:
        print(
            f"lr={result.config['train_loop_config']['lr']:<8g} epochs run: {len(result.metrics_history)}"
            f"  accuracy={result.metrics['accuracy']:.3f}" + ("  ERROR" if result.error else "")
        )
    with best.checkpoint.as_directory() as d:
        torch.load(os.path.join(d, "model.pt"))
    print(f"loaded the best checkpoint from {best.checkpoint.path}")


if __name__ == "__main__":
    main()
