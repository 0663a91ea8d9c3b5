"""The runs that ``ddptrain runs``, ``show``, ``logs``, ``export`` and ``plot`` read: a run
folder of this machine, or a run on remote storage (``s3://bucket/prefix/name``).

A run on remote storage is read from a copy of its small files (``run.json``,
``metrics.jsonl``, ``checkpoints.json``; a log file when one is asked for), pulled into a
private folder under ``$DDPTRAIN_CACHE_DIR/read/``, never into a driver's working copy. Its
checkpoints are listed where they are, on the store.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ddptrain import _env
from ddptrain.storage import layout as storage
from ddptrain.storage import run_files
from ddptrain.storage.checkpoint_manager import CheckpointManager
from ddptrain.storage.layout import RunLayout
from ddptrain.storage.lock import driver_is_alive
from ddptrain.storage.remote import RemoteRoot, on_remote_storage, resolve
from ddptrain.storage.remote_checkpoints import RemoteCheckpointManager

__all__ = ["RunNotFound", "RunView", "find_run", "list_views", "open_run"]


class RunNotFound(Exception):
    """No run directory by that name or path."""


def find_run(run: str) -> Path:
    """A local run directory from a path, or a run name under the default storage path."""
    if on_remote_storage(run):
        raise RunNotFound(
            f"{run} is on remote storage; this command needs a run folder of this machine. The driver that ran "
            f"it keeps a working copy under {_env.cache_dir()}/runs/."
        )
    path = Path(run.removeprefix("file://")).expanduser()
    if RunLayout(path).run_json.is_file():
        return path.resolve()
    candidate = Path(_env.default_storage_path(), run).expanduser()
    if RunLayout(candidate).run_json.is_file():
        return candidate.resolve()
    raise RunNotFound(
        f"no run {run!r}: neither {path} nor {candidate} is a ddptrain run directory (no {RunLayout.RUN_JSON})"
    )


@dataclass(frozen=True)
class RunView:
    """A run, as the inspection commands read it.

    Attributes:
        folder: A folder of this machine with the run's files: the run directory itself, or
            a private copy of the small files of a run on remote storage.
        shown: The run as users name it: its path, or its URI.
        remote: The storage root a run on remote storage is under (``None``: a local run).
    """

    folder: Path
    shown: str
    remote: RemoteRoot | None = None

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.folder)

    def shown_path(self, path: Path) -> str:
        """A file of the run (a path below ``folder``) as users know it."""
        return str(path) if self.remote is None else f"{self.shown}/{path.relative_to(self.folder).as_posix()}"

    def checkpoints(self) -> CheckpointManager:
        """The run's committed checkpoints (on the store, for a run on remote storage).

        Raises:
            RunDirectoryError: The checkpoint index cannot be read.
        """
        if self.remote is None:
            return CheckpointManager.from_run_dir(str(self.folder))
        return RemoteCheckpointManager.from_copy(str(self.folder), self.remote, self.remote.path(self.name))

    def driver_alive(self, info: dict[str, Any]) -> bool | None:
        """Whether a live driver holds the run (``info``: its ``run.json``). For a run on remote
        storage that is known only on the host its driver ran on, where the driver's working
        copy is; ``None`` elsewhere."""
        if self.remote is None:
            return driver_is_alive(self.folder)
        if driver_is_alive(Path(self.remote.cache_dir(self.name))):
            return True
        return False if info.get("host") == socket.gethostname() else None

    def attempts(self) -> list[int]:
        """The numbers of the attempts that left logs, in order.

        Raises:
            RunFileError: ``logs`` is not a folder of the run (a link, a file).
        """
        if self.remote is None:
            return RunLayout.attempt_numbers(run_files.list_folder(self.folder, RunLayout.LOGS))
        return RunLayout.attempt_numbers(self.remote.list_names(self.remote.path(self.name, RunLayout.LOGS)))

    def _log_name(self, attempt: int, rank: int | None = None) -> str:
        """An attempt's log folder, or a rank's log file in it (relative, posix)."""
        folder = RunLayout.attempt_logs_name(attempt)
        return folder if rank is None else f"{folder}/{RunLayout.rank_log_name(rank)}"

    def log_ranks(self, attempt: int) -> list[int]:
        """The ranks that left a log in ``attempt``, in order.

        Raises:
            RunFileError: The attempt's log folder is not a folder of the run.
        """
        if self.remote is None:
            return RunLayout.log_ranks(run_files.list_folder(self.folder, self._log_name(attempt)))
        return RunLayout.log_ranks(self.remote.list_names(self.remote.path(self.name, self._log_name(attempt))))

    def open_log(self, attempt: int, rank: int) -> IO[bytes] | None:
        """A rank's log of an attempt, open for reading (downloaded first for a run on remote
        storage), or ``None`` when there is none.

        Raises:
            RunFileError: It is not a regular file of the run (a link, a FIFO...).
        """
        name = self._log_name(attempt, rank)
        if self.remote is not None:
            data = self.remote.read_bytes(self.remote.path(self.name, name))
            if data is None:
                return None
            path = self.folder / name
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            storage.write_atomic(path, data, private=True)
        return run_files.open_file(self.folder, name)


def _pull(root: RemoteRoot, name: str) -> RunView | None:
    """Run ``name`` under ``root``, its small files pulled; ``None`` when it is not a run."""
    folder = root.cache_dir(name, purpose="read")
    if not root.pull_run(root.path(name), folder):
        return None
    return RunView(Path(folder), root.shown(root.path(name)), root)


def _open_remote(uri: str) -> RunView:
    base, _, query = uri.partition("?")  # URI options (`?endpoint_override=...`) are the file system's
    scheme, _, rest = base.partition("://")
    parent, _, name = rest.rstrip("/").rpartition("/")
    if not parent or not name:
        raise RunNotFound(f"no run {uri!r}: give a run's URI, such as {scheme}://bucket/prefix/name")
    root = resolve(f"{scheme}://{parent}" + (f"?{query}" if query else ""))
    if root is None:  # a scheme fsspec serves from the local file system
        return RunView(find_run(uri), uri)
    view = _pull(root, name)
    if view is None:
        raise RunNotFound(f"no run {uri!r}: {uri} is not a ddptrain run (it has no {RunLayout.RUN_JSON})")
    return view


def open_run(run: str) -> RunView:
    """A run from its path or URI, or from its name under the default storage path (which may
    be a URI itself).

    Raises:
        RunNotFound: There is no such run; says where it was looked for.
        ConfigError: The URI's file system is not installed (names the extra to install).
    """
    if on_remote_storage(run):
        return _open_remote(run)
    default = _env.default_storage_path()
    if on_remote_storage(default) and not RunLayout(Path(run).expanduser()).run_json.is_file():
        base, _, query = default.partition("?")
        return _open_remote(f"{base.rstrip('/')}/{run}" + (f"?{query}" if query else ""))
    folder = find_run(run)
    return RunView(folder, str(folder))


def list_views(storage_path: str) -> list[RunView]:
    """Every run directly under ``storage_path``, a local folder or a URI (a link to a folder
    elsewhere is not one of its runs)."""
    if on_remote_storage(storage_path):
        root = resolve(storage_path)
        if root is not None:
            views = [_pull(root, name) for name in root.list_names(root.root)]
            return [view for view in views if view is not None]
    folder = Path(storage_path.removeprefix("file://")).expanduser().resolve()
    if not folder.is_dir():
        return []
    return [RunView(p, str(p)) for p in sorted(folder.iterdir()) if run_files.is_run(p)]
