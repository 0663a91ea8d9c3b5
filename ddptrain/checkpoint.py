"""``Checkpoint``: a handle to a directory of files (used in workers and the driver)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddptrain.storage import remote

__all__ = ["Checkpoint"]

_METADATA_FILE = ".metadata.json"
# The folders that to_directory() and as_directory() download into start with it (Ray's).
_TEMP_PREFIX = "checkpoint_tmp_"


class Checkpoint:
    """A directory of checkpoint files, on a local or shared file system or on remote storage.

    Build one from a directory your training function wrote, and pass it to
    :func:`ddptrain.report`; ddptrain copies it into the run directory. The checkpoint you
    get back (``Result.checkpoint``, ``get_checkpoint()``) points at the persisted copy: on
    remote storage (``s3://...``) ``to_directory()`` and ``as_directory()`` download it.

    Args:
        path: The checkpoint directory: a local path, a URI (``s3://bucket/run/checkpoint_000001``),
            or with ``filesystem`` a path on that file system.
        filesystem: An fsspec or ``pyarrow.fs`` file system the path is on (``None``: local, or
            the URI's).

    Example:
        >>> with tempfile.TemporaryDirectory() as d:
        ...     torch.save(model.state_dict(), os.path.join(d, "model.pt"))
        ...     ddptrain.report({"loss": 0.1}, checkpoint=Checkpoint.from_directory(d))
    """

    def __init__(self, path: str | os.PathLike[str], filesystem: Any = None) -> None:
        text = os.fspath(path)
        if text.startswith("file://"):
            text = text[len("file://") :]
        self._fs: Any = None
        if filesystem is not None or "://" in text:
            if filesystem is not None:
                if "://" in text:
                    raise ValueError(
                        f"With `filesystem`, `path` is a path on that file system, not a URI: got {text!r}."
                    )
                self._fs = remote.to_fsspec(filesystem)
            else:
                self._fs, bare, has_options = remote.resolve_uri(text)
                if has_options:  # the options are the file system's: the path is a path on it (Ray's rule)
                    text = bare
            protocols = (self._fs.protocol,) if isinstance(self._fs.protocol, str) else tuple(self._fs.protocol)
            if "file" in protocols or "local" in protocols:
                self._fs = None
        self.path: str = text.rstrip("/") if self._fs is not None else os.path.abspath(os.path.expanduser(text))

    @classmethod
    def _at(cls, path: str, fs: Any) -> Checkpoint:
        """A checkpoint at ``path`` (a URI or a path on ``fs``) on the fsspec file system ``fs``."""
        checkpoint = cls.__new__(cls)
        checkpoint._fs = fs
        checkpoint.path = path.rstrip("/")
        return checkpoint

    @property
    def filesystem(self) -> Any:
        """The file system the checkpoint is on: ``None`` for a local path; for remote storage a
        ``pyarrow.fs.FileSystem`` when pyarrow is installed (what Ray code expects; fsspec file
        systems are wrapped), else the fsspec file system. It takes :attr:`path` as it is
        (``checkpoint.filesystem.open_input_file(checkpoint.path + "/model.pt")``), with or
        without its scheme."""
        if self._fs is None:
            return None
        return remote.to_pyarrow(self._fs, uri_paths=remote.is_uri(self.path))

    def _store(self) -> remote.RemoteRoot:
        """The checkpoint's folder as a storage root (its calls are bounded, see ``remote_calls``)."""
        scheme = self.path.split("://", 1)[0] if remote.is_uri(self.path) else None
        return remote.RemoteRoot(self._fs, self._fs._strip_protocol(self.path), scheme)

    @property
    def is_remote(self) -> bool:
        """Whether the files are on a remote file system (reading them downloads them)."""
        return self._fs is not None

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """A checkpoint for an existing local directory (nothing is copied)."""
        return cls(path)

    def to_directory(self, path: str | os.PathLike[str] | None = None) -> str:
        """Copy the checkpoint files into ``path`` (a new temporary folder by default).

        The new temporary folder is private (0700), whatever the checkpoint's own mode: the
        copy in /tmp must not open to other users a checkpoint that sits in a private run
        folder. Concurrent calls on one host for the same target are safe: one copies, the
        others wait for it and reuse the result.

        Returns:
            The directory holding the files.

        Raises:
            FileNotFoundError: The checkpoint does not exist; names its path.
        """
        from filelock import FileLock

        if path is None:
            return self._to_private_temp()
        target = Path(path).absolute()
        if target == Path(self.path):
            return str(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        # The marker says "target holds a complete copy of this checkpoint"; it stays, so that
        # callers that waited on the lock reuse the copy instead of copying over it.
        done_marker = target.parent / f".{target.name}.complete"
        with FileLock(str(target.parent / f".{target.name}.lock")):
            if not (done_marker.exists() and target.is_dir() and done_marker.read_text() == self.path):
                existed = target.exists()
                try:
                    if self._fs is not None:
                        self._download(str(target))
                    else:
                        shutil.copytree(self.path, target, dirs_exist_ok=True)
                except BaseException:
                    if not existed:  # leave no half copy behind (nor an empty folder for a missing checkpoint)
                        shutil.rmtree(target, ignore_errors=True)
                    raise
                done_marker.write_text(self.path)
        return str(target)

    def _to_private_temp(self) -> str:
        """Copy the files into a new private temporary folder (a fresh name: nobody else copies
        into it, so no lock is needed)."""
        target = tempfile.mkdtemp(prefix=_TEMP_PREFIX)  # 0700
        try:
            if self._fs is not None:
                self._download(target)
            elif not os.path.isdir(self.path):
                raise FileNotFoundError(f"The checkpoint folder {self.path} does not exist.")
            else:
                for entry in os.scandir(self.path):  # `copytree` would give the folder the source's mode
                    dest = os.path.join(target, entry.name)
                    if entry.is_dir():
                        shutil.copytree(entry.path, dest)
                    else:
                        shutil.copy2(entry.path, dest)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        return target

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """Yield a local directory with the checkpoint files: the checkpoint itself (no copy),
        or for a remote checkpoint a temporary download, deleted afterwards.

        Treat it as read-only.

        Raises:
            FileNotFoundError: A remote checkpoint does not exist; names its path.
        """
        if self._fs is None:
            yield self.path
            return
        with tempfile.TemporaryDirectory(prefix=_TEMP_PREFIX) as tmp:
            self._download(tmp)
            yield tmp

    def _download(self, target: str) -> None:
        """Download a remote checkpoint's files into ``target``."""
        store = self._store()
        store.download_dir(store.root, target)

    def get_metadata(self) -> dict[str, Any]:
        """The metadata dict stored with the checkpoint (``{}`` when there is none)."""
        if self._fs is not None:
            store = self._store()
            raw = store.read_bytes(store.path(_METADATA_FILE))
            data_: dict[str, Any] = json.loads(raw) if raw is not None else {}
            return data_
        file = Path(self.path, _METADATA_FILE)
        if not file.exists():
            return {}
        data: dict[str, Any] = json.loads(file.read_text())
        return data

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Replace the metadata. It must be JSON-serializable."""
        text = json.dumps(metadata)
        if self._fs is not None:
            store = self._store()
            store.write_bytes(store.path(_METADATA_FILE), text.encode())
            return
        file = Path(self.path, _METADATA_FILE)
        tmp = file.with_name(f"{_METADATA_FILE}.{uuid.uuid4().hex}.tmp")
        tmp.write_text(text)
        os.replace(tmp, file)

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        """Merge ``metadata`` into the stored metadata."""
        merged = self.get_metadata()
        merged.update(metadata)
        self.set_metadata(merged)

    def __fspath__(self) -> str:
        raise TypeError(
            "A Checkpoint is not a path. Use `checkpoint.path`, or "
            "`with checkpoint.as_directory() as d:` to read its files."
        )

    def __repr__(self) -> str:
        where = "local" if self._fs is None else type(self._fs).__name__
        return f"Checkpoint(filesystem={where}, path={self.path})"

    def _fs_key(self) -> Any:
        return None if self._fs is None else self._fs.protocol

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and other.path == self.path and other._fs_key() == self._fs_key()

    def __hash__(self) -> int:
        return hash(self.path)

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_fs", None)  # pickled by an older ddptrain
        state.pop("filesystem", None)
        self.__dict__.update(state)
