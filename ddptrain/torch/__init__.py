"""PyTorch support: ``TorchTrainer`` and the helpers used inside the training function."""

from ddptrain.torch.config import TorchConfig
from ddptrain.torch.torch_trainer import TorchTrainer
from ddptrain.torch.train_loop_utils import (
    enable_reproducibility,
    get_device,
    get_devices,
    prepare_data_loader,
    prepare_model,
)

__all__ = [
    "TorchTrainer",
    "TorchConfig",
    "get_device",
    "get_devices",
    "prepare_model",
    "prepare_data_loader",
    "enable_reproducibility",
]
