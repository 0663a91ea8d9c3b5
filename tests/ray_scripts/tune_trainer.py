# A Ray Tune sweep of a Ray Train TorchTrainer, as Ray's docs write it; unmodified.
import ray.train
from ray import tune
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer


def train_func(config):
    for step in range(3):
        ray.train.report({"loss": config["lr"] * (3 - step), "step": step})


trainer = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=1))
tuner = tune.Tuner(
    trainer,
    param_space={"train_loop_config": {"lr": tune.grid_search([0.1, 0.01])}},
    tune_config=tune.TuneConfig(metric="loss", mode="min"),
)
results = tuner.fit()
best = results.get_best_result()
print("trials:", len(results), "errors:", results.num_errors)
print("best lr:", best.config["train_loop_config"]["lr"], "loss:", best.metrics["loss"])
