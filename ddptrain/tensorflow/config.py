"""``TensorflowConfig`` and the backend that gives every worker its ``TF_CONFIG``.

``tf.distribute.MultiWorkerMirroredStrategy`` reads the cluster from ``TF_CONFIG``: the
``host:port`` of every worker's TensorFlow server and this worker's index (its world rank).
The backend picks one port per worker on that worker's host (free when checked), and sets
``TF_USE_LEGACY_KERAS=1`` unless the user set it: Keras 3 cannot train under that strategy
(keras-team/keras#20585), ``tf-keras`` can. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddptrain._net import own_address
from ddptrain.backend import Backend, BackendConfig
from ddptrain.errors import ConfigError, LaunchError

if TYPE_CHECKING:
    from ddptrain.driver.worker_group import WorkerGroup

__all__ = ["TensorflowConfig", "PortInUseError"]

_logger = logging.getLogger(__name__)

LEGACY_KERAS_VAR = "TF_USE_LEGACY_KERAS"
_TRUE = ("true", "True", "1")  # the values TensorFlow reads as "use tf-keras"


class PortInUseError(LaunchError):
    """The port a worker's TensorFlow server must listen on is taken on its host."""


@dataclass
class TensorflowConfig(BackendConfig):
    """How workers form a ``MultiWorkerMirroredStrategy`` cluster (Ray's ``TensorflowConfig``).

    Each worker gets ``TF_CONFIG = {"cluster": {"worker": ["host:port", ...]}, "task":
    {"type": "worker", "index": <world rank>}}``; create the strategy inside the training
    function. Workers also get ``TF_USE_LEGACY_KERAS=1`` (unless you set it), so ``tf.keras``
    is ``tf-keras``.

    Args:
        port: The port of the TensorFlow server of the worker with local rank 0 on each host;
            local rank ``r`` listens on ``port + r``. A taken port fails the run at once with
            :class:`PortInUseError`. ``None`` (the default) picks a free port for each worker.

    Example:
        >>> trainer = TensorflowTrainer(train_func, tensorflow_config=TensorflowConfig(port=24000))
    """

    port: int | None = None

    def __post_init__(self) -> None:
        port = self.port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
            raise ConfigError(f"`port` must be a port number in [1, 65535] or None (pick free ports), got {port!r}.")

    @property
    def backend_cls(self) -> type[Backend]:
        return _TensorflowBackend

    @property
    def train_func_context(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        return _check_keras_version


def _missing_packages() -> list[str]:
    """The packages of ``ddptrain[tensorflow]`` that this Python cannot import."""
    missing = []
    for name, package in (("tensorflow", "tensorflow"), ("tf_keras", "tf-keras")):
        if name in sys.modules:
            if sys.modules[name] is None:
                missing.append(package)
            continue
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(package)
        except (ImportError, ValueError):
            missing.append(package)
    return missing


def _free_port(address: str, port: int) -> int:
    """Bind ``port`` (``0``: any) as TensorFlow's server will, and return it; it is released
    again at once, so another process could still take it before TensorFlow binds it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(("::" if family == socket.AF_INET6 else "", port))  # all interfaces, like gRPC
        bound: int = s.getsockname()[1]
    return bound


def _reserve_address(port: int | None) -> str:
    """Runs on each worker: check that TensorFlow can run here and pick this worker's
    ``host:port`` for ``TF_CONFIG``."""
    host, rank = socket.gethostname(), os.environ.get("RANK", "?")
    missing = _missing_packages()
    if missing:
        raise ConfigError(
            f"TensorflowTrainer: rank {rank} on host {host} cannot import {' and '.join(missing)} "
            f"(Python {sys.executable}). Install them there: `pip install ddptrain[tensorflow]`."
        )
    os.environ.setdefault(LEGACY_KERAS_VAR, "1")
    address = own_address()
    wanted = 0 if port is None else port + int(os.environ.get("LOCAL_RANK", "0"))
    try:
        chosen = _free_port(address, wanted)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise PortInUseError(
            f"TensorflowTrainer: port {wanted} for the TensorFlow server of rank {rank} on host {host} "
            f"is in use. Pass a free range to TensorflowConfig(port=...) (local rank r uses port + r), "
            "or leave `port` unset to pick free ports.",
            hosts=[host],
        ) from None
    return f"[{address}]:{chosen}" if ":" in address else f"{address}:{chosen}"


def _set_tf_config(addresses: list[str]) -> None:
    """Runs on each worker: the cluster of every worker's server, and this worker's index."""
    rank = int(os.environ["RANK"])
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}})


def _clear_tf_config() -> None:
    os.environ.pop("TF_CONFIG", None)


def _keras_3_bound() -> bool:
    """Whether ``tf.keras`` already means Keras 3 in this process (read without resolving it)."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return False
    keras = sys.modules.get("tensorflow.keras") or vars(tf).get("keras")
    if keras is None:
        return False
    version = getattr(keras, "__dict__", {}).get("_tfll_keras_version")
    if version is not None:
        return bool(version == "keras_3")
    name = getattr(keras, "__name__", "") or ""
    return name.startswith("keras.") or name == "keras"


@contextlib.contextmanager
def _check_keras_version() -> Iterator[None]:
    """Wraps the training function: warn when ``tf.keras`` was bound to Keras 3 before the
    workers could select tf-keras (the driver's objects were pickled from Keras 3)."""
    if os.environ.get(LEGACY_KERAS_VAR) in _TRUE and _keras_3_bound():
        _logger.warning(
            "ddptrain: tf.keras is Keras 3 in this worker although %s=1: something the training "
            "function refers to imported it (e.g. `from tensorflow import keras` or "
            "`from tensorflow.keras import ...` at the top of the driver's script). Keras 3 cannot "
            "train under MultiWorkerMirroredStrategy: set %s=1 in the driver before importing "
            "TensorFlow, or import Keras inside the training function.",
            LEGACY_KERAS_VAR,
            LEGACY_KERAS_VAR,
        )
    yield


class _TensorflowBackend(Backend):
    def on_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, TensorflowConfig)
        addresses = worker_group.execute(_reserve_address, backend_config.port)
        worker_group.execute(_set_tf_config, addresses)

    def on_shutdown(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        worker_group.execute(_clear_tf_config)
