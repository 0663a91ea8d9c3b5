"""Child processes whose process group we signal after they end.

A process group's id is its leader's pid. Once the leader is reaped (``wait``, ``poll``), the
kernel may give that pid to a new process, which may lead a group of its own; a ``killpg`` on
the old id would then reach strangers. So the launchers never reap a group leader before they
have signalled its group for the last time: :func:`exited` looks without reaping (the leader
stays a zombie, holding its pid), and the ``wait`` comes after the last ``killpg``.
"""

from __future__ import annotations

import os
import subprocess
import time

__all__ = ["exit_status", "exited", "stat_says_stopped", "stopped_by_signal", "wait_exited"]


def exited(process: subprocess.Popen[bytes]) -> bool:
    """Whether ``process`` has ended, without reaping it (``Popen.poll`` would)."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere
        return True


def wait_exited(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``process`` to end, without reaping it; whether it ended."""
    deadline = time.monotonic() + timeout_s
    while not exited(process):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def exit_status(process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """``process``'s exit status as ``Popen.returncode`` gives it (minus the signal that killed
    it), once it ended within ``timeout_s``; read without reaping it. ``None``: still running."""
    if not wait_exited(process, timeout_s):
        return None
    if process.returncode is not None:
        return process.returncode
    try:
        info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return process.returncode
    if info is None:
        return None
    return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status


def stopped_by_signal(pid: int) -> bool:
    """Whether process ``pid`` of this machine is stopped (SIGSTOP, Ctrl-Z, a debugger: state
    ``T`` or ``t`` in ``/proc/PID/stat``); ``False`` when it cannot be read (it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return stat_says_stopped(f.read())
    except OSError:
        return False


def stat_says_stopped(stat: bytes) -> bool:
    """Whether a ``/proc/PID/stat`` line says its process is stopped (state ``T`` or ``t``)."""
    try:
        return stat.rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except IndexError:
        return False
