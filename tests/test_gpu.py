"""CUDA runs: nccl, one device per worker, model and batch placement.

Marked ``gpu`` and skipped unless enough CUDA devices are visible (``tox -e gpu`` or
``pytest -m gpu`` on a GPU machine).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ddptrain as train
from ddptrain.torch import TorchTrainer, get_device, get_devices, prepare_data_loader, prepare_model


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_one_gpu = pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs")

pytestmark = pytest.mark.gpu


def fit_gpu(fn, storage: str, num_workers: int, resources_per_worker: dict | None = None) -> list:
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


def gpu_train_func() -> dict:
    import torch.distributed as dist

    rank = train.get_context().get_world_rank()
    device = get_device()
    total = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(total)

    model = prepare_model(torch.nn.Linear(4, 2))
    param_devices = sorted({str(p.device) for p in model.parameters()})
    x = torch.randn(8, 4, device=device)
    model(x).sum().backward()
    grad_devices = sorted({str(p.grad.device) for p in model.parameters()})

    loader = prepare_data_loader(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
    batch_devices = sorted({str(t.device) for batch in loader for t in batch})
    return {
        "backend": dist.get_backend(),
        "sum": total.item(),
        "sum_device": str(total.device),
        "device": str(device),
        "devices": [str(d) for d in get_devices()],
        "current_device": torch.cuda.current_device(),
        "model_type": type(model).__name__,
        "device_ids": getattr(model, "device_ids", None),
        "output_device": getattr(model, "output_device", None),
        "param_devices": param_devices,
        "grad_devices": grad_devices,
        "batch_devices": batch_devices,
    }


@needs_two_gpus
def test_two_workers_one_gpu_each(storage: str) -> None:
    values = fit_gpu(gpu_train_func, storage, num_workers=2)
    for rank, out in enumerate(values):
        cuda = f"cuda:{rank}"
        assert out["backend"] == "nccl"
        assert out["sum"] == 3.0
        assert out["sum_device"] == cuda
        assert out["device"] == cuda
        assert out["devices"] == [cuda]
        assert out["current_device"] == rank
        assert out["model_type"] == "DistributedDataParallel"
        assert out["device_ids"] == [rank]
        assert out["output_device"] == rank
        assert out["param_devices"] == [cuda]
        assert out["grad_devices"] == [cuda]
        assert out["batch_devices"] == [cuda]
    assert len({out["device"] for out in values}) == 2


@needs_one_gpu
def test_one_worker_on_a_gpu(storage: str) -> None:
    (out,) = fit_gpu(gpu_train_func, storage, num_workers=1)
    assert out["backend"] == "nccl"
    assert out["sum"] == 1.0
    assert out["device"] == "cuda:0"
    assert out["devices"] == ["cuda:0"]
    assert out["current_device"] == 0
    assert out["model_type"] == "Linear"  # a single worker is not wrapped
    assert out["param_devices"] == ["cuda:0"]
    assert out["batch_devices"] == ["cuda:0"]


def devices_func() -> dict:
    return {
        "devices": [str(d) for d in get_devices()],
        "device": str(get_device()),
        "current_device": torch.cuda.current_device(),
    }


@needs_two_gpus
def test_two_gpus_per_worker(storage: str) -> None:
    (out,) = fit_gpu(devices_func, storage, num_workers=1, resources_per_worker={"GPU": 2})
    assert out == {"devices": ["cuda:0", "cuda:1"], "device": "cuda:0", "current_device": 0}


def fsdp_func() -> dict:
    model = prepare_model(torch.nn.Linear(4, 2), parallel_strategy="fsdp")
    return {
        "model_type": type(model).__name__,
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
    }


@needs_two_gpus
def test_fsdp_wraps_on_two_gpus(storage: str) -> None:
    values = fit_gpu(fsdp_func, storage, num_workers=2)
    for rank, out in enumerate(values):
        assert out == {"model_type": "FullyShardedDataParallel", "param_devices": [f"cuda:{rank}"]}
