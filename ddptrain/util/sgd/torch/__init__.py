"""RaySGD for PyTorch: ``TorchTrainer`` (driver) and ``TrainingOperator`` (worker side)."""

from ddptrain.util.sgd.torch.torch_trainer import BaseTorchTrainable, TorchTrainer
from ddptrain.util.sgd.torch.training_operator import TrainingOperator

__all__ = ["BaseTorchTrainable", "TorchTrainer", "TrainingOperator"]
