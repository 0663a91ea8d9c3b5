"""CUDA runs: nccl, one device per worker, model and batch placement.

Marked ``gpu`` and skipped unless enough CUDA devices are visible (``tox -e gpu`` or
``pytest -m gpu`` on a GPU machine). They run one at a time, also under ``-n`` (conftest.py).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

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


# ----------------------------------------------------------------- how GPU workers start
# Workers that use CUDA must not be forked from a process in which CUDA was touched or the
# user's code ran (issue: "Cannot re-initialize CUDA in forked subprocess").

CUDA_MODULE = """
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # real code does this


def train_func():
    import ddptrain.torch

    x = torch.ones(4, device=ddptrain.torch.get_device())
    return {"device": str(x.device), "sum": x.sum().item(), "module_device": str(DEVICE)}
"""


@needs_one_gpu
def test_a_function_from_a_module_that_queries_cuda_at_import(storage: str, tmp_path, monkeypatch) -> None:
    import sys

    (tmp_path / "cuda_user_module.py").write_text(CUDA_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import cuda_user_module

    try:
        (out,) = fit_gpu(cuda_user_module.train_func, storage, num_workers=1)
    finally:
        sys.modules.pop("cuda_user_module", None)
    assert out == {"device": "cuda:0", "sum": 4.0, "module_device": "cuda"}


MAIN_SCRIPT = """
import torch
import ddptrain as train
from ddptrain.torch import TorchTrainer, get_device

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def train_func():
    return str((torch.ones(2, device=get_device()) * 2).device)


if __name__ == "__main__":
    import sys

    result = TorchTrainer(
        train_func,
        scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True),
        run_config=train.RunConfig(storage_path=sys.argv[1]),
    ).fit()
    print("RESULT", result.return_values)
"""


@needs_one_gpu
def test_a_function_defined_in_main(storage: str, tmp_path) -> None:
    import subprocess
    import sys

    script = tmp_path / "gpu_main.py"
    script.write_text(MAIN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), storage], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT ['cuda:0']" in proc.stdout
    assert "multi-threaded" not in proc.stderr  # no fork from a process with threads


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


def crash_once_func() -> dict:
    import os
    import tempfile

    ckpt = train.get_checkpoint()
    start = 0
    if ckpt is not None:
        with ckpt.as_directory() as d:
            start = torch.load(os.path.join(d, "state.pt"), map_location=get_device())["step"].item() + 1
    for step in range(start, 4):
        state = {"step": torch.tensor(step, device=get_device())}
        with tempfile.TemporaryDirectory() as d:
            torch.save(state, os.path.join(d, "state.pt"))
            train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(d))
        if step == 1 and train.get_context().get_world_rank() == 0 and ckpt is None:
            os._exit(7)  # a crash after the second checkpoint
    return {"started_at": start, "device": str(get_device())}


@needs_one_gpu
def test_a_crashed_gpu_worker_restarts_from_its_checkpoint(storage: str) -> None:
    result = TorchTrainer(
        crash_once_func,
        scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True),
        run_config=train.RunConfig(storage_path=storage, failure_config=train.FailureConfig(max_failures=1)),
    ).fit()
    assert result.return_values == [{"started_at": 2, "device": "cuda:0"}]
    assert [m["step"] for m in result.metrics_history] == [0, 1, 2, 3]


def _nvidia_smi(query: str) -> list[int]:
    import subprocess

    out = subprocess.run(
        ["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True
    ).stdout
    return [int(line) for line in out.split() if line.strip().isdigit()]


def _gpu_pids() -> set[int]:
    return set(_nvidia_smi("compute-apps=pid"))


def _gpu_used_mib() -> int:
    """Memory in use on every GPU nvidia-smi shows (it ignores ``CUDA_VISIBLE_DEVICES``)."""
    return sum(_nvidia_smi("gpu=memory.used"))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def hold_gpu_memory(config: dict) -> dict:
    import os

    held = torch.empty(256 * 2**20, dtype=torch.uint8, device=get_device())  # 256 MiB
    torch.cuda.synchronize()
    seen = {"pid": os.getpid(), "listed": None, "used_mib": None}
    if config["smi"]:  # what nvidia-smi shows of this worker while it holds the memory
        seen["listed"] = os.getpid() in _gpu_pids()  # not in a container: its pids are the host's
        seen["used_mib"] = _gpu_used_mib()
    del held
    return seen


@needs_one_gpu
def test_gpu_memory_is_released_after_fit(storage: str) -> None:
    # GPU tests run one at a time (conftest.py), so the machine's GPU memory changes only by
    # this test's run; its worker's pid says whether nvidia-smi sees this run at all.
    import shutil
    import time

    smi = shutil.which("nvidia-smi") is not None
    used_before = _gpu_used_mib() if smi else 0
    trainer = TorchTrainer(
        hold_gpu_memory,
        train_loop_config={"smi": smi},
        scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True),
        run_config=train.RunConfig(name="gpu", storage_path=storage),
    )
    (seen,) = trainer.fit().return_values
    pid = seen["pid"]
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid)  # the worker that held the memory is gone
    if not smi:
        pytest.skip("no nvidia-smi: only checked that the worker process is gone")
    # Checked only where the run showed: nvidia-smi listed the worker's pid (not in a container,
    # whose pids it does not show) and saw the memory it held (not on a MIG slice, say).
    pid_shown = seen["listed"]
    memory_shown = seen["used_mib"] >= used_before + 200
    while (pid_shown and pid in _gpu_pids() or memory_shown and _gpu_used_mib() > used_before + 64) and (
        time.monotonic() < deadline + 15
    ):
        time.sleep(0.2)
    if pid_shown:
        assert pid not in _gpu_pids()
    if memory_shown:
        assert _gpu_used_mib() <= used_before + 64
    if not (pid_shown or memory_shown):
        pytest.skip(
            f"nvidia-smi showed neither the worker's pid nor its memory ({seen['used_mib']} MiB used, "
            f"{used_before} before): only checked that the worker process is gone"
        )


@needs_one_gpu
def test_more_gpu_workers_than_gpus_is_a_clear_error(storage: str) -> None:
    with pytest.raises(train.ConfigError, match=r"asks for \d+ GPU\(s\).*torch sees \d+"):
        fit_gpu(devices_func, storage, num_workers=_gpus() + 1)


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
    import os

    from ddptrain.launch.hosts import visible_gpu_ids

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return list(range(_gpus()))
    return visible_gpu_ids(visible)[: _gpus()]


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


# ----------------------------------------------------------------- what a one-GPU machine can check
DRIVER_SCRIPT = """
import sys

import torch

import ddptrain as train
from ddptrain import ray_compat
from ddptrain.agent.process import children_cannot_use_cuda
from ddptrain.torch import TorchTrainer, get_device


def train_func():
    return torch.ones(2, device=get_device())  # a CUDA tensor, unpickled by the driver


if __name__ == "__main__":
    gpus = ray_compat._RayModule().cluster_resources().get("GPU", 0)
    result = TorchTrainer(
        train_func,
        scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True),
        run_config=train.RunConfig(storage_path=sys.argv[1]),
    ).fit()
    (value,) = result.return_values
    print("RESULT", gpus > 0, value.device, torch.cuda.is_initialized(), children_cannot_use_cuda(torch))
"""


@needs_one_gpu
def test_the_driver_of_a_gpu_run_never_starts_cuda(storage: str, tmp_path) -> None:
    # The driver counts GPUs (NVML: it starts nothing), starts and watches the workers and
    # unpickles what they return without ever starting CUDA: no context, and no cuInit either
    # (which would keep any process it forks from using CUDA). Its own process: this one asked
    # CUDA already (the skip marks above).
    import subprocess
    import sys

    script = tmp_path / "gpu_driver.py"
    script.write_text(DRIVER_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), storage], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT True cpu False False" in proc.stdout, proc.stdout + proc.stderr


RAYSGD_DRIVER_SCRIPT = """
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ddptrain.agent.process import children_cannot_use_cuda
from ddptrain.util.sgd import TorchTrainer, TrainingOperator


class Operator(TrainingOperator):
    def setup(self, config):
        model = nn.Linear(1, 1)
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.MSELoss()
        )
        data = TensorDataset(torch.ones(4, 1), torch.ones(4, 1))
        self.register_data(train_loader=DataLoader(data, batch_size=2), validation_loader=DataLoader(data))


if __name__ == "__main__":
    trainer = TorchTrainer(training_operator_cls=Operator, num_workers=1)  # use_gpu="auto"
    try:
        trainer.train()
    finally:
        trainer.shutdown()
    print("RESULT", trainer.use_gpu, torch.cuda.is_initialized(), children_cannot_use_cuda(torch))
"""


@needs_one_gpu
def test_raysgd_use_gpu_auto_finds_the_gpus_without_starting_cuda_in_the_driver(tmp_path) -> None:
    # RaySGD's default use_gpu="auto" counts the GPUs (NVML), and the driver never calls into
    # CUDA (no context, no cuInit that would keep the processes it forks off CUDA).
    import subprocess
    import sys

    script = tmp_path / "raysgd_driver.py"
    script.write_text(RAYSGD_DRIVER_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT True False False" in proc.stdout, proc.stdout + proc.stderr


def warm_func() -> dict:
    import torch.distributed as dist

    total = torch.tensor([1.0], device=get_device())
    dist.all_reduce(total)
    return {"pid": os.getpid(), "backend": dist.get_backend(), "sum": total.item(), "device": str(total.device)}


@needs_one_gpu
def test_warm_gpu_fits_run_on_the_same_worker_with_a_new_process_group(storage: str) -> None:
    # The first fit's process group (nccl) is destroyed as it ends, and the next fit on the
    # same warm worker builds a new one on the same GPU.
    def fit(name: str) -> dict:
        trainer = TorchTrainer(
            warm_func,
            scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True),
            run_config=train.RunConfig(name=name, storage_path=storage),
        )
        (value,) = trainer.fit().return_values
        return value

    with train.reuse_workers():
        first, second = fit("warm-1"), fit("warm-2")
    assert first["pid"] == second["pid"]
    for out in (first, second):
        assert out == {"pid": first["pid"], "backend": "nccl", "sum": 1.0, "device": "cuda:0"}


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
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    for value in result.return_values:
        if value["limit"] is not None:
            assert value["limit"] <= 0.4 * gpu_bytes, (value["limit"], gpu_bytes)


def hold_most_of_the_gpu(config: dict) -> dict:
    import os

    free, total = torch.cuda.mem_get_info(get_device())
    held = torch.empty(int(total * 0.6), dtype=torch.uint8, device=get_device())
    torch.cuda.synchronize()
    marker = os.path.join(config["dir"], "crashed_once")
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(7)  # dies holding 60% of its GPU
    del held
    return {"free_at_start": free, "total": total}


@needs_one_gpu
def test_a_restart_finds_the_gpu_memory_of_the_crashed_attempt_freed(storage: str, tmp_path) -> None:
    # The next attempt's worker starts only once the dead one's memory is back: 60% twice
    # does not fit on one GPU.
    trainer = TorchTrainer(
        hold_most_of_the_gpu,
        train_loop_config={"dir": str(tmp_path)},
        scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True),
        run_config=train.RunConfig(storage_path=storage, failure_config=train.FailureConfig(max_failures=1)),
    )
    (value,) = trainer.fit().return_values
    assert value["free_at_start"] >= 0.6 * value["total"]
