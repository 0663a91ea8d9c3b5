"""``CopyBackRunStorage``: the run directory lives on the driver's machine, and hosts that
cannot see it get their checkpoint files copied back.

A worker on such a host stages its checkpoint files in the host's private staging folder
(``StorageSpec.local_cache``, made by the launcher when it found that the host does not see
the run directory); before the driver commits the checkpoint it copies them into the run
directory's staging area through the :class:`~ddptrain.storage.base.FileTransfer` the
launcher supplies (SFTP over the agent's SSH connection). A copy that fails raises the
launcher's ``LaunchError`` naming the host: the rank failed.
"""

from __future__ import annotations

from ddptrain.checkpoint import Checkpoint
from ddptrain.config import CheckpointConfig
from ddptrain.storage import layout
from ddptrain.storage.base import FileTransfer
from ddptrain.storage.local import LocalRunStorage
from ddptrain.storage.location import RunLocation

__all__ = ["CopyBackRunStorage"]


class CopyBackRunStorage(LocalRunStorage):
    """A run directory on the driver's machine, for workers on hosts that may not see it.

    Args:
        where: Where the run is.
        checkpoint_config: Retention settings.
        local_cache: On a worker's side: the host's staging folder when the host cannot see
            the run directory (``None``: it sees it, and stages there).
    """

    kind = "copyback"

    def __init__(
        self, where: RunLocation, checkpoint_config: CheckpointConfig | None = None, local_cache: str | None = None
    ) -> None:
        super().__init__(where, checkpoint_config)
        self.local_cache = local_cache

    def stage(self, source: str, name: str, attempt: int, index: int, rank: int, move: bool = False) -> str:
        """Stage in the run directory, or in the host's staging folder when the host cannot
        see it (the driver copies the files back before it commits them)."""
        folder = self.run_dir if self.local_cache is None else self.local_cache
        return layout.stage_files(folder, source, attempt, index, rank, move=move)

    def adopt(self, checkpoint: Checkpoint, name: str, what: str) -> str:
        if self.local_cache is not None:
            raise ValueError(
                f"{what}: this host cannot see the run directory {self.run_dir}, so ddptrain must copy "
                "the checkpoint back; use `CheckpointUploadMode.SYNC` or `ASYNC` without `checkpoint_upload_fn`."
            )
        return super().adopt(checkpoint, name, what)

    def collect(self, rank: int, attempt: int, index: int, staged: str, transfer: FileTransfer | None) -> str:
        """The staged folder of ``rank`` on this machine: copied back through ``transfer`` when
        its host cannot see the run directory, into the run's staging area (a failed
        attempt's leftovers go with it).

        Raises:
            LaunchError: The copy failed (``transfer`` names the host).
            DiskFullError: This machine's disk is full; names the folder.
        """
        if transfer is None or rank not in transfer.unshared_ranks:
            return staged
        local = str(self.layout.fetched(attempt, index, rank))
        with layout.naming_full_disk(local):
            transfer.fetch_dir(rank, staged, local)
        return local
