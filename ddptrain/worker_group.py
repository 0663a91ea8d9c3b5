"""``from ddptrain.worker_group import WorkerGroup``, the path docs/how-it-works.md documents
for driving workers yourself: a shim that re-exports :mod:`ddptrain.driver.worker_group`, where
the group lives."""

from ddptrain.driver.worker_group import GroupFailed, WorkerGroup, WorkerMetadata

__all__ = ["GroupFailed", "WorkerGroup", "WorkerMetadata"]
