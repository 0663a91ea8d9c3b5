"""Whether a folder ddptrain writes a run into (or loads a pickle from) is the user's own.

A run folder on a storage path other users can write (``/tmp/results``, a team's scratch
folder) may have been created by one of them before the run: the driver would then write the
run's metrics, logs and checkpoints into their folder, where they read them, and resume from
the checkpoints they planted. And a storage folder that anyone can write, without the sticky
bit, lets anyone rename the user's run folder away and put their own in its place.
"""

from __future__ import annotations

import os
import pwd
import stat

from ddptrain.errors import DdpTrainError

__all__ = ["ForeignFolderError", "check_own_folder"]


class ForeignFolderError(DdpTrainError, RuntimeError):
    """A folder a run would write into, or load from, is not safe from other users."""


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_own_folder(path: str, what: str = "run folder") -> None:
    """Raise :class:`ForeignFolderError` unless folder ``path`` belongs to this user and no other
    user can write it, and its parent cannot be used to replace it.

    Args:
        path: An existing folder (a link to one is judged by what it points to).
        what: What the folder is, for the message ("run folder", "sweep folder").
    """
    info = os.stat(path)
    uid = os.geteuid()
    if info.st_uid != uid:
        raise ForeignFolderError(
            f"The {what} {path} belongs to {_user(info.st_uid)}, not to you ({_user(uid)}): that user "
            "created it and could read what this run writes there and plant checkpoints it would "
            "resume from. Use a storage_path only you can write (the default is ~/ddptrain_results), "
            "or another `RunConfig(name=...)`."
        )
    if info.st_mode & stat.S_IWOTH:
        raise ForeignFolderError(
            f"The {what} {path} can be written by every user (mode {stat.S_IMODE(info.st_mode):04o}): "
            f"anyone could plant checkpoints this run would resume from. `chmod o-w {path}` first."
        )
    parent = os.path.dirname(os.path.realpath(path))
    above = os.stat(parent)
    if above.st_mode & stat.S_IWOTH and not above.st_mode & stat.S_ISVTX:
        raise ForeignFolderError(
            f"The {what} {path} is in {parent}, which every user can write without the sticky bit "
            f"(mode {stat.S_IMODE(above.st_mode):04o}): anyone could replace the {what} with their own. "
            f"Use a storage_path only you can write, or `chmod +t {parent}` (as /tmp is)."
        )
