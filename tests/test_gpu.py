"""CUDA runs: nccl, one device per worker, model and batch placement, GPUs shared and split
between workers, a host list's ``gpus=``, JAX and Tune on GPUs.

How GPU workers start and end (CUDA in the driver and the user's modules, memory given back,
restarts, warm workers) is in ``test_gpu_processes.py``. Marked ``gpu`` and skipped unless
enough CUDA devices are visible (``tox -e gpu`` or ``pytest -m gpu`` on a GPU machine). They
run one at a time, also under ``-n`` (conftest.py).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from gpus import fit_gpu, gpu_count, needs_one_gpu, needs_two_gpus
from torch.utils.data import DataLoader, TensorDataset

import ddptrain as train
from ddptrain.torch import TorchTrainer, get_device, get_devices, prepare_data_loader, prepare_model

pytestmark = pytest.mark.gpu


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


def fsdp_sharing_func() -> dict:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fsdp_func()
    out["warned"] = any("whose process group uses 'gloo'" in str(w.message) for w in caught)
    return out


@needs_one_gpu
def test_fsdp_on_workers_sharing_a_gpu_warns_that_it_runs_over_gloo(storage: str) -> None:
    # Two ranks on one GPU get gloo (NCCL refuses them): FSDP is wrapped, and says so.
    values = fit_gpu(fsdp_sharing_func, storage, num_workers=2, resources_per_worker={"GPU": 0.5})
    assert [v["warned"] for v in values] == [True, True]
    assert {v["model_type"] for v in values} == {"FullyShardedDataParallel"}


def loader_func() -> dict:
    dataset = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    loader = prepare_data_loader(DataLoader(dataset, batch_size=32, num_workers=2, pin_memory=True))
    model = prepare_model(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    devices = set()
    for x, y in loader:
        devices.add(str(x.device))
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {"devices": sorted(devices), "loss": loss.item()}


@needs_one_gpu
def test_prepare_model_and_a_loader_with_pinned_memory_and_loader_workers(storage: str) -> None:
    (out,) = fit_gpu(loader_func, storage, num_workers=1)
    assert out["devices"] == ["cuda:0"]
    assert out["loss"] == out["loss"]  # not NaN


def amp_func() -> dict:
    model = prepare_model(torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 16, device=get_device())
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        out = model(x)
        loss = out.float().pow(2).mean()
    loss.backward()
    optimizer.step()
    return {"dtype": str(out.dtype), "finite": bool(torch.isfinite(loss).item())}


@needs_one_gpu
def test_autocast_bf16(storage: str) -> None:
    (out,) = fit_gpu(amp_func, storage, num_workers=1)
    assert out == {"dtype": "torch.bfloat16", "finite": True}


@needs_one_gpu
def test_more_gpu_workers_than_gpus_is_a_clear_error(storage: str) -> None:
    with pytest.raises(train.ConfigError, match=r"asks for \d+ GPU\(s\).*torch sees \d+"):
        fit_gpu(devices_func, storage, num_workers=gpu_count() + 1)


@needs_one_gpu
def test_two_workers_sharing_one_gpu_train_over_gloo(storage: str, caplog: pytest.LogCaptureFixture) -> None:
    # NCCL refuses two ranks on one GPU; half a GPU each makes the process group gloo's.
    rank0, rank1 = fit_gpu(gpu_train_func, storage, num_workers=2, resources_per_worker={"GPU": 0.5})
    assert rank0["backend"] == rank1["backend"] == "gloo"
    assert rank0["sum"] == rank1["sum"] == 3.0
    assert rank0["device"] == rank1["device"] == "cuda:0"
    assert rank0["grad_devices"] == ["cuda:0"]
    assert "workers share GPUs" in caplog.text


def returns_cuda_tensors() -> dict:
    model = torch.nn.Linear(4, 2).to(get_device())
    return {"state": model.state_dict(), "model": model}


@needs_one_gpu
def test_cuda_tensors_in_return_values_arrive_on_the_cpu(storage: str) -> None:
    (value,) = fit_gpu(returns_cuda_tensors, storage, num_workers=1)
    assert {str(t.device) for t in value["state"].values()} == {"cpu"}
    assert isinstance(value["model"].weight, torch.nn.Parameter) and value["model"].weight.device.type == "cpu"


# ----------------------------------------------------------------- a host list's `gpus=`
def _host_gpu_ids() -> list[int | str]:
    """This machine's GPU ids as a host list names them: those of ``CUDA_VISIBLE_DEVICES`` if
    set (indices, or ``GPU-...``/``MIG-...`` UUIDs, which a host list's ``gpus=`` takes too)."""
    from ddptrain.launch.hosts import visible_gpu_ids

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return list(range(gpu_count()))
    return visible_gpu_ids(visible)[: gpu_count()]


def gpus_seen() -> dict:
    import os

    x = torch.ones(2, device=get_device()) * 2
    return {
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "count": torch.cuda.device_count(),
        "device": str(x.device),
    }


@needs_one_gpu
def test_a_workers_gpu_is_the_one_its_host_lists(storage: str) -> None:
    last = _host_gpu_ids()[-1]
    result = TorchTrainer(
        gpus_seen,
        scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True, hosts=[f"localhost gpus={last}"]),
        run_config=train.RunConfig(storage_path=storage, worker_runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}),
    ).fit()
    assert result.return_values == [{"visible": str(last), "count": 1, "device": "cuda:0"}]


@needs_two_gpus
def test_gpu_trials_on_one_host_get_their_own_gpus(storage: str) -> None:
    from ddptrain import tune

    first, second = _host_gpu_ids()[:2]
    trainer = TorchTrainer(
        gpus_seen,
        scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True, hosts=[f"localhost gpus={first},{second}"]),
    )
    tuner = tune.Tuner(
        trainer,
        param_space={"train_loop_config": {"trial": tune.grid_search([0, 1, 2, 3])}},
        tune_config=tune.TuneConfig(total_cpus=1),
        run_config=train.RunConfig(name="gpus", storage_path=storage),
    )
    results = tuner.fit()
    assert results.num_errors == 0
    seen = [r.return_value for r in results]
    assert {s["visible"] for s in seen} <= {str(first), str(second)}
    assert all(s["count"] == 1 and s["device"] == "cuda:0" for s in seen)


def _gpu_uuids() -> list[str]:
    """This machine's GPU UUIDs, as nvidia-smi prints them (skips without nvidia-smi, or where
    ``CUDA_VISIBLE_DEVICES`` already picks GPUs: their UUIDs would not say which)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None or os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        pytest.skip("needs nvidia-smi and CUDA_VISIBLE_DEVICES unset")
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True, check=True
    ).stdout
    return [line.strip() for line in out.splitlines() if line.strip().startswith("GPU-")]


@needs_one_gpu
def test_a_sweep_whose_gpus_are_named_by_uuid_runs_its_trials_on_them(
    storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddptrain import tune

    uuid = _gpu_uuids()[-1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuid)  # as a scheduler may hand the sweep its GPU
    trainer = TorchTrainer(gpus_seen, scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True))
    results = tune.Tuner(
        trainer,
        param_space={"train_loop_config": {"trial": tune.grid_search([0, 1])}},
        tune_config=tune.TuneConfig(total_cpus=1),
        run_config=train.RunConfig(name="uuids", storage_path=storage),
    ).fit()
    assert results.num_errors == 0, results.errors
    assert [r.return_value for r in results] == [{"visible": uuid, "count": 1, "device": "cuda:0"}] * 2


def jax_on_gpu() -> dict:
    import jax
    import jax.numpy as jnp

    total = float(jax.jit(lambda a: (a * 2).sum())(jnp.arange(8.0)))
    return {
        "platforms": sorted({d.platform for d in jax.devices()}),
        "local_devices": len(jax.local_devices()),
        "total": total,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


@needs_one_gpu
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs `pip install ddptrain[jax]`")
def test_a_jax_worker_computes_on_its_own_gpu(storage: str) -> None:
    """JaxTrainer with use_gpu: jax.distributed on CUDA, the worker sees one GPU of its own."""
    from ddptrain.jax import JaxTrainer

    result = JaxTrainer(
        jax_on_gpu,
        scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True),
        run_config=train.RunConfig(name="jax-gpu", storage_path=storage),
    ).fit()
    (value,) = result.return_values
    assert value["platforms"] == ["gpu"] and value["local_devices"] == 1, value
    assert value["total"] == 56.0 and value["visible"] is not None and "," not in value["visible"], value


@needs_two_gpus
def test_fractional_workers_fill_one_gpu_before_the_next(storage: str) -> None:
    values = fit_gpu(devices_func, storage, num_workers=3, resources_per_worker={"GPU": 0.5})
    assert [v["device"] for v in values] == ["cuda:0", "cuda:0", "cuda:1"]


def metrics_with_a_cuda_tensor() -> None:
    train.report({"loss": torch.ones((), device=get_device())})


@needs_one_gpu
def test_a_cuda_tensor_in_metrics_is_refused_naming_it(storage: str) -> None:
    with pytest.raises(train.TrainingFailedError, match=r"metrics\['loss'\] is a torch.Tensor"):
        fit_gpu(metrics_with_a_cuda_tensor, storage, num_workers=1)


def jax_sharing() -> dict:
    import jax
    import jax.numpy as jnp

    total = float((jnp.arange(8.0) * 2).sum())
    stats = jax.local_devices()[0].memory_stats() or {}
    return {"total": total, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "limit": stats.get("bytes_limit")}


@needs_one_gpu
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs `pip install ddptrain[jax]`")
def test_two_jax_workers_share_one_gpu(storage: str) -> None:
    # Each JAX process takes 75% of its GPU's memory at its start unless told otherwise: two
    # workers at half a GPU each must still both start.
    from ddptrain.jax import JaxTrainer

    result = JaxTrainer(
        jax_sharing,
        scaling_config=train.ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 0.5}),
        run_config=train.RunConfig(name="jax-halves", storage_path=storage),
    ).fit()
    assert [v["total"] for v in result.return_values] == [56.0, 56.0]
    assert len({v["visible"] for v in result.return_values}) == 1  # the same GPU
    # Each took its share of JAX's default 75% (XLA_PYTHON_CLIENT_MEM_FRACTION=0.375), not 75%.
    gpu_bytes = _gpu_total_bytes()
    for value in result.return_values:
        if value["limit"] is not None and gpu_bytes:
            assert value["limit"] <= 0.4 * gpu_bytes, (value["limit"], gpu_bytes)


def _gpu_total_bytes() -> int:
    """The first visible GPU's memory, from nvidia-smi (0 without it): not through torch, which
    would start CUDA in the test process."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    out = subprocess.run([*query, f"--id={visible}"] if visible else query, capture_output=True, text=True)
    lines = out.stdout.split()
    return int(lines[0]) * 2**20 if out.returncode == 0 and lines and lines[0].isdigit() else 0
