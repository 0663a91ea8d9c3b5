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

__all__ = ["Checkpoint"]

_METADATA_FILE = ".metadata.json"


class Checkpoint:
    """A directory of checkpoint files, on a local or shared file system.

    Build one from a directory your training function wrote, and pass it to
    :func:`ddptrain.report`; ddptrain copies it into the run directory. The checkpoint you
    get back (``Result.checkpoint``, ``get_checkpoint()``) points at the persisted copy.

    Args:
        path: The checkpoint directory.
        filesystem: Accepted for Ray compatibility; only ``None`` (the local file system) is
            supported.

    Example:
        >>> with tempfile.TemporaryDirectory() as d:
        ...     torch.save(model.state_dict(), os.path.join(d, "model.pt"))
        ...     ddptrain.report({"loss": 0.1}, checkpoint=Checkpoint.from_directory(d))
    """

    def __init__(self, path: str | os.PathLike[str], filesystem: Any = None) -> None:
        if filesystem is not None:
            raise ValueError("`filesystem` is not supported: ddptrain checkpoints live on a local path.")
        text = os.fspath(path)
        if "://" in text:
            raise ValueError(f"Checkpoint paths must be local paths, got the URI {text!r}.")
        self.path: str = os.path.abspath(os.path.expanduser(text))
        self.filesystem = None

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """A checkpoint for an existing local directory (nothing is copied)."""
        return cls(path)

    def to_directory(self, path: str | os.PathLike[str] | None = None) -> str:
        """Copy the checkpoint files into ``path`` (a new temporary folder by default).

        Concurrent calls on one host for the same target are safe: one copies, the others
        wait for it and reuse the result.

        Returns:
            The directory holding the files.
        """
        from filelock import FileLock

        target = Path(
            path if path is not None else Path(tempfile.gettempdir()) / f"checkpoint_tmp_{uuid.uuid4().hex}"
        ).absolute()
        if target == Path(self.path):
            return str(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        # The marker says "target holds a complete copy of this checkpoint"; it stays, so that
        # callers that waited on the lock reuse the copy instead of copying over it.
        done_marker = target.parent / f".{target.name}.complete"
        with FileLock(str(target.parent / f".{target.name}.lock")):
            if not (done_marker.exists() and target.is_dir() and done_marker.read_text() == self.path):
                shutil.copytree(self.path, target, dirs_exist_ok=True)
                done_marker.write_text(self.path)
        return str(target)

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """Yield a local directory with the checkpoint files (the checkpoint itself, no copy).

        Treat it as read-only.
        """
        yield self.path

    def get_metadata(self) -> dict[str, Any]:
        """The metadata dict stored with the checkpoint (``{}`` when there is none)."""
        file = Path(self.path, _METADATA_FILE)
        if not file.exists():
            return {}
        data: dict[str, Any] = json.loads(file.read_text())
        return data

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Replace the metadata. It must be JSON-serializable."""
        text = json.dumps(metadata)
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
        return f"Checkpoint(filesystem=local, path={self.path})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)
