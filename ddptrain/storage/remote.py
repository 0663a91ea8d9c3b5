"""Run storage on a remote file system (``s3://``, ``gs://``, ... through fsspec).

A run whose ``storage_path`` is a URI, or that was given a ``storage_filesystem``, keeps its
files on that file system. The driver works in a local copy of the run's small files (the
lock, ``run.json``, ``metrics.jsonl``, ``checkpoints.json``, logs) under
``$DDPTRAIN_CACHE_DIR`` and uploads them as they change; workers upload their checkpoint
files straight to the store, never through the driver. ``checkpoints.json`` is written last,
so a checkpoint exists for readers only once all its files do.

Every call to the store is bounded (:mod:`ddptrain.storage.remote_calls`); on a file system with real
folders, the folders a file goes into are created when missing. How a URI becomes a file
system is :mod:`ddptrain.storage.remote_uri`'s.

fsspec and the scheme's implementation (``s3fs``, ``gcsfs``, ``adlfs``) are optional; a missing
one raises :class:`~ddptrain.errors.ConfigError` naming the extra to install.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ddptrain import _env
from ddptrain.errors import ConfigError, StorageError
from ddptrain.storage import layout as storage
from ddptrain.storage import remote_calls, remote_uri

__all__ = ["RemoteRoot", "is_uri", "on_remote_storage", "resolve", "resolve_uri", "to_fsspec", "to_pyarrow"]

T = TypeVar("T")

# Environment variables that carry a scheme's credentials and endpoint to workers on other hosts.
_CREDENTIAL_PREFIXES = ("AWS_", "GOOGLE_", "GCS", "AZURE_")


def is_uri(text: str) -> bool:
    """Whether ``text`` is a URI with a scheme (``file://`` counts as one)."""
    return "://" in text


def on_remote_storage(path: str) -> bool:
    """Whether ``path`` is a URI of remote storage (``file://`` ones are local paths)."""
    return is_uri(path) and not path.startswith("file://")


def to_fsspec(filesystem: Any) -> Any:
    """An fsspec file system for ``filesystem``: fsspec ones as they are, ``pyarrow.fs`` ones
    wrapped (fsspec's ``ArrowFSWrapper``)."""
    fsspec = remote_uri.import_fsspec()
    if isinstance(filesystem, fsspec.AbstractFileSystem):
        return filesystem
    if type(filesystem).__module__.startswith("pyarrow"):
        from fsspec.implementations.arrow import ArrowFSWrapper

        handler = getattr(filesystem, "handler", None)  # a PyFileSystem wrapping fsspec: unwrap it
        inner = getattr(handler, "fs", None)
        return inner if isinstance(inner, fsspec.AbstractFileSystem) else ArrowFSWrapper(filesystem)
    raise ConfigError(
        f"`storage_filesystem` must be an fsspec or a pyarrow.fs file system, got {type(filesystem).__name__}."
    )


def to_pyarrow(fs: Any, uri_paths: bool = False) -> Any:
    """``fs`` as a ``pyarrow.fs.FileSystem`` (what Ray code expects of ``Checkpoint.filesystem``)
    when pyarrow is installed; the fsspec file system itself otherwise. It takes the paths that
    go with it: with ``uri_paths`` (paths that keep their scheme, ``s3://bucket/...``) it is
    always fsspec's file system wrapped (``PyFileSystem(FSSpecHandler(fs))``, which strips the
    scheme), since a bare pyarrow file system refuses URIs."""
    try:
        import pyarrow.fs as pafs
    except ImportError:
        return fs
    wrapped = getattr(fs, "fs", None)  # an ArrowFSWrapper around a pyarrow file system
    if isinstance(wrapped, pafs.FileSystem) and not uri_paths:
        return wrapped
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def resolve_uri(uri: str) -> tuple[Any, str, bool]:
    """The fsspec file system of a URI (a checkpoint's path), the path on it, and whether the
    URI had options (see :func:`ddptrain.remote_uri.filesystem_for`).

    Raises:
        ConfigError: The scheme's file system is not installed, or the URI cannot be used.
    """
    return remote_uri.filesystem_for(uri)


@dataclass
class RemoteRoot:
    """Where a run's storage root is on a remote file system.

    Attributes:
        fs: The fsspec file system.
        root: The root on ``fs`` (no scheme).
        scheme: ``"s3"`` etc. when the user gave a URI (paths shown to users are URIs then), or
            ``None`` when they gave ``storage_filesystem`` or a URI with options (paths are paths
            on it, like Ray).

    Every call to the store has a deadline (see :mod:`ddptrain.storage.remote_calls`): one that does not
    answer raises :class:`~ddptrain.errors.StorageError` naming the store.
    """

    fs: Any
    root: str
    scheme: str | None
    # The caller is stopping (Ctrl-C): each call gets a bound of a few seconds.
    stopping: bool = field(default=False, compare=False, repr=False)

    def path(self, *parts: str) -> str:
        """A path on ``fs`` below the root."""
        return posixpath.join(self.root, *parts)

    def shown(self, path: str) -> str:
        """``path`` as users see it: a URI if the storage was given as one."""
        return f"{self.scheme}://{path}" if self.scheme else path

    def display(self) -> str:
        return self.shown(self.root)

    def cache_dir(self, name: str, purpose: str = "runs") -> str:
        """A local folder for run ``name``'s small files: the driver's working copy
        (``purpose="runs"``), or the copy that ``ddptrain show`` and friends read
        (``"read"``; kept apart so that reading a run never touches a live driver's files)."""
        key = hashlib.sha256(f"{self.fs.protocol}|{self.root}".encode()).hexdigest()[:16]
        return os.path.join(_env.cache_dir(), purpose, key, name)

    # ------------------------------------------------------------- calls, each with a deadline
    def _call(self, what: str, fn: Callable[[remote_calls.Watch], T], size: int = 0) -> T:
        try:
            return remote_calls.call(self.fs, self.display(), what, fn, size=size, stopping=self.stopping)
        except KeyboardInterrupt:
            self.stopping = True  # what is left to do on the way out gets a short bound
            raise

    def _makes_folders(self) -> bool:
        # Object stores have no folders to create (their paths start with a bucket; s3fs, gcsfs and
        # adlfs have `split_path`), and creating a missing bucket is not ddptrain's to do.
        return not hasattr(self.fs, "split_path")

    def _writing(self, remote: str, what: str, write: Callable[[remote_calls.Watch], Any], size: int = 0) -> None:
        """``write`` (which writes ``remote``), creating the missing folders above ``remote`` on a
        file system that has real folders (as Ray creates the folders it writes into)."""
        try:
            self._call(what, write, size)
            return
        except FileNotFoundError:
            parent = posixpath.dirname(remote.rstrip("/"))
            if not parent or not self._makes_folders():
                raise
        self._call(f"creating the folder {self.shown(parent)}", lambda _: self.fs.makedirs(parent, exist_ok=True))
        self._call(what, write, size)

    def upload_file(self, local: str, remote: str) -> None:
        def put(watch: remote_calls.Watch) -> None:
            self.fs.put_file(local, remote, callback=remote_calls.progress_callback(watch))

        self._writing(remote, f"uploading {self.shown(remote)}", put, os.path.getsize(local))

    def upload_dir(self, local: str, remote: str) -> None:
        """Upload every file below ``local`` to ``remote`` (same relative paths)."""
        for src_root, _dirs, files in os.walk(local):
            rel = os.path.relpath(src_root, local)
            for file in files:
                target = posixpath.normpath(posixpath.join(remote, rel.replace(os.sep, "/"), file))
                self.upload_file(os.path.join(src_root, file), target)

    def _files(self, remote: str) -> dict[str, dict[str, Any]]:
        """Every file below ``remote``, with its fsspec info (size...); ``{}`` when there are none."""
        try:
            found: dict[str, dict[str, Any]] = self._call(
                f"listing {self.shown(remote)}", lambda _: self.fs.find(remote, detail=True)
            )
        except FileNotFoundError:
            return {}
        return found

    def file_sizes(self, remote: str) -> dict[str, int]:
        """The size of every file below ``remote``, by its path relative to ``remote``."""
        remote = remote.rstrip("/")
        return {
            posixpath.relpath(self.bare_path(path), remote): int(info.get("size") or 0)
            for path, info in self._files(remote).items()
        }

    def download_dir(self, remote: str, local: str) -> None:
        """Download every file below ``remote`` into ``local``.

        Raises:
            FileNotFoundError: Nothing is at ``remote``; names it.
        """
        remote = remote.rstrip("/")
        found = self._files(remote)
        if not found and not self._call(f"looking up {self.shown(remote)}", lambda _: self.fs.isdir(remote)):
            raise FileNotFoundError(errno.ENOENT, f"{self.shown(remote)} does not exist", self.shown(remote))
        for path, info in found.items():
            rel = posixpath.relpath(self.bare_path(path), remote)
            if rel == ".":
                raise NotADirectoryError(errno.ENOTDIR, f"{self.shown(remote)} is a file, not a folder")
            target = Path(local, *rel.split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)

            def get(watch: remote_calls.Watch, path: str = path, target: Path = target) -> None:
                watch.observe(remote_calls.local_size(str(target)))
                self.fs.get_file(path, str(target), callback=remote_calls.progress_callback(watch))

            self._call(f"downloading {self.shown(self.bare_path(path))}", get, int(info.get("size") or 0))

    def copy_dir(self, folder: str, final: str) -> None:
        """Copy every file below ``folder`` to the same place below ``final`` (server-side)."""
        for path, info in self._files(folder).items():
            bare = self.bare_path(path)
            target = posixpath.join(final, posixpath.relpath(bare, folder))

            def copy(_: remote_calls.Watch, bare: str = bare, target: str = target) -> None:
                self.fs.copy(bare, target)

            what = f"copying {self.shown(bare)} to {self.shown(target)}"
            self._writing(target, what, copy, int(info.get("size") or 0))

    def bare_path(self, path: str) -> str:
        """A path listed by ``fs`` (which may carry the scheme) as a plain path on it."""
        stripped: str = self.fs._strip_protocol(path)
        return stripped

    def read_bytes(self, remote: str) -> bytes | None:
        """The object's bytes, or ``None`` if it does not exist."""
        try:
            data: bytes = self._call(f"reading {self.shown(remote)}", lambda _: self.fs.cat_file(remote))
        except FileNotFoundError:
            return None
        return data

    def pull_run(self, run_path: str, local: str) -> bool:
        """Copy the small files of the run at ``run_path`` (``RunLayout.SMALL_FILES``) into the
        folder ``local`` of this machine, to read the run there. Each is written atomically and
        private to the user (``run.json`` holds the command line); a copy of one the store no
        longer has is removed. Returns ``False``, copying nothing, when ``run_path`` holds no
        run (no ``run.json``)."""
        layout = storage.RunLayout
        run_json = self.read_bytes(posixpath.join(run_path, layout.RUN_JSON))
        if run_json is None:
            return False
        os.makedirs(local, mode=0o700, exist_ok=True)
        for name in layout.SMALL_FILES:
            data = run_json if name == layout.RUN_JSON else self.read_bytes(posixpath.join(run_path, name))
            if data is None:
                Path(local, name).unlink(missing_ok=True)
            else:
                storage.write_atomic(Path(local, name), data, private=True)
        return True

    def write_bytes(self, remote: str, data: bytes) -> None:
        self._writing(remote, f"writing {self.shown(remote)}", lambda _: self.fs.pipe_file(remote, data), len(data))

    def remove_dir(self, remote: str) -> None:
        try:
            self._call(f"deleting {self.shown(remote)}", lambda _: self.fs.rm(remote, recursive=True))
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(remote)

    def remove_file(self, remote: str) -> None:
        try:
            self._call(f"deleting {self.shown(remote)}", lambda _: self.fs.rm_file(remote))
        except FileNotFoundError:
            pass

    def list_names(self, remote: str) -> list[str]:
        """Names of the entries directly below ``remote`` (``[]`` when there are none)."""
        self.fs.invalidate_cache(remote)
        try:
            entries = self._call(f"listing {self.shown(remote)}", lambda _: self.fs.ls(remote, detail=False))
        except FileNotFoundError:
            return []
        return [posixpath.basename(self.bare_path(p).rstrip("/")) for p in entries]

    def exists(self, remote: str) -> bool:
        self.fs.invalidate_cache(remote)
        return bool(self._call(f"looking up {self.shown(remote)}", lambda _: self.fs.exists(remote)))

    def check_writable(self) -> None:
        """Write and delete a small object under the root, so that a missing bucket or missing
        permissions fail before any worker starts. Missing folders are created on a file system
        that has folders.

        Raises:
            ConfigError: The root cannot be written; says why.
            StorageError: The store did not answer in time.
        """
        probe = self.path(f".ddptrain_probe_{uuid.uuid4().hex}")
        try:
            self.write_bytes(probe, b"")
            self.remove_file(probe)
        except StorageError:
            raise
        except Exception as exc:  # each fsspec backend raises its own errors
            raise ConfigError(
                f"`storage_path` {self.display()} cannot hold the run: writing {self.shown(probe)} failed "
                f"({type(exc).__name__}: {exc}). Check that the bucket exists and that the credentials "
                "(environment, config files or `storage_filesystem`) may write to it."
            ) from exc

    def credential_env(self) -> dict[str, str]:
        """The driver's credential and endpoint variables, for workers on other hosts."""
        return {k: v for k, v in os.environ.items() if k.startswith(_CREDENTIAL_PREFIXES)}


def resolve(storage_path: str | None, storage_filesystem: Any = None) -> RemoteRoot | None:
    """The remote root of a ``storage_path``/``storage_filesystem`` pair, or ``None`` for a
    local path (``file://`` URIs count as local paths). With ``storage_filesystem`` and no
    ``storage_path``, the path on it is the default storage path (as Ray does).

    Raises:
        ConfigError: The scheme's file system is missing, or cannot serve a multi-process run.
    """
    if storage_filesystem is not None:
        fs = to_fsspec(storage_filesystem)
        given = storage_path is not None
        storage_path = storage_path if storage_path is not None else _env.default_storage_path()
        if is_uri(storage_path):
            where = "" if given else " (the default, from DDPTRAIN_STORAGE_PATH)"
            raise ConfigError(
                f"With `storage_filesystem`, `storage_path` is a path on that file system (e.g. "
                f"'bucket/prefix'), not a URI: got {storage_path!r}{where}."
            )
        root = storage_path.rstrip("/") or "/"
        scheme = None
    elif storage_path is None or not on_remote_storage(storage_path):
        return None
    else:
        fs, root, has_options = resolve_uri(storage_path)
        root = root.rstrip("/")
        scheme = None if has_options else storage_path.split("://", 1)[0]
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "memory" in protocols:
        raise ConfigError(
            "`storage_path` on fsspec's memory:// file system cannot hold a run: it lives inside one "
            "process, and workers are other processes. Use a local folder or an object store."
        )
    if "file" in protocols or "local" in protocols:
        return None
    return RemoteRoot(fs, root, scheme)
