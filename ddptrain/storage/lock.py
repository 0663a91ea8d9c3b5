"""One driver at a time in a run directory: a ``flock`` on the directory itself.

``ddptrain`` commands that only read a run (``ddptrain stack``, ``show``) take the lock shared
to learn whether a live driver holds it.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from ddptrain.errors import DdpTrainError
from ddptrain.storage.layout import RunLayout
from ddptrain.storage.ownership import check_own_folder

__all__ = ["RunInUseError", "RunLock", "driver_is_alive", "try_lock_dir"]


class RunInUseError(DdpTrainError, RuntimeError):
    """Another live driver is using the run directory."""


def try_lock_dir(path: str, shared: bool = False) -> int | None:
    """An open fd of folder ``path`` holding a ``flock`` on it, or ``None`` if someone else holds one."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


class RunLock:
    """Only one driver at a time in a run directory.

    An exclusive ``flock`` on the run directory itself, held for the whole ``fit()``: no file
    is added to the directory, and the kernel drops the lock when its driver dies, however it
    dies, so a dead driver's lock is simply taken over. Creates the run directory (0700) if
    needed.

    Raises:
        ForeignFolderError: The run directory belongs to another user, or other users can
            write it or replace it (see :mod:`ddptrain.storage.ownership`).
        RunInUseError: A live driver holds it; the error names its host, pid and start time
            (from its ``run.json``).
    """

    def __init__(self, run_dir: str, name: str) -> None:
        self.run_dir = run_dir
        self.name = name
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
        check_own_folder(self.run_dir)  # not one another user created before the run
        fd = try_lock_dir(self.run_dir)
        if fd is None:
            raise RunInUseError(
                f"Run {self.name!r} in {self.run_dir} is in use by a live driver ({self._holder()}). Wait "
                "for it to finish, or give this run another `RunConfig(name=...)`."
            )
        self._fd = fd
        return self

    def _holder(self) -> str:
        try:
            info = json.loads(RunLayout(self.run_dir).run_json.read_text())
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
            return f"host {info['host']}, pid {info.get('pid')}, started {started}"
        except (OSError, ValueError, KeyError, TypeError):
            return "host, pid and start time not recorded yet"

    def __exit__(self, *exc_info: object) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # releases the lock


def driver_is_alive(run_dir: Path) -> bool:
    """Whether a live driver holds ``run_dir``'s lock (a folder that cannot be opened: no)."""
    try:
        fd = try_lock_dir(str(run_dir), shared=True)
    except OSError:
        return False
    if fd is None:
        return True
    os.close(fd)
    return False
