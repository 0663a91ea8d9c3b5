# RaySGD's "Distributed PyTorch" guide (Ray 1.x), its snippets with Ray's imports unchanged.
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

import ray
from ray.tune.logger import pretty_print
from ray.util.sgd import TorchTrainer
from ray.util.sgd.torch import TrainingOperator
from ray.util.sgd.torch.examples.train_example import (
    LinearDataset,
    data_creator,
    model_creator,
    optimizer_creator,
    scheduler_creator,
)


class MyTrainingOperator(TrainingOperator):
    def setup(self, config):
        train_dataset, val_dataset = LinearDataset(2, 5), LinearDataset(2, 5)
        train_loader = DataLoader(train_dataset, batch_size=config["batch_size"])
        val_loader = DataLoader(val_dataset, batch_size=config["batch_size"])
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-4))
        criterion = torch.nn.BCELoss()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
        self.model, self.optimizer, self.criterion, self.scheduler = self.register(
            models=model, optimizers=optimizer, criterion=criterion, schedulers=scheduler
        )
        self.register_data(train_loader=train_loader, validation_loader=val_loader)


trainer = TorchTrainer(
    training_operator_cls=MyTrainingOperator,
    scheduler_step_freq="epoch",
    config={"lr": 0.001, "batch_size": 64},
)
print("guide operator batches:", trainer.apply_all_operators(lambda op: len(op.train_loader)))
trainer.shutdown()

# "Backwards Compatibility": the creators of train_example, as Ray 1.x defined them.
config = {"lr": 0.5, "batch_size": 50, "data_size": 200}
model = model_creator(config)
optimizer = optimizer_creator(model, config)
train_loader, val_loader = data_creator(config)
print("creators:", type(model).__name__, optimizer.param_groups[0]["lr"], len(train_loader), len(val_loader))
print("scheduler:", type(scheduler_creator(optimizer, config)).__name__)
print(pretty_print({"epoch": 1, "profile": {"mean_fwd_s": 0.5}, "config": {"lr": 0.1}}), end="")
