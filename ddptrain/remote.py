"""Run storage on a remote file system (``s3://``, ``gs://``, ... through fsspec).

A run whose ``storage_path`` is a URI, or that was given a ``storage_filesystem``, keeps its
files on that file system. The driver works in a local copy of the run's small files (the
lock, ``run.json``, ``metrics.jsonl``, ``checkpoints.json``, logs) under
``$DDPTRAIN_CACHE_DIR`` and uploads them as they change; workers upload their checkpoint
files straight to the store, never through the driver. ``checkpoints.json`` is written last,
so a checkpoint exists for readers only once all its files do.

fsspec and the scheme's implementation (``s3fs``, ``gcsfs``, ``adlfs``) are optional; a missing
one raises :class:`~ddptrain.errors.ConfigError` naming the extra to install.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddptrain import _env, storage
from ddptrain.errors import ConfigError

__all__ = ["RemoteRoot", "is_uri", "on_remote_storage", "resolve", "resolve_uri", "to_fsspec", "to_pyarrow"]

# Which extra installs a scheme's file system.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
# Environment variables that carry a scheme's credentials and endpoint to workers on other hosts.
_CREDENTIAL_PREFIXES = ("AWS_", "GOOGLE_", "GCS", "AZURE_")


def is_uri(text: str) -> bool:
    """Whether ``text`` is a URI with a scheme (``file://`` counts as one)."""
    return "://" in text


def on_remote_storage(path: str) -> bool:
    """Whether ``path`` is a URI of remote storage (``file://`` ones are local paths)."""
    return is_uri(path) and not path.startswith("file://")


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError as exc:
        raise ConfigError(
            "Remote storage needs fsspec, which is not installed: `pip install ddptrain[s3]` "
            "(or ddptrain[gcs], ddptrain[azure]; or `pip install fsspec` and the scheme's package)."
        ) from exc
    return fsspec


def to_fsspec(filesystem: Any) -> Any:
    """An fsspec file system for ``filesystem``: fsspec ones as they are, ``pyarrow.fs`` ones
    wrapped (fsspec's ``ArrowFSWrapper``)."""
    fsspec = _fsspec()
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


def to_pyarrow(fs: Any) -> Any:
    """``fs`` as a ``pyarrow.fs.FileSystem`` (what Ray code expects of ``Checkpoint.filesystem``)
    when pyarrow is installed; the fsspec file system itself otherwise."""
    try:
        import pyarrow.fs as pafs
    except ImportError:
        return fs
    wrapped = getattr(fs, "fs", None)  # an ArrowFSWrapper around a pyarrow file system
    if isinstance(wrapped, pafs.FileSystem):
        return wrapped
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def _filesystem_for(uri: str) -> tuple[Any, str]:
    fsspec = _fsspec()
    scheme = uri.split("://", 1)[0].lower()
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except ImportError as exc:
        extra = _EXTRAS.get(scheme)
        hint = f"`pip install ddptrain[{extra}]`" if extra else "install the fsspec implementation of that scheme"
        raise ConfigError(
            f"`storage_path` {uri!r} needs a file system for {scheme}:// that is not installed: {hint}."
        ) from exc
    except ValueError as exc:
        raise ConfigError(f"`storage_path` {uri!r}: fsspec knows no file system for {scheme}:// ({exc}).") from exc
    return fs, path


def resolve_uri(uri: str) -> Any:
    """The fsspec file system of a URI (a checkpoint's path).

    Raises:
        ConfigError: The scheme's file system is not installed.
    """
    return _filesystem_for(uri)[0]


@dataclass
class RemoteRoot:
    """Where a run's storage root is on a remote file system.

    Attributes:
        fs: The fsspec file system.
        root: The root on ``fs`` (no scheme).
        scheme: ``"s3"`` etc. when the user gave a URI (paths shown to users are URIs then), or
            ``None`` when they gave ``storage_filesystem`` (paths are paths on it, like Ray).
    """

    fs: Any
    root: str
    scheme: str | None

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

    # ------------------------------------------------------------- transfers
    def upload_file(self, local: str, remote: str) -> None:
        self.fs.put_file(local, remote)

    def upload_dir(self, local: str, remote: str) -> None:
        """Upload every file below ``local`` to ``remote`` (same relative paths)."""
        for src_root, _dirs, files in os.walk(local):
            rel = os.path.relpath(src_root, local)
            for file in files:
                target = posixpath.normpath(posixpath.join(remote, rel.replace(os.sep, "/"), file))
                self.fs.put_file(os.path.join(src_root, file), target)

    def download_dir(self, remote: str, local: str) -> None:
        """Download every file below ``remote`` into ``local``."""
        remote = remote.rstrip("/")
        for path in self.fs.find(remote):
            rel = posixpath.relpath(self.bare_path(path), remote)
            target = Path(local, *rel.split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(path, str(target))

    def bare_path(self, path: str) -> str:
        """A path listed by ``fs`` (which may carry the scheme) as a plain path on it."""
        stripped: str = self.fs._strip_protocol(path)
        return stripped

    def read_bytes(self, remote: str) -> bytes | None:
        """The object's bytes, or ``None`` if it does not exist."""
        try:
            data: bytes = self.fs.cat_file(remote)
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
        self.fs.pipe_file(remote, data)

    def remove_dir(self, remote: str) -> None:
        try:
            self.fs.rm(remote, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(remote)

    def list_names(self, remote: str) -> list[str]:
        """Names of the entries directly below ``remote`` (``[]`` when there are none)."""
        self.fs.invalidate_cache(remote)
        try:
            entries = self.fs.ls(remote, detail=False)
        except FileNotFoundError:
            return []
        return [posixpath.basename(self.bare_path(p).rstrip("/")) for p in entries]

    def exists(self, remote: str) -> bool:
        self.fs.invalidate_cache(remote)
        return bool(self.fs.exists(remote))

    def check_writable(self) -> None:
        """Write and delete a small object under the root, so that a missing bucket or missing
        permissions fail before any worker starts.

        Raises:
            ConfigError: The root cannot be written; says why.
        """
        probe = self.path(f".ddptrain_probe_{uuid.uuid4().hex}")
        try:
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
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
    local path (``file://`` URIs count as local paths).

    Raises:
        ConfigError: The scheme's file system is missing, or cannot serve a multi-process run.
    """
    if storage_filesystem is not None:
        fs = to_fsspec(storage_filesystem)
        if storage_path is None:
            raise ConfigError("`storage_filesystem` needs a `storage_path`: the path on that file system.")
        if is_uri(storage_path):
            raise ConfigError(
                f"With `storage_filesystem`, `storage_path` is a path on that file system (e.g. "
                f"'bucket/prefix'), not a URI: got {storage_path!r}."
            )
        root = storage_path.rstrip("/")
        scheme = None
    elif storage_path is None or not on_remote_storage(storage_path):
        return None
    else:
        fs, root = _filesystem_for(storage_path)
        root = root.rstrip("/")
        scheme = storage_path.split("://", 1)[0]
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "memory" in protocols:
        raise ConfigError(
            "`storage_path` on fsspec's memory:// file system cannot hold a run: it lives inside one "
            "process, and workers are other processes. Use a local folder or an object store."
        )
    if "file" in protocols or "local" in protocols:
        return None
    return RemoteRoot(fs, root, scheme)
