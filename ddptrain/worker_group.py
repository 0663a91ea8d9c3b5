"""``WorkerGroup``: the driver's handle on the running workers, given to ``Backend`` hooks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from ddptrain.driver import Attempt

__all__ = ["WorkerGroup", "WorkerMetadata"]

T = TypeVar("T")


@dataclass(frozen=True)
class WorkerMetadata:
    """Where one worker runs (also reachable as ``worker.metadata``, Ray's spelling)."""

    rank: int
    hostname: str
    pid: int

    @property
    def metadata(self) -> WorkerMetadata:
        return self

    @property
    def node_ip(self) -> str:
        return self.hostname


class WorkerGroup:
    """Runs functions on the workers of the current attempt.

    ``fn`` is pickled with cloudpickle and run in each worker process; exceptions it raises
    fail the run with the worker's traceback.
    """

    def __init__(self, attempt: Attempt) -> None:
        self._attempt = attempt

    def execute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every worker at once; results in rank order."""
        return self._attempt.execute(list(range(len(self))), fn, args, kwargs)

    def execute_single(self, worker_index: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the worker of rank ``worker_index``."""
        if not 0 <= worker_index < len(self):
            raise IndexError(f"`worker_index` must be in [0, {len(self)}), got {worker_index}.")
        return self._attempt.execute([worker_index], fn, args, kwargs)[0]

    def __len__(self) -> int:
        return self._attempt.world_size

    def get_resources_per_worker(self) -> dict[str, float]:
        """The resources each worker was given (``CPU``, ``GPU``)."""
        scaling = self._attempt.run.scaling_config
        return {"CPU": scaling.num_cpus_per_worker, "GPU": scaling.num_gpus_per_worker}

    def get_workers(self) -> list[WorkerMetadata]:
        """Host and pid of every worker, in rank order."""
        hosts = self._attempt.hosts
        return [WorkerMetadata(rank, hosts[rank][1], hosts[rank][0]) for rank in range(len(self))]
