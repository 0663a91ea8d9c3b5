"""Numeric dataset columns in shared memory: one sealed memory file per dataset.

The driver copies a dataset's numeric columns once into an anonymous memory file
(``memfd_create``), seals it against any further change, and keeps its descriptor open for
as long as the dataset lives. A worker opens the same memory through
``/proc/<driver pid>/fd/<fd>`` and maps it, so the driver and N local workers hold one copy
in RAM; only a small :class:`ColumnRef` per column travels to the worker.

Nothing is created in ``/dev/shm`` or on disk, so nothing can be left behind: the kernel
frees the memory when the last process that holds the descriptor or a mapping exits,
however it exits (``SIGKILL`` included).

Every mapping is private (copy-on-write). Reading shares the pages; a process that writes
into a batch in place gets its own copy of the pages it wrote, and no other process (nor the
dataset in the driver) sees the change.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ddptrain.errors import DdpTrainError

__all__ = ["BufferRef", "ColumnRef", "SharedBuffer", "SharedMemoryError", "attach_columns"]

_ALIGN = 64  # bytes; each column starts on a cache line
_CHUNK_BYTES = 32 << 20  # rows are copied (and gathered) in pieces of about this size
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL

K = TypeVar("K")

# A column's data: one array, or pieces to concatenate along the first axis.
ColumnSource = np.ndarray | Sequence[np.ndarray]


class SharedMemoryError(DdpTrainError, RuntimeError):
    """A worker could not map a dataset's shared memory."""


@dataclass(frozen=True)
class BufferRef:
    """Where a worker finds a buffer: the driver's host and pid, the descriptor there, and
    what it must be."""

    host: str
    pid: int
    fd: int
    inode: int
    size: int


@dataclass(frozen=True)
class ColumnRef:
    """Rows of one column inside a shared buffer (C-contiguous, starting at ``offset``)."""

    buffer: BufferRef
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]


def _row_bytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))


def _pwrite_all(fd: int, block: np.ndarray, position: int) -> int:
    data = memoryview(np.ascontiguousarray(block).reshape(-1).view(np.uint8).data)
    while data:
        written = os.pwrite(fd, data, position)
        data = data[written:]
        position += written
    return position


def _write_column(fd: int, position: int, pieces: Sequence[np.ndarray], order: np.ndarray | None) -> None:
    """Copy rows into the file in chunks, so a non-contiguous or gathered column never needs
    a second full-size copy in private memory."""
    for piece in pieces:
        rows = max(1, _CHUNK_BYTES // max(1, _row_bytes(piece.dtype, piece.shape)))
        total = len(piece) if order is None else len(order)
        for start in range(0, total, rows):
            if order is None:
                block = piece[start : start + rows]
            else:
                block = np.take(piece, order[start : start + rows], axis=0)
            position = _pwrite_all(fd, block, position)


class SharedBuffer:
    """One dataset's numeric columns in a sealed memory file, mapped copy-on-write (driver side).

    Build one with :meth:`create`. The descriptor is closed when this object is garbage
    collected; arrays already handed out stay valid (they keep the mapping alive).
    """

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.ref = BufferRef(host=socket.gethostname(), pid=os.getpid(), fd=fd, inode=os.fstat(fd).st_ino, size=size)
        self._map = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        self._address = np.frombuffer(self._map, np.uint8).__array_interface__["data"][0]
        weakref.finalize(self, os.close, fd)  # last: from here on, this object owns the descriptor

    @classmethod
    def create(
        cls, columns: Sequence[ColumnSource], order: np.ndarray | None = None
    ) -> tuple[SharedBuffer | None, list[np.ndarray]]:
        """Copy ``columns`` (their rows in ``order`` when given) into a new buffer.

        Returns the buffer (``None`` when the columns hold no bytes) and one array per column,
        a view on the buffer.
        """
        pieces = [[c] if isinstance(c, np.ndarray) else list(c) for c in columns]
        if order is not None:  # a gather reads one array
            pieces = [parts if len(parts) == 1 else [np.concatenate(parts)] for parts in pieces]
        shapes, offsets, size = [], [], 0
        for parts in pieces:
            rows = len(order) if order is not None else sum(len(p) for p in parts)
            shape = (rows, *parts[0].shape[1:])
            size = -(-size // _ALIGN) * _ALIGN
            shapes.append(shape)
            offsets.append(size)
            size += rows * _row_bytes(parts[0].dtype, shape)
        if size == 0:
            return None, [np.empty(shape, parts[0].dtype) for shape, parts in zip(shapes, pieces, strict=True)]
        fd = os.memfd_create(f"ddptrain-data-{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            for parts, offset in zip(pieces, offsets, strict=True):
                _write_column(fd, offset, parts, order)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            buffer = cls(fd, size)
        except BaseException:
            os.close(fd)
            raise
        arrays = [
            buffer.view(parts[0].dtype, shape, offset)
            for parts, shape, offset in zip(pieces, shapes, offsets, strict=True)
        ]
        return buffer, arrays

    def view(self, dtype: np.dtype, shape: tuple[int, ...], offset: int) -> np.ndarray:
        """An array on the buffer's (copy-on-write) mapping."""
        return np.ndarray(shape, dtype, buffer=self._map, offset=offset)

    def locate(self, array: np.ndarray) -> ColumnRef | None:
        """The reference of ``array`` if it is a contiguous view on this buffer, else ``None``."""
        offset = array.__array_interface__["data"][0] - self._address
        if not array.flags.c_contiguous or offset < 0 or offset + array.nbytes > self.size:
            return None
        return ColumnRef(self.ref, offset, array.dtype, tuple(array.shape))


def _open(ref: BufferRef) -> mmap.mmap:
    if socket.gethostname() != ref.host:
        raise SharedMemoryError(
            f"This worker runs on {socket.gethostname()}, but the dataset's shared memory is on the "
            f"driver's host {ref.host}: only workers on the driver's host can map it."
        )
    path = f"/proc/{ref.pid}/fd/{ref.fd}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SharedMemoryError(
            f"Cannot open the dataset memory of the driver (pid {ref.pid}) at {path}: {exc}. "
            "Workers map datasets from the driver's memory through /proc; this needs the workers "
            "to run as the driver's user on the driver's machine, and the driver to be alive."
        ) from exc
    try:
        stat = os.fstat(fd)
        if stat.st_ino != ref.inode or stat.st_size != ref.size:
            raise SharedMemoryError(
                f"{path} is no longer the dataset memory this worker was sent (the driver released "
                "the dataset while the run was starting)."
            )
        return mmap.mmap(fd, ref.size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


def attach_columns(refs: Mapping[K, ColumnRef]) -> dict[K, np.ndarray]:
    """Map the buffers behind ``refs`` (each once) and return the columns (worker side)."""
    maps: dict[BufferRef, mmap.mmap] = {}
    columns: dict[K, np.ndarray] = {}
    for name, ref in refs.items():
        if ref.buffer not in maps:
            maps[ref.buffer] = _open(ref.buffer)
        columns[name] = np.ndarray(ref.shape, ref.dtype, buffer=maps[ref.buffer], offset=ref.offset)
    return columns
