"""Which :class:`~ddptrain.storage.base.RunStorage` holds a run: the driver's (from the run's
config) and a worker's (from the :class:`~ddptrain.wire.protocol.StorageSpec` it was sent)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import cloudpickle

from ddptrain.checkpoint import Checkpoint
from ddptrain.config import CheckpointConfig
from ddptrain.storage.base import RunStorage
from ddptrain.storage.copyback import CopyBackRunStorage
from ddptrain.storage.fsspec import FsspecRunStorage
from ddptrain.storage.local import LocalRunStorage
from ddptrain.storage.location import RunLocation

if TYPE_CHECKING:
    from ddptrain.wire.protocol import StorageSpec

__all__ = ["resume_checkpoint", "run_storage", "worker_storage"]


def run_storage(where: RunLocation, checkpoint_config: CheckpointConfig, over_hosts: bool) -> RunStorage:
    """The driver's storage of the run at ``where``.

    Args:
        where: Where the run is (``RunLocation.of(run_config)``).
        checkpoint_config: Retention settings.
        over_hosts: The run has a host list: hosts that cannot see a local run directory get
            their checkpoint files copied back.
    """
    if where.remote is not None:
        return FsspecRunStorage(where, checkpoint_config)
    if over_hosts:
        return CopyBackRunStorage(where, checkpoint_config)
    return LocalRunStorage(where, checkpoint_config)


def worker_storage(spec: StorageSpec, name: str) -> RunStorage:
    """A worker's side of run ``name``'s storage: what it stages or uploads checkpoints with.
    Nothing is read or written here."""
    where = RunLocation(name, spec.storage_path, spec.run_dir or "", spec.run_dir or "", None)
    if spec.kind == "fsspec":
        return FsspecRunStorage(where, remote=cloudpickle.loads(spec.filesystem) if spec.filesystem else None)
    if spec.kind == "copyback":
        return CopyBackRunStorage(where, local_cache=spec.local_cache)
    return LocalRunStorage(where)


def resume_checkpoint(spec: StorageSpec) -> Checkpoint | None:
    """The checkpoint a worker resumes from (``get_checkpoint()`` before its first report)."""
    if not spec.checkpoint:
        return None
    if spec.checkpoint_filesystem is not None:
        return Checkpoint._at(spec.checkpoint, cloudpickle.loads(spec.checkpoint_filesystem))
    return Checkpoint(spec.checkpoint)
