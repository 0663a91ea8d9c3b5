"""Reading a run folder, which someone else may have written: the one place a run's files are
opened for reading (``ddptrain runs``/``show``/``logs``/``export``/``plot``, the dashboard,
``Result.from_path``, the checkpoint index, a resumed run's metrics; ``metrics.jsonl`` through
:mod:`ddptrain.storage.metrics`).

A run folder is data, never a way to reach other files: a file is read only if it is a regular
file reached without following a symbolic link anywhere below the run folder (each folder on
the way is opened with ``O_NOFOLLOW`` relative to the one above it), opened with ``O_NONBLOCK``
(a FIFO or a device in its place is refused, never waited on) and checked with ``fstat`` once
open. What cannot be read raises :class:`RunFileError`, which names the file and says why; a
missing file is ``None``. Sizes are bounded: a JSON file of a run is small, a metrics line is
at most 16 MiB (a longer one is skipped: :mod:`ddptrain.storage.metrics`).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import IO, Any

from ddptrain.errors import DdpTrainError
from ddptrain.storage.layout import RunLayout

__all__ = ["RunFileError", "is_run", "open_file", "read_bytes", "read_json", "list_folder"]

_JSON_MAX_BYTES = 64 << 20  # run.json, checkpoints.json, the metrics summary: a bigger one is not a run's


class RunFileError(DdpTrainError, OSError):
    """A file of a run folder that is not read (a link, a FIFO, too large, not JSON...): the
    message names the file and says why."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _open_below(run_dir: str | os.PathLike[str], name: str, folder: bool) -> int | None:
    """An fd of ``run_dir/name`` (``name``: relative, posix), every step below ``run_dir``
    opened without following a link; ``None`` when it does not exist."""
    parts = name.split("/")
    if not name or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"not a plain relative name of a run's file: {name!r}")
    path = Path(run_dir, *parts)
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        for i, part in enumerate(parts):
            want_folder = folder or i < len(parts) - 1
            try:
                before = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return None
            wanted = "a folder" if want_folder else "a regular file"
            test = stat.S_ISDIR if want_folder else stat.S_ISREG
            if not test(before.st_mode):
                why = (
                    "ddptrain never follows a link inside a run folder"
                    if stat.S_ISLNK(before.st_mode)
                    else "ddptrain reads only regular files and folders of a run folder"
                )
                raise RunFileError(f"{Path(run_dir, *parts[: i + 1])} is {_kind(before.st_mode)}, not {wanted}: {why}")
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_DIRECTORY if want_folder else 0)
            try:
                child = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise RunFileError(f"cannot open {path}: {exc.strerror or exc}") from exc
            os.close(fd)
            fd = child
            after = os.fstat(fd)
            if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or not test(after.st_mode):
                raise RunFileError(f"{path} was replaced while it was being opened; try again")
        opened, fd = fd, -1
        return opened
    finally:
        if fd >= 0:
            os.close(fd)


def is_run(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` is a folder (not a link to one) holding a ``run.json`` (a file, not a link)."""
    try:
        return stat.S_ISDIR(os.lstat(folder).st_mode) and stat.S_ISREG(os.lstat(RunLayout(folder).run_json).st_mode)
    except OSError:
        return False


def open_file(run_dir: str | os.PathLike[str], name: str) -> IO[bytes] | None:
    """The run's file ``name`` (relative, posix: ``"logs/attempt_0/rank_1.log"``), open for
    reading, or ``None`` when it does not exist.

    Raises:
        RunFileError: It is not a regular file, or is reached through a link.
    """
    fd = _open_below(run_dir, name, folder=False)
    return None if fd is None else os.fdopen(fd, "rb")


def read_bytes(run_dir: str | os.PathLike[str], name: str, limit_bytes: int = _JSON_MAX_BYTES) -> bytes | None:
    """The whole of a small file of the run (``None``: missing); larger than ``limit_bytes``
    raises :class:`RunFileError`."""
    f = open_file(run_dir, name)
    if f is None:
        return None
    with f:
        data = f.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise RunFileError(f"{Path(run_dir, name)} is larger than {limit_bytes >> 20} MiB: not a ddptrain run's file")
    return data


def read_json(run_dir: str | os.PathLike[str], name: str) -> Any:
    """A JSON file of the run, parsed (``None``: missing).

    Raises:
        RunFileError: It cannot be read (see :func:`open_file`) or is not JSON.
    """
    data = read_bytes(run_dir, name)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError is one
        raise RunFileError(f"{Path(run_dir, name)} is not JSON: {exc}") from None


def list_folder(run_dir: str | os.PathLike[str], name: str) -> list[str]:
    """The names in the run's folder ``name`` (``[]``: missing).

    Raises:
        RunFileError: It is not a folder, or is reached through a link.
    """
    fd = _open_below(run_dir, name, folder=True)
    if fd is None:
        return []
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)
