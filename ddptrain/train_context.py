"""``TrainContext`` and ``StorageContext``: what a worker knows of itself and its run
(returned by ``ddptrain.get_context()``; re-exported by ``ddptrain.context``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["StorageContext", "TrainContext"]


@dataclass(frozen=True)
class StorageContext:
    """Where this run's files live.

    Attributes:
        storage_path: The ``RunConfig.storage_path`` folder.
        experiment_dir_name: The run's folder name (``RunConfig.name``).
    """

    storage_path: str
    experiment_dir_name: str

    @property
    def experiment_fs_path(self) -> str:
        """The run directory."""
        return os.path.join(self.storage_path, self.experiment_dir_name)

    @property
    def storage_fs_path(self) -> str:
        return self.storage_path

    def build_checkpoint_path_from_name(self, name: str) -> str:
        """The path a checkpoint named ``name`` is persisted to."""
        return os.path.join(self.experiment_fs_path, name)


class TrainContext:
    """Facts about this worker and its run, from :func:`get_context`."""

    def __init__(
        self,
        *,
        experiment_name: str,
        world_size: int,
        world_rank: int,
        local_rank: int,
        local_world_size: int,
        node_rank: int,
        storage: StorageContext | None,
    ) -> None:
        self._experiment_name = experiment_name
        self._world_size = world_size
        self._world_rank = world_rank
        self._local_rank = local_rank
        self._local_world_size = local_world_size
        self._node_rank = node_rank
        self._storage = storage

    def get_experiment_name(self) -> str:
        """The run name (``RunConfig.name``)."""
        return self._experiment_name

    def get_world_size(self) -> int:
        """Number of workers in the group."""
        return self._world_size

    def get_world_rank(self) -> int:
        """This worker's global rank, ``0 .. world_size - 1``."""
        return self._world_rank

    def get_local_rank(self) -> int:
        """This worker's index among the workers on its host."""
        return self._local_rank

    def get_local_world_size(self) -> int:
        """Number of workers on this worker's host."""
        return self._local_world_size

    def get_node_rank(self) -> int:
        """Index of this worker's host among the group's hosts."""
        return self._node_rank

    def get_storage(self) -> StorageContext:
        """Where the run's files are persisted."""
        if self._storage is None:
            raise NotImplementedError("Local mode (`num_workers=0`) has no run storage.")
        return self._storage

    def _deprecated(self, name: str) -> Any:
        raise DeprecationWarning(f"`TrainContext.{name}()` is not available (as in Ray Train V2).")

    def get_metadata(self) -> Any:
        return self._deprecated("get_metadata")

    def get_trial_name(self) -> Any:
        return self._deprecated("get_trial_name")

    def get_trial_id(self) -> Any:
        return self._deprecated("get_trial_id")

    def get_trial_resources(self) -> Any:
        return self._deprecated("get_trial_resources")

    def get_trial_dir(self) -> Any:
        return self._deprecated("get_trial_dir")

    def __repr__(self) -> str:
        return (
            f"TrainContext(experiment_name={self._experiment_name!r}, world_rank={self._world_rank}, "
            f"world_size={self._world_size}, local_rank={self._local_rank}, node_rank={self._node_rank})"
        )
