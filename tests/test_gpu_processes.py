"""How GPU workers start and end: the driver never starts CUDA, user code that asks CUDA at
import or runs from ``__main__``, GPU memory given back after a fit and after a crash, restarts
and warm workers on a GPU.

Workers that use CUDA must not be forked from a process in which CUDA was touched or the
user's code ran (issue: "Cannot re-initialize CUDA in forked subprocess"). Training on GPUs
itself (placement, nccl, sharing) is in ``test_gpu.py``. Marked ``gpu`` and skipped unless
enough CUDA devices are visible; they run one at a time, also under ``-n`` (conftest.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from gpus import fit_gpu, needs_one_gpu

import ddptrain as train
from ddptrain._proc import state_letter
from ddptrain.torch import TorchTrainer, get_device

pytestmark = pytest.mark.gpu


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
    return state_letter(pid) not in ("", "Z")


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
