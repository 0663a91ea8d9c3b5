"""``XGBoostConfig``: XGBoost's collective (rabit) set up across the workers.

The driver starts XGBoost's tracker (in a child process, see ``_tracker``) where every worker
can reach it: the address each worker reaches the driver's store at. Each worker then gets
its communicator arguments, kept in this module (an importable one: state kept in the user's
``__main__`` would not survive pickling), and ``train_func_context`` opens an
``xgboost.collective.CommunicatorContext`` with them around the training function, so a plain
``xgboost.train`` call inside it trains on all workers' rows together.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddptrain.backend import Backend, BackendConfig
from ddptrain.context import get_context
from ddptrain.errors import ConfigError, LaunchError
from ddptrain.xgboost._tracker import TrackerProcess

if TYPE_CHECKING:
    from ddptrain.driver.worker_group import WorkerGroup

__all__ = ["XGBoostConfig"]

_logger = logging.getLogger(__name__)
_COMMUNICATORS = ("rabit",)
_FINISH_S = 10.0  # after training, how long the tracker may take to see every worker leave

# In each worker: the arguments of its CommunicatorContext, set by the backend, taken by
# `train_func_context` (once: a warm worker's next run gets its own).
_args: dict[str, Any] | None = None
_args_lock = threading.Lock()


@dataclass
class XGBoostConfig(BackendConfig):
    """How XGBoost's workers communicate (Ray Train's ``XGBoostConfig``).

    ``XGBoostTrainer`` starts XGBoost's tracker on the driver and opens an
    ``xgboost.collective.CommunicatorContext`` in every worker around the training function:
    inside it, ``xgboost.train`` builds each tree from the histograms of all workers' rows, and
    evaluation metrics are computed over all workers' eval rows. The tracker listens where the
    workers reach the driver's store, so it works across SSH hosts too.

    Args:
        xgboost_communicator: The collective XGBoost uses; only ``"rabit"`` (CPU) is supported.
    """

    xgboost_communicator: str = "rabit"

    def __post_init__(self) -> None:
        if self.xgboost_communicator not in _COMMUNICATORS:
            raise ConfigError(f"`xgboost_communicator` must be 'rabit', got {self.xgboost_communicator!r}.")

    @property
    def backend_cls(self) -> type[Backend]:
        return _XGBoostBackend

    @property
    def train_func_context(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        return _communicator_context

    def to_dict(self) -> dict[str, Any]:
        return {"xgboost_communicator": self.xgboost_communicator}


@contextlib.contextmanager
def _communicator_context() -> Iterator[None]:
    """In a worker: join the XGBoost collective for the duration of the training function.
    Without arguments from the backend (a trainer run in the driver's own process, or a
    ``DataParallelTrainer`` given this config's context only) XGBoost runs alone."""
    global _args
    with _args_lock:
        args, _args = _args, None
    if args is None:
        yield
        return
    from xgboost.collective import CommunicatorContext

    communicator = CommunicatorContext(**args)
    communicator.__enter__()
    yield  # on an exception, no goodbye: this rank's error must reach the driver before its peers'
    communicator.__exit__(None, None, None)


def _set_args(common: dict[str, Any], tracker_uris: list[str]) -> None:
    """Runs in each worker: its CommunicatorContext arguments."""

    global _args
    rank = get_context().get_world_rank()
    with _args_lock:
        _args = {
            **common,
            "dmlc_tracker_uri": tracker_uris[rank],
            "dmlc_task_id": f"ddptrain-rank-{rank:08d}",  # the tracker sorts by it: XGBoost rank == ddptrain rank
        }


def _driver_address() -> str:
    """Runs in each worker: the IPv4 address it reaches the driver at (its ``MASTER_ADDR``,
    the driver's store)."""
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        return str(socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0])
    except OSError as exc:
        raise LaunchError(
            f"XGBoost needs an IPv4 address of the driver; {address!r} (MASTER_ADDR on host "
            f"{socket.gethostname()}) has none: {exc}."
        ) from exc


def _tracker_bind_address(addresses: list[str]) -> str:
    """Where the tracker listens: the one address every worker reaches the driver at, or
    every interface when they use several (e.g. loopback on the driver's host and the LAN
    address elsewhere)."""
    unique = sorted(set(addresses))
    return unique[0] if len(unique) == 1 else "0.0.0.0"


class _XGBoostBackend(Backend):
    def __init__(self) -> None:
        self._tracker: TrackerProcess | None = None

    def on_training_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        addresses = worker_group.execute(_driver_address)
        host = _tracker_bind_address(addresses)
        tracker = TrackerProcess(len(worker_group), host)
        self._tracker = tracker
        try:
            # After a failure the workers never come back to the tracker: stop it with the group.
            tracker.watch(lambda: worker_group.alive)
            common = {"dmlc_communicator": "rabit", "dmlc_tracker_port": tracker.port}
            _logger.debug("ddptrain: XGBoost tracker on %s:%d", host, tracker.port)
            worker_group.execute(_set_args, common, addresses)
        except BaseException:
            tracker.stop(0.0)
            raise

    def on_shutdown(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.stop(_FINISH_S)
