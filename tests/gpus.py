"""What the GPU test files share (test_gpu.py, test_gpu_processes.py): how many CUDA devices
this machine has, the skip marks that follow from it, and a ``use_gpu`` fit."""

from __future__ import annotations

import pytest
import torch

import ddptrain as train
from ddptrain.torch import TorchTrainer


def gpu_count() -> int:
    """The CUDA devices torch sees here (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_one_gpu = pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(gpu_count() < 2, reason="needs 2 CUDA GPUs")


def fit_gpu(fn, storage: str, num_workers: int, resources_per_worker: dict | None = None) -> list:
    """Fit ``fn`` on ``num_workers`` GPU workers in a run named ``gpu``; their return values."""
    trainer = TorchTrainer(
        fn,
        scaling_config=train.ScalingConfig(
            num_workers=num_workers, use_gpu=True, resources_per_worker=resources_per_worker
        ),
        run_config=train.RunConfig(name="gpu", storage_path=storage),
    )
    result = trainer.fit()
    assert len(result.return_values) == num_workers
    return result.return_values
