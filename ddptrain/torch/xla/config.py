"""``TorchXLAConfig``: a ``TorchTrainer`` whose workers join torch_xla's ``xla`` process group.

What the backend does, as Ray's (``ray.train.torch.xla``): every worker first checks that it
can run (below); then ``MASTER_ADDR``/``MASTER_PORT`` become rank 0's address and a port free
there (rank 0 serves the process group's rendezvous, as with Ray, instead of the driver's
store), ``TORCHELASTIC_RUN_ID`` one id per run, the torchrun rank variables (``RANK``,
``LOCAL_RANK``, ``GROUP_RANK``, ``ROLE_WORLD_RANK``, ...) the worker's, the AWS EFA variables
Ray sets (``FI_PROVIDER=efa``, ``FI_EFA_USE_DEVICE_RDMA=1``, ``FI_EFA_FORK_SAFE=1``,
``XLA_TRANSFER_SEED_ASYNC=1``, ``NCCL_ASYNC_ERROR_HANDLING=1``; a value already set wins), and
``torch.distributed.init_process_group("xla")`` runs. With ``neuron_parallel_compile`` the
Neuron graph-extraction variables are set, and after training local rank 0 of each host
compiles the extracted graphs (``libneuronxla``).

Fails fast, before any of that, in each worker: ``PJRT_DEVICE=CPU`` with more than one worker
(torch_xla's collectives do not run on XLA:CPU across processes), and a torch_xla that cannot
be imported (not installed, or built for another torch). Unlike Ray it does not ``pkill``
``xrt_run_server`` processes: that would kill other users' too, and PJRT has no such server.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import shutil
import socket
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddptrain import _env
from ddptrain._net import own_address
from ddptrain.backend import Backend, BackendConfig
from ddptrain.context import get_context
from ddptrain.errors import ConfigError
from ddptrain.torch.config import TorchConfig

if TYPE_CHECKING:
    from ddptrain.driver.worker_group import WorkerGroup

__all__ = ["TorchXLAConfig"]

_logger = logging.getLogger(__name__)

# Set as Ray's backend sets them (EFA and XLA transfer settings of AWS Trainium/Inferentia).
_EFA_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "XLA_TRANSFER_SEED_ASYNC": "1",
    "NCCL_ASYNC_ERROR_HANDLING": "1",
}
# Neuron graph extraction for parallel compilation (the model's outputs are not valid meanwhile).
_NEURON_EXTRACT_ENV = {
    "NEURON_PARALLEL_COMPILE": "1",
    "NEURON_EXTRACT_GRAPHS_ONLY": "1",
    "NEURON_FALL_BACK_TO_NULL_NEFF": "1",
}


@dataclass
class TorchXLAConfig(TorchConfig):
    """torch_xla's ``xla`` process group for a ``TorchTrainer`` (Ray's ``TorchXLAConfig``).

    Pass it as ``TorchTrainer(..., torch_config=TorchXLAConfig())``; the training function
    uses ``torch_xla`` (``xm.xla_device()``, ``xm.mark_step()``) as under Ray. Never run by
    ddptrain's tests: torch_xla needs an older torch than ddptrain's, and its collectives do not
    run on XLA:CPU (see ``docs/jax.md``, "TorchXLAConfig").

    Args:
        neuron_parallel_compile: AWS Neuron: extract the graphs during training (outputs are
            not valid then) and compile them in parallel after it (``libneuronxla``).
        backend: Must be ``None`` or ``"xla"``: the process group is always ``xla``.
        init_method: ``"env"`` or ``"tcp"``, at rank 0's ``MASTER_ADDR``/``MASTER_PORT``.
        timeout_s: Timeout of process-group operations, in seconds.
    """

    neuron_parallel_compile: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend not in (None, "xla"):
            raise ConfigError(
                f"`TorchXLAConfig(backend={self.backend!r})`: the process group of torch_xla is always 'xla'; "
                "leave `backend` unset, or use TorchConfig for gloo or nccl."
            )
        if not isinstance(self.neuron_parallel_compile, bool):
            raise ConfigError(f"`neuron_parallel_compile` must be True or False, got {self.neuron_parallel_compile!r}.")

    @property
    def backend_cls(self) -> type[Backend]:
        return _TorchXLABackend

    @property
    def train_func_context(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        return contextlib.nullcontext


def _where() -> str:
    return f"rank {os.environ.get('RANK', '?')} on host {socket.gethostname()}"


def _check_can_run(world_size: int) -> None:
    """Runs on each worker first: fail at once, saying why, where torch_xla cannot work."""
    device = os.environ.get("PJRT_DEVICE", "")
    if device.upper() == "CPU" and world_size > 1:
        raise ConfigError(
            f"TorchXLAConfig: PJRT_DEVICE={device} ({_where()}) with {world_size} workers: torch_xla's collectives "
            "do not run on XLA:CPU across processes, so the 'xla' process group cannot work. Use one worker for "
            "XLA:CPU, or set PJRT_DEVICE to the accelerator of the hosts (TPU, CUDA, NEURON)."
        )
    import torch

    try:
        import torch_xla  # noqa: F401
        import torch_xla.core.xla_model  # noqa: F401
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "torch_xla":
            raise
        raise ConfigError(
            f"TorchXLAConfig: {_where()} cannot import torch_xla (Python {sys.executable}, torch "
            f"{torch.__version__}). Install the torch_xla release built for this torch there (`pip install "
            f"torch_xla` with the same version as torch), or use TorchConfig."
        ) from None
    except (ImportError, OSError) as exc:  # e.g. undefined symbols: a wheel built for another torch
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"TorchXLAConfig: {_where()} cannot load torch_xla ({first}). torch_xla's wheels work only with "
            f"the torch release they were built for; this is torch {torch.__version__}: install the matching "
            "torch_xla, or the torch its wheel needs."
        ) from exc


def _rendezvous_address() -> tuple[str, int]:
    """Runs on rank 0: the address the others reach it at, and a port free there."""
    address = own_address()
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(("", 0) if family == socket.AF_INET else ("::", 0))
        port = int(s.getsockname()[1])
    return address, port


def _set_xla_env(address: str, port: int, run_id: str, neuron_parallel_compile: bool) -> None:
    """Runs on each worker: the variables Ray's XLA backend sets."""
    context = get_context()
    os.environ.update(
        {
            "MASTER_ADDR": address,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "False",  # rank 0 serves the rendezvous, as under Ray
            "TORCHELASTIC_RUN_ID": run_id,
            "RANK": str(context.get_world_rank()),
            "LOCAL_RANK": str(context.get_local_rank()),
            "WORLD_SIZE": str(context.get_world_size()),
            "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
            "GROUP_RANK": str(context.get_node_rank()),
            "ROLE_RANK": str(context.get_world_rank()),
            "ROLE_WORLD_RANK": str(context.get_world_rank()),
            "ROLE_WORLD_SIZE": str(context.get_world_size()),
        }
    )
    for name, value in {**_EFA_ENV, **(_NEURON_EXTRACT_ENV if neuron_parallel_compile else {})}.items():
        os.environ.setdefault(name, value)


def _setup_xla_process_group(init_method: str, timeout_s: float) -> None:
    """Runs on each worker: join the ``xla`` process group (rendezvous at rank 0)."""
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401

    url = "env://" if init_method == "env" else f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    join = min(timeout_s, _env.store_connect_timeout_s() or timeout_s)
    dist.init_process_group("xla", init_method=url, timeout=datetime.timedelta(seconds=join))


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _neuron_compile_extracted_graphs() -> None:
    """Runs on each worker after training: local rank 0 compiles the graphs extracted on its host."""
    if os.environ.get("LOCAL_RANK") != "0":
        return
    try:
        from libneuronxla.neuron_cc_cache import CacheUrl
        from libneuronxla.neuron_parallel_compile import parallel_compile
    except ImportError as exc:
        raise ConfigError(
            f"TorchXLAConfig(neuron_parallel_compile=True): {_where()} cannot import libneuronxla ({exc}); "
            "install the AWS Neuron SDK there."
        ) from exc
    workdir = os.path.join("/tmp", os.environ.get("USER", "no-user"), "parallel_compile_workdir")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir, exist_ok=True)
    flags = os.environ.get("NEURON_CC_FLAGS", "")
    match = re.search(r"--cache_dir[= ](\S+)", flags)  # wins over NEURON_COMPILE_CACHE_URL, as in Ray
    _logger.info("ddptrain: compiling the extracted Neuron graphs on %s", _where())
    parallel_compile(workdir, CacheUrl.get_cache_url(match.group(1) if match else None))


class _TorchXLABackend(Backend):
    share_cuda_visible_devices = True  # as torch's: PJRT picks each process's device by LOCAL_RANK

    def on_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, TorchXLAConfig)
        worker_group.execute(_check_can_run, len(worker_group))
        address, port = worker_group.execute_single(0, _rendezvous_address)
        run_id = uuid.uuid4().hex
        worker_group.execute(_set_xla_env, address, port, run_id, backend_config.neuron_parallel_compile)
        if backend_config.neuron_parallel_compile:
            _logger.info("ddptrain: extracting graphs for Neuron parallel compilation")

    def on_training_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, TorchXLAConfig)
        worker_group.execute(_setup_xla_process_group, backend_config.init_method, backend_config.timeout_s)

    def on_shutdown(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, TorchXLAConfig)
        worker_group.execute(_destroy_process_group)
        if backend_config.neuron_parallel_compile:  # must run after training, as in Ray
            worker_group.execute(_neuron_compile_extracted_graphs)
