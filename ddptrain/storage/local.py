"""``LocalRunStorage``: a run directory on a file system every worker sees.

The run's files are written in place: checkpoints are staged next to the run directory by
each rank and committed by the driver (``CheckpointManager``: an intent file, a rename as the
commit point, recovery on resume).
"""

from __future__ import annotations

from ddptrain.config import CheckpointConfig
from ddptrain.storage.base import RunStorage
from ddptrain.storage.checkpoint_manager import CheckpointManager
from ddptrain.storage.location import Earlier, load_earlier

__all__ = ["LocalRunStorage"]


class LocalRunStorage(RunStorage):
    """A run directory that the driver and every worker see (see :class:`RunStorage`)."""

    kind = "local"

    def _manager(self, config: CheckpointConfig) -> CheckpointManager:
        return CheckpointManager(self.run_dir, config)

    def load_earlier(self) -> Earlier:
        return load_earlier(self.where, self.checkpoints, None)
