"""``TorchTrainer(use_local=True)``: rank 0 in the driver process, ranks 1.. in worker
processes, one gloo process group.

Rank 0 runs in the driver's main thread, so ``pdb``/``ipdb`` in the operator reads the
terminal's stdin (and Ctrl-C reaches it). The other ranks' part of each call runs through their
``WorkerGroup`` in a thread. Whichever side fails first, the worker processes are killed at once,
so that the other side, maybe waiting in a collective, fails too instead of waiting for the
process group's timeout; the group is then dead and the trainer replaces it.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch.distributed as dist

from ddptrain import _env
from ddptrain.backend import BackendConfig
from ddptrain.config import ScalingConfig
from ddptrain.errors import ConfigError, LaunchError, WorkerGroupError
from ddptrain.util.sgd.torch import _runner
from ddptrain.worker_group import WorkerGroup

__all__: list[str] = []

T = TypeVar("T")
_logger = logging.getLogger(__name__)
_live: LocalRankGroup | None = None  # one per process: it owns the default process group and _runner's operator


class LocalRankGroup:
    """Rank 0 here and ranks ``1..world_size-1`` in ``workers``; the interface of a
    ``WorkerGroup`` that ``TorchTrainer`` uses (``execute``, ``execute_single``, ``shutdown``...).

    Args:
        workers: The other ranks (``None`` with one worker in all); started with a backend
            that sets up nothing: :meth:`join` makes the process group.
        world_size: All ranks, this one included.
    """

    def __init__(self, workers: WorkerGroup | None, world_size: int) -> None:
        global _live
        if _live is not None and _live.alive:
            raise ConfigError(
                "Only one TorchTrainer(use_local=True) can run in a process at a time: shut the other one down first."
            )
        self.workers = workers
        self.world_size = world_size
        self.backend: Any = None  # set to None by _recovery.discard; nothing to tear down
        self._failed = False
        self._closed = False
        self._joined = False
        self._killed = False
        _live = self

    # ----------------------------------------------------------------- what TorchTrainer uses
    def __len__(self) -> int:
        return self.world_size

    @property
    def alive(self) -> bool:
        return not (self._closed or self._failed) and (self.workers is None or self.workers.alive)

    @property
    def exited(self) -> Any:
        """Workers that exited (not counting those this group killed after a failure)."""
        return self.workers.exited if self.workers is not None and not self._killed else set()

    def pump_until(self, predicate: Callable[[], bool], timeout_s: float | None = None) -> None:
        """Wait for ``predicate`` as ``WorkerGroup.pump_until`` does. After this group killed
        its workers there is nothing more to hear: ``TimeoutError`` at once (so a failure of
        the user's code is not taken for a lost worker)."""
        if self.workers is None or self._killed:
            raise TimeoutError("the workers were stopped after a failure")
        self.workers.pump_until(predicate, timeout_s=timeout_s)

    def join(self, timeout_s: float) -> None:
        """Make the gloo process group of all ranks (rank 0: this process), over a store of
        this process on loopback. Joining is bounded by ``DDPTRAIN_STORE_CONNECT_TIMEOUT_S``."""
        if self.world_size == 1:
            return
        join_s = min(timeout_s, _env.store_connect_timeout_s() or timeout_s)
        store = dist.TCPStore(
            "127.0.0.1", 0, self.world_size, True, timeout=datetime.timedelta(seconds=join_s), wait_for_workers=False
        )
        port = store.port
        try:
            self._both(
                lambda: _join_as(store, 0, self.world_size, timeout_s), _runner.join_local_group, port, timeout_s
            )
        except BaseException:
            self._failed = True
            raise
        self._joined = True

    def execute(self, fn: Callable[..., T], *args: Any) -> list[T]:
        """``fn(*args)`` on every rank at once (rank 0 here, in this thread); results in rank order."""
        return self._both(lambda: fn(*args), fn, *args)

    def execute_single(self, rank: int, fn: Callable[..., T], *args: Any) -> T:
        if rank == 0:
            return fn(*args)
        if self.workers is None or not 0 < rank < self.world_size:
            raise IndexError(f"`rank` must be in [0, {self.world_size}), got {rank}.")
        return self.workers.execute_single(rank - 1, fn, *args)

    def shutdown(self, grace_s: float | None = None) -> None:
        """Stop the workers, and leave the process group and drop rank 0's operator here. Safe
        to call twice."""
        global _live
        if self._closed:
            return
        self._closed = True
        try:
            if self.workers is not None:
                if self._failed:
                    self.workers.backend = None
                    self.workers.shutdown(grace_s=0)
                else:
                    self.workers.shutdown(grace_s)
        finally:
            _runner.teardown()
            if self._joined and dist.is_initialized():
                dist.destroy_process_group()
            if _live is self:
                _live = None

    # ----------------------------------------------------------------- one call on both sides
    def _both(self, here: Callable[[], T], fn: Callable[..., Any], *args: Any) -> list[T]:
        if not self.alive:
            raise WorkerGroupError("The worker group is not running (it was shut down or one of its workers died).", {})
        if self.workers is None:
            return [here()]
        remote: dict[str, Any] = {}
        remote_failed = threading.Event()
        workers = self.workers

        def run_remote() -> None:
            try:
                remote["results"] = workers.execute(fn, *args)
            except BaseException as exc:  # raised in the caller's thread below
                remote["error"] = exc
                remote_failed.set()
                self._kill_workers()  # rank 0 may wait for them in a collective: make it fail now

        thread = threading.Thread(target=run_remote, name="ddptrain-sgd-local", daemon=True)
        thread.start()
        try:
            local = here()
        except BaseException as exc:
            self._failed = True
            failed_there_first = remote_failed.is_set()  # then rank 0 failed because they were killed
            self._kill_workers()  # they may wait for rank 0 in a collective
            thread.join(timeout=_env.shutdown_grace_s() + 30.0)
            if failed_there_first:
                raise remote["error"] from exc
            raise
        thread.join()  # rank 0 is done: the others finish the same collectives
        if "error" in remote:
            self._failed = True
            raise remote["error"]
        return [local, *remote["results"]]

    def _kill_workers(self) -> None:
        """SIGKILL the worker processes (children of this machine's agent, ours)."""
        if self.workers is None:
            return
        self._killed = True
        for pid, _host in list(self.workers.hosts.values()):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def launch(
    workers: int, cpus_per_worker: float, log_dir: str | os.PathLike[str] | None, timeout_s: float
) -> WorkerGroup:
    """Rank 0 here and ``workers - 1`` worker processes (which set up no process group of their
    own), joined in one gloo group. It has the interface of a ``WorkerGroup`` that
    ``TorchTrainer`` uses, hence its type."""
    remote = None
    if workers > 1:
        scaling = ScalingConfig(num_workers=workers - 1, use_gpu=False, resources_per_worker={"CPU": cpus_per_worker})
        remote = WorkerGroup.launch(scaling, backend_config=BackendConfig(), log_dir=log_dir)
    group = None
    try:
        group = LocalRankGroup(remote, workers)
        group.join(timeout_s)
    except BaseException:
        if group is not None:
            group._failed = True
            group.shutdown(grace_s=0)
        elif remote is not None:
            remote.backend = None
            remote.shutdown(grace_s=0)
        raise
    return cast(WorkerGroup, group)


def _join_as(store: dist.TCPStore, rank: int, world_size: int, timeout_s: float) -> None:
    try:
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
    except RuntimeError as exc:
        raise LaunchError(
            f"The driver (rank 0, use_local=True) could not join the workers' process group: {exc}"
        ) from exc
    _runner.set_placement(rank, world_size)
