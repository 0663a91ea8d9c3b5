"""TorchXLAConfig without torch_xla: its wheels need an older torch than ours, and its collectives
do not run on XLA:CPU, so the real library never runs here. What is tested: the clear errors a
user gets at once, and (with a stand-in ``torch_xla`` whose ``xla`` backend is gloo: a fake of
the library, outside the path under test) the environment and the rendezvous the backend sets
up in real workers for ``init_process_group("xla")``."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import ddptrain as train
from ddptrain.torch import TorchConfig, TorchTrainer
from ddptrain.torch.xla import TorchXLAConfig

_STAND_IN = {
    "torch_xla/__init__.py": "",
    "torch_xla/core/__init__.py": "",
    "torch_xla/core/xla_model.py": "",
    "torch_xla/distributed/__init__.py": "",
    "torch_xla/distributed/xla_backend.py": (
        "import torch.distributed as dist\n"
        "if 'xla' not in dist.Backend.backend_list:\n"
        "    dist.Backend.register_backend(\n"
        "        'xla', lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size, timeout),\n"
        "        devices=['cpu'])\n"
    ),
}


def _stand_in(folder: Path, files: dict[str, str]) -> dict[str, str]:
    """Write a package tree; the workers' environment that imports it first."""
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}


def _fit(storage: str, fn: Any, env: dict[str, str], **config: Any) -> Any:
    return TorchTrainer(
        fn,
        torch_config=TorchXLAConfig(**config),
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage, worker_runtime_env={"env_vars": env}),
    ).fit()


def _never_runs() -> None:
    raise AssertionError("the training function must not start")


@pytest.mark.timeout(90)
def test_without_torch_xla_the_workers_fail_at_once_naming_it_and_torch(storage: str) -> None:
    started = time.monotonic()
    with pytest.raises(train.TrainingFailedError) as info:
        _fit(storage, _never_runs, {})
    assert time.monotonic() - started < 60
    message = str(info.value)
    assert f"TorchXLAConfig: rank 0 on host {socket.gethostname()} cannot import torch_xla" in message
    import torch

    assert f"torch {torch.__version__}" in message
    assert "AssertionError" not in message


@pytest.mark.timeout(90)
def test_a_torch_xla_built_for_another_torch_is_named_as_such(storage: str, tmp_path: Path) -> None:
    broken = {
        "torch_xla/__init__.py": "raise ImportError('_XLAC.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c10')"
    }
    with pytest.raises(train.TrainingFailedError) as info:
        _fit(storage, _never_runs, _stand_in(tmp_path, broken))
    message = str(info.value)
    assert "cannot load torch_xla (_XLAC.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c10)" in message
    assert "torch_xla's wheels work only with the torch release they were built for" in message


@pytest.mark.timeout(90)
def test_pjrt_device_cpu_with_several_workers_fails_before_anything_else(storage: str) -> None:
    with pytest.raises(train.TrainingFailedError) as info:
        _fit(storage, _never_runs, {"PJRT_DEVICE": "CPU"})
    message = str(info.value)
    assert "TorchXLAConfig: PJRT_DEVICE=CPU (rank 0 on host" in message
    assert "with 2 workers: torch_xla's collectives do not run on XLA:CPU across processes" in message


def _report_env() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    total = torch.ones(1) * (train.get_context().get_world_rank() + 1)
    dist.all_reduce(total)
    names = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    names += ("LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_RANK", "ROLE_WORLD_SIZE", "FI_PROVIDER")
    names += ("FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE", "XLA_TRANSFER_SEED_ASYNC", "NEURON_PARALLEL_COMPILE")
    return {
        "backend": dist.get_backend(),
        "sum": float(total[0]),
        "env": {name: os.environ.get(name) for name in names},
    }


@pytest.mark.timeout(120)
def test_the_workers_get_rays_environment_and_an_xla_process_group(storage: str, tmp_path: Path) -> None:
    env = {**_stand_in(tmp_path, _STAND_IN), "FI_PROVIDER": "sockets"}  # a value the user set wins
    first, second = _fit(storage, _report_env, env).return_values
    assert first["backend"] == second["backend"] == "xla"
    assert first["sum"] == second["sum"] == 3.0
    a, b = first["env"], second["env"]
    assert a["MASTER_ADDR"] == b["MASTER_ADDR"] == "127.0.0.1"  # rank 0's address
    assert a["MASTER_PORT"] == b["MASTER_PORT"]
    assert a["TORCHELASTIC_RUN_ID"] == b["TORCHELASTIC_RUN_ID"] and len(a["TORCHELASTIC_RUN_ID"]) == 32
    for rank, values in enumerate((a, b)):
        assert values["RANK"] == values["ROLE_RANK"] == values["ROLE_WORLD_RANK"] == values["LOCAL_RANK"] == str(rank)
        assert values["WORLD_SIZE"] == values["LOCAL_WORLD_SIZE"] == values["ROLE_WORLD_SIZE"] == "2"
        assert values["GROUP_RANK"] == "0"
        assert values["FI_PROVIDER"] == "sockets"
        assert (
            values["FI_EFA_USE_DEVICE_RDMA"] == values["FI_EFA_FORK_SAFE"] == values["XLA_TRANSFER_SEED_ASYNC"] == "1"
        )
        assert values["NEURON_PARALLEL_COMPILE"] is None  # only with neuron_parallel_compile=True


def test_torch_xla_config_arguments_are_checked() -> None:
    config = TorchXLAConfig(neuron_parallel_compile=True, timeout_s=60)
    assert isinstance(config, TorchConfig)
    assert config.to_dict() == {"backend": None, "init_method": "env", "timeout_s": 60, "neuron_parallel_compile": True}
    with pytest.raises(train.ConfigError, match="the process group of torch_xla is always 'xla'"):
        TorchXLAConfig(backend="gloo")
    with pytest.raises(train.ConfigError, match="`neuron_parallel_compile` must be True or False, got 1"):
        TorchXLAConfig(neuron_parallel_compile=1)  # type: ignore[arg-type]
    with pytest.raises(train.ConfigError, match="`init_method` must be 'env' or 'tcp'"):
        TorchXLAConfig(init_method="xla")
    assert "torch_xla" not in sys.modules


@pytest.mark.timeout(120)
def test_neuron_parallel_compile_sets_neurons_variables_and_names_a_missing_compiler(
    storage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Training succeeds; the compile step after it needs libneuronxla, which is not here: its
    error is logged (training finished), naming what to install."""
    first, second = _fit(
        storage, _report_env, _stand_in(tmp_path, _STAND_IN), neuron_parallel_compile=True
    ).return_values
    assert first["env"]["NEURON_PARALLEL_COMPILE"] == second["env"]["NEURON_PARALLEL_COMPILE"] == "1"
    assert "cannot import libneuronxla" in caplog.text
    assert "install the AWS Neuron SDK there" in caplog.text
