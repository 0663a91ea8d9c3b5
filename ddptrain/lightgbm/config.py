"""``LightGBMConfig`` and ``get_network_params``: LightGBM's own network across the workers.

LightGBM connects its workers itself, given the list of every worker's ``address:port``
(``machines``) and the port to listen on. Before the training function runs, each worker
reserves a port on its host (held open until its training function starts, so two workers of
one host never pick the same one) and says at which address the other hosts reach it; the
driver builds ``machines`` from the answers and hands every worker its parameters, kept in
this module (an importable one, not the user's ``__main__``) for :func:`get_network_params`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddptrain import _gbdt
from ddptrain.backend import Backend, BackendConfig
from ddptrain.context import get_context
from ddptrain.errors import ConfigError, LaunchError

if TYPE_CHECKING:
    from ddptrain.driver.worker_group import WorkerGroup

__all__ = ["LightGBMConfig", "PortInUseError", "get_network_params"]

_TREE_LEARNERS = ("data_parallel", "voting_parallel", "feature_parallel", "data", "voting", "feature")

# In each worker: its network parameters and the socket that holds its port until training starts.
_state: dict[str, Any] = {}
_state_lock = threading.Lock()


class PortInUseError(LaunchError):
    """A worker's LightGBM port is taken on its host."""


@dataclass
class LightGBMConfig(BackendConfig):
    """How LightGBM's workers find each other (Ray Train's ``LightGBMConfig``).

    Args:
        local_listen_port: ``None`` (default): each worker listens on a free port of its
            host, picked at start. A number: the worker of local rank ``i`` on a host listens
            on ``local_listen_port + i``; a port taken on a host fails the start with a
            :class:`PortInUseError` naming the host and the port.
        tree_learner: LightGBM's distributed algorithm, returned by ``get_network_params``:
            ``"data_parallel"`` (default; each worker holds some rows), ``"voting_parallel"``
            or ``"feature_parallel"`` (each worker holds every row).

    Note: LightGBM does not combine evaluation metrics across workers: each worker
    evaluates its own rows of a validation set, and the metrics reported (rank 0's) cover
    rank 0's part only when that set is split. Give every worker the whole validation set,
    ``DataConfig(datasets_to_split=["train"])``: the models are the same on every worker, so
    the metrics (and early stopping) then agree and cover all the rows.
    """

    local_listen_port: int | None = None
    tree_learner: str = "data_parallel"

    def __post_init__(self) -> None:
        port = self.local_listen_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535):
            raise ConfigError(
                f"`local_listen_port` must be a port number in 1024..65535 or None (free ports), got {port!r}."
            )
        if self.tree_learner not in _TREE_LEARNERS:
            raise ConfigError(
                f"`tree_learner` must be one of 'data_parallel', 'voting_parallel', 'feature_parallel', "
                f"got {self.tree_learner!r}."
            )

    @property
    def backend_cls(self) -> type[Backend]:
        return _LightGBMBackend

    @property
    def train_func_context(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        return _network_context


def get_network_params() -> dict[str, Any]:
    """LightGBM's parameters for distributed training, for this worker of a ``LightGBMTrainer``.

    Returns ``machines`` (every worker's ``address:port``), ``local_listen_port`` (this
    worker's), ``num_machines`` and ``tree_learner`` (``LightGBMConfig.tree_learner``). Put
    them into the parameters of ``lightgbm.train``; keys you give after them win::

        params = {"objective": "binary", **ddptrain.lightgbm.get_network_params()}
        booster = lightgbm.train(params, train_set, valid_sets=[valid_set])

    Outside a ``LightGBMTrainer``'s training function it logs a warning and returns ``{}``
    (LightGBM then trains alone), as Ray's does.
    """
    with _state_lock:
        params = _state.get("params")
    if params is None:
        import logging

        logging.getLogger(__name__).warning(
            "ddptrain.lightgbm.get_network_params() was called outside the training function of a "
            "LightGBMTrainer: it returns {}, and LightGBM trains alone."
        )
        return {}
    return dict(params)


@contextlib.contextmanager
def _network_context() -> Iterator[None]:
    """In a worker, around the training function: free the reserved port for LightGBM."""
    with _state_lock:
        reserved = _state.pop("socket", None)
    if reserved is not None:
        reserved.close()
    try:
        yield
    finally:
        with _state_lock:
            _state.pop("params", None)


def _reserve_port(base_port: int | None) -> tuple[str, int]:
    """Runs in each worker: hold a port of this host for LightGBM; returns the address the
    other workers reach this one at and the port."""

    ctx = get_context()
    port = 0 if base_port is None else base_port + ctx.get_local_rank()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("", port))  # LightGBM listens on every interface
    except OSError as exc:
        sock.close()
        raise PortInUseError(
            f"LightGBM's port {port} on host {socket.gethostname()} (rank {ctx.get_world_rank()}, local rank "
            f"{ctx.get_local_rank()}) cannot be used: {exc.strerror or exc}. Pick another "
            "`LightGBMConfig(local_listen_port=...)` (the worker of local rank i on a host uses "
            "local_listen_port + i), or leave it None to have free ports picked."
        ) from None
    with _state_lock:
        previous = _state.pop("socket", None)
        _state["socket"] = sock
    if previous is not None:
        previous.close()
    return _gbdt.own_address(), int(sock.getsockname()[1])


def _set_params(machines: str, ports: list[int], tree_learner: str) -> None:
    """Runs in each worker: its parameters for ``get_network_params``."""

    rank = get_context().get_world_rank()
    with _state_lock:
        _state["params"] = {
            "machines": machines,
            "local_listen_port": ports[rank],
            "num_machines": len(ports),
            "tree_learner": tree_learner,
        }


class _LightGBMBackend(Backend):
    def on_training_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, LightGBMConfig)
        reserved = worker_group.execute(_reserve_port, backend_config.local_listen_port)
        machines = ",".join(f"{address}:{port}" for address, port in reserved)
        worker_group.execute(_set_params, machines, [port for _, port in reserved], backend_config.tree_learner)
