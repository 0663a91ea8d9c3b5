"""``TorchConfig`` and the backend that builds the torch process group on every worker."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddptrain.backend import Backend, BackendConfig
from ddptrain.errors import ConfigError

if TYPE_CHECKING:
    from ddptrain.worker_group import WorkerGroup

__all__ = ["TorchConfig"]

_INIT_METHODS = ("env", "tcp")


@dataclass
class TorchConfig(BackendConfig):
    """How workers join ``torch.distributed``.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or a per-device list such as ``"cpu:gloo,cuda:nccl"``.
            Default: ``"nccl"`` with ``use_gpu``, else ``"gloo"``.
        init_method: ``"env"`` (``env://`` with ``MASTER_ADDR``/``MASTER_PORT``) or ``"tcp"``
            (``tcp://addr:port``); both meet at the driver's store.
        timeout_s: Timeout of process-group operations, in seconds.
    """

    backend: str | None = None
    init_method: str = "env"
    timeout_s: int = 1800

    def __post_init__(self) -> None:
        if self.init_method not in _INIT_METHODS:
            raise ConfigError(f"`init_method` must be 'env' or 'tcp', got {self.init_method!r}.")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ConfigError(f"`timeout_s` must be a number of seconds > 0, got {self.timeout_s!r}.")
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend.strip()):
            raise ConfigError(f"`backend` must be a name such as 'gloo' or 'nccl', got {self.backend!r}.")

    @property
    def backend_cls(self) -> type[Backend]:
        return _TorchBackend

    @property
    def train_func_context(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        return _set_cuda_device


@contextlib.contextmanager
def _set_cuda_device() -> Iterator[None]:
    import torch

    from ddptrain.torch.train_loop_utils import get_device

    device = get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    yield


def _setup_process_group(backend: str, init_method: str, timeout_s: float) -> None:
    """Runs on each worker: join the process group through the driver's store."""
    import torch
    import torch.distributed as dist

    from ddptrain.torch.train_loop_utils import get_device

    device = get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ["ACCELERATE_TORCH_DEVICE"] = str(device)
    if init_method == "env":
        url = "env://"
    else:
        url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group(
        backend=backend,
        init_method=url,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _destroy_process_group() -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class _TorchBackend(Backend):
    share_cuda_visible_devices = True

    def on_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, TorchConfig)
        backend = backend_config.backend or ("nccl" if worker_group.get_resources_per_worker().get("GPU") else "gloo")
        worker_group.execute(_setup_process_group, backend, backend_config.init_method, backend_config.timeout_s)

    def on_shutdown(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        worker_group.execute(_destroy_process_group)
