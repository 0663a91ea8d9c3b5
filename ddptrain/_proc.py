"""The one reader of ``/proc/<pid>/stat`` and the one caller of ``prctl(PR_SET_PDEATHSIG)``.

The launchers (is an agent stopped? has a fork server's agent ended?), the agent (what is
left in its process group, its workers dying with it) and the checkpoint uploader (dying with
its worker) all need these, and the launchers may not import the agent: so they live here,
standard library only, open to every process role (``tests/test_architecture.py``, ``TYPES``).

Code that runs where ddptrain may not be importable keeps its own few lines and says so: the
scripts :mod:`ddptrain.launch.host_scripts` sends to a remote host's plain ``python``.
"""

from __future__ import annotations

import os
import signal

__all__ = ["die_with_parent", "parse_stat", "set_parent_death_signal", "stat_fields", "state_letter"]

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name, state first (``fields[2]``
    is the process group, ``fields[19]`` the start time); empty when the process is gone.

    The command name is split off at the last ``)``: a process may put spaces and ``)`` in
    its own name.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_stat(f.read())
    except OSError:
        return []


def parse_stat(line: str) -> list[str]:
    """:func:`stat_fields` of a ``/proc/<pid>/stat`` line read elsewhere (from another host,
    say); empty when it is not one."""
    try:
        return line.rsplit(")", 1)[1].split()
    except IndexError:
        return []


def state_letter(pid: int) -> str:
    """The kernel's one-letter state of process ``pid`` (``R``, ``S``, ``T`` stopped, ``Z``
    zombie...); ``""`` when it cannot be read (the process is gone)."""
    fields = stat_fields(pid)
    return fields[0] if fields else ""


def set_parent_death_signal(signum: int) -> None:
    """Ask the kernel to send this process ``signum`` when the thread that started it ends
    (``PR_SET_PDEATHSIG``). Best effort: where ``prctl`` cannot be called (not Linux) nothing
    happens, and the caller's other ways of noticing its parent's end still apply. The request
    survives ``exec`` but not ``fork``: every child asks for itself."""
    try:
        import ctypes  # only here: a process that never asks need not load it

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    except Exception:
        pass


def die_with_parent(parent_pid: int) -> bool:
    """Make the kernel SIGKILL this process when its parent ``parent_pid`` ends. Whether the
    parent is still alive: ``False`` means it died before the request took effect (this
    process was already handed to another parent), and the caller should exit now."""
    set_parent_death_signal(signal.SIGKILL)
    return os.getppid() == parent_pid
