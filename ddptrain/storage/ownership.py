"""Whether a folder ddptrain writes a run into (or loads a pickle from) is the user's own.

A run folder on a storage path other users can write (``/tmp/results``, a team's scratch
folder) may have been created by one of them before the run: the driver would then write the
run's metrics, logs and checkpoints into their folder, where they read them, and resume from
the checkpoints they planted. And a storage folder that anyone can write, without the sticky
bit, lets anyone rename the user's run folder away and put their own in its place.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import tempfile

from ddptrain.errors import DdpTrainError

__all__ = ["ForeignFolderError", "check_own_folder", "private_temp_dir"]

_logger = logging.getLogger(__name__)


class ForeignFolderError(DdpTrainError, RuntimeError):
    """A folder a run would write into, or load from, is not safe from other users."""


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _maps_us_to(path: str, owner: int) -> bool:
    """Whether files this user creates in folder ``path`` get ``owner`` (an NFS export that
    squashes root to ``nobody``, say): then a folder owned by ``owner`` is as much the user's
    own as that file system allows."""
    try:
        fd, name = tempfile.mkstemp(prefix=".ddptrain-owner-", dir=path)
    except OSError:
        return False  # not even writable by us: not ours
    try:
        return os.fstat(fd).st_uid == owner
    finally:
        os.close(fd)
        os.unlink(name)


def check_own_folder(path: str, what: str = "run folder") -> None:
    """Raise :class:`ForeignFolderError` unless folder ``path`` belongs to this user; log a
    warning when other users could write it or replace it (a folder every user can write, or
    one in a folder every user can write without the sticky bit: on file systems without Unix
    modes, such as a Windows drive under WSL, everything looks that way).

    Args:
        path: An existing folder (a link to one is judged by what it points to).
        what: What the folder is, for the message ("run folder", "sweep folder").
    """
    info = os.stat(path)
    uid = os.geteuid()
    if info.st_uid != uid and not _maps_us_to(path, info.st_uid):
        raise ForeignFolderError(
            f"The {what} {path} belongs to {_user(info.st_uid)}, not to you ({_user(uid)}): that user "
            "created it and could read what this run writes there and plant checkpoints it would "
            "resume from. Use a storage_path only you can write (the default is ~/ddptrain_results), "
            "or another `RunConfig(name=...)`."
        )
    parent = os.path.dirname(os.path.realpath(path))
    above = os.stat(parent)
    if info.st_mode & stat.S_IWOTH:
        _logger.warning(
            "ddptrain: every user can write the %s %s (mode %04o): anyone could plant checkpoints it "
            "resumes from. `chmod o-w %s` unless its file system has no Unix modes.",
            what, path, stat.S_IMODE(info.st_mode), path,
        )  # fmt: skip
    elif above.st_mode & stat.S_IWOTH and not above.st_mode & stat.S_ISVTX:
        _logger.warning(
            "ddptrain: the %s %s is in %s, which every user can write without the sticky bit (mode %04o): "
            "anyone could replace it with their own. Use a storage_path only you can write, or "
            "`chmod +t %s` (as /tmp is).",
            what, path, parent, stat.S_IMODE(above.st_mode), parent,
        )  # fmt: skip


def private_temp_dir() -> str:
    """A folder of this machine only this user can use, for locks and other small files that
    must not sit in /tmp under a name other users can predict (they could create the file first,
    hold its lock forever, or make it a link): ``$XDG_RUNTIME_DIR/ddptrain`` when the session has
    one, else ``<tmp>/ddptrain-private-<uid>``, created 0700.

    Raises:
        ForeignFolderError: ``<tmp>/ddptrain-private-<uid>`` exists and is not a private folder
            of this user (another user created it first); the message says to remove it.
    """
    uid = os.geteuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        try:
            info = os.stat(runtime)
        except OSError:
            info = None
        if info is not None and info.st_uid == uid and not info.st_mode & 0o077:
            folder = os.path.join(runtime, "ddptrain")
            os.makedirs(folder, mode=0o700, exist_ok=True)
            return folder
    folder = os.path.join(tempfile.gettempdir(), f"ddptrain-private-{uid}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        raise ForeignFolderError(
            f"{folder} is not a private folder of yours (owner {_user(info.st_uid)}, mode "
            f"{stat.S_IMODE(info.st_mode):04o}{'' if stat.S_ISDIR(info.st_mode) else ', not a folder'}): another user "
            "may have created it to interfere with ddptrain's locks. Remove it (or set XDG_RUNTIME_DIR) and retry."
        )
    return folder
