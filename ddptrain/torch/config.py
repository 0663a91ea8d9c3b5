"""``TorchConfig`` and the backend that builds the torch process group on every worker."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddptrain import _env, context
from ddptrain.backend import Backend, BackendConfig
from ddptrain.errors import ConfigError, LaunchError
from ddptrain.torch.train_loop_utils import get_device

if TYPE_CHECKING:
    from ddptrain.driver.worker_group import WorkerGroup

__all__ = ["TorchConfig"]

_logger = logging.getLogger(__name__)

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

    device = get_device()  # checked by _setup_process_group, which ran in this worker before
    if device.type == "cuda":
        torch.cuda.set_device(device)
    yield


# gloo waits up to this many times its timeout for a peer's first connection (gloo/transport/tcp/pair.h).
_GLOO_CONNECT_FACTOR = 5
_JOINED_PREFIX = "ddptrain_joined/"  # in the driver's store (one per attempt): a rank reached the group's setup


def _check_devices() -> None:
    """A worker given GPUs must see them: say so here, naming the host, rather than train on
    the CPU or fail later in NCCL with "invalid device ordinal"."""
    import torch

    session = context._session
    if session is None or not session.devices:
        return
    devices = session.devices
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f"host {socket.gethostname()!r} (CUDA_VISIBLE_DEVICES={visible!r})"
    if not torch.cuda.is_available():
        raise ConfigError(
            f"rank {session.context.get_world_rank()} was given GPU(s) {list(devices)} on {where}, but torch "
            f"cannot use CUDA there (torch {torch.__version__}, built for CUDA {torch.version.cuda}). Install a "
            "CUDA build of torch on that host, or set `use_gpu=False`."
        )
    count = torch.cuda.device_count()
    if max(devices) >= count:
        raise ConfigError(
            f"rank {session.context.get_world_rank()} was given GPU(s) {list(devices)} on {where}, but torch sees "
            f"{count} GPU(s) there. Lower `slots=` or the host's `gpus=` list, or the number of workers."
        )


def _setup_process_group(backend: str, init_method: str, timeout_s: float) -> None:
    """Runs on each worker: join the process group through the driver's store.

    Joining is bounded by ``DDPTRAIN_STORE_CONNECT_TIMEOUT_S`` (or ``timeout_s`` if smaller),
    not ``timeout_s`` (30 minutes by default): first every rank waits in the store for all
    the others to arrive (a slow CUDA start is absorbed here); then, with everyone present,
    connecting the ranks' pairs gets the same bound, and a rank that cannot connect by then
    never will (gloo bound to an address the other hosts cannot reach). It fails with a
    message that names its host and the fix. The group's operations then get ``timeout_s``.
    """
    import torch
    import torch.distributed as dist

    _check_devices()
    device = get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ["ACCELERATE_TORCH_DEVICE"] = str(device)
    if init_method == "env":
        url = "env://"
    else:
        url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    join = datetime.timedelta(seconds=min(timeout_s, _env.store_connect_timeout_s() or timeout_s))
    store, _, _ = next(dist.rendezvous(url, rank=rank, world_size=world_size, timeout=join))
    store.set(f"{_JOINED_PREFIX}{rank}", b"1")
    store.wait([f"{_JOINED_PREFIX}{r}" for r in range(world_size)], join)
    try:
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size, timeout=join / _GLOO_CONNECT_FACTOR
        )
    except RuntimeError as exc:  # torch's DistError and gloo's connect errors
        if "gloo" not in backend:
            raise
        raise LaunchError(_gloo_connect_failure(join.total_seconds(), exc)) from exc
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.distributed_c10d._set_pg_timeout(timeout)
    store.set_timeout(timeout)  # as init_process_group leaves the store when it makes the rendezvous itself


def _gloo_connect_failure(join_s: float, exc: BaseException) -> str:
    """Why this rank could not join gloo's process group, naming its host and the fix."""
    import socket

    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    bound = (
        f"GLOO_SOCKET_IFNAME={ifname}"
        if ifname
        else "GLOO_SOCKET_IFNAME not set: it used the address its host name resolves to, or 127.0.0.1"
    )
    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"gloo on host {socket.gethostname()} ({bound}) could not connect to the other ranks within "
        f"{join_s:g} s ({cause}). Every rank must reach the address gloo binds to on every host: "
        "set GLOO_SOCKET_IFNAME to the network interface this host reaches the other hosts on (see "
        "`ip addr`), in the driver's environment (it is forwarded) or in "
        "RunConfig(worker_runtime_env={'env_vars': ...}); when it is not set, a host reached over SSH "
        "uses the interface its SSH connection arrives on, and a SLURM node the one on its route to the "
        "driver. DDPTRAIN_STORE_CONNECT_TIMEOUT_S bounds this wait."
    )


def _destroy_process_group() -> None:
    """Runs on each worker: leave the process group and hand back the GPU memory torch keeps
    cached. Only a worker that started CUDA has any: asking ``is_available()`` first would
    start CUDA in every CPU worker of a GPU machine (``is_initialized()`` reads a flag)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _backend_for(chosen: str | None, worker_group: WorkerGroup) -> str:
    """The process group's backend: the user's, else NCCL for GPU workers and gloo otherwise.

    NCCL refuses two ranks of one group on the same GPU ("Duplicate GPU detected"), which
    fractional GPUs per worker make: then the default is gloo, which handles CUDA tensors
    through host memory, and an explicit NCCL backend is refused before any rank fails on it.

    Raises:
        ConfigError: ``backend`` names NCCL and ranks share a GPU.
    """
    gpus = worker_group.get_resources_per_worker().get("GPU") or 0
    shared = worker_group.plan.ranks_share_a_gpu
    if chosen is not None:
        if shared and "nccl" in chosen:
            raise ConfigError(
                f"`TorchConfig(backend={chosen!r})`: with `resources_per_worker={{'GPU': {gpus:g}}}` several "
                "workers share a GPU, and NCCL refuses two ranks on one GPU. Use `backend='gloo'` (or leave "
                "it unset), or give each worker a whole GPU."
            )
        return chosen
    if shared:
        _logger.warning(
            "ddptrain: workers share GPUs (resources_per_worker GPU=%g), which NCCL does not allow; the process "
            "group uses gloo, which passes CUDA tensors through host memory. Give each worker a whole GPU to "
            "get NCCL.",
            gpus,
        )
        return "gloo"
    return "nccl" if gpus else "gloo"


class _TorchBackend(Backend):
    share_cuda_visible_devices = True

    def on_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, TorchConfig)
        backend = _backend_for(backend_config.backend, worker_group)
        worker_group.execute(_setup_process_group, backend, backend_config.init_method, backend_config.timeout_s)

    def on_shutdown(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        worker_group.execute(_destroy_process_group)
