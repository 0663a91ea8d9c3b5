"""What the agent reads and does to processes through Linux's ``/proc`` and ``prctl``.

Kept apart from the agent's logic so that the rules it enforces (no fork with a second
thread, nothing left behind in its process group, workers die with it) read as one page.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["kill_group_strays", "other_threads", "process_state", "set_pdeathsig"]


def set_pdeathsig(agent_pid: int) -> None:
    """Make the kernel SIGKILL this (forked) process when the agent dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != agent_pid:  # the agent died before the request took effect
        os._exit(1)


def other_threads() -> list[str]:
    """Names of this process's threads other than the calling one (empty: safe to fork)."""
    me = str(threading.get_native_id())
    names = []
    for tid in os.listdir("/proc/self/task"):
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f"{f.read().strip()} (tid {tid})")
        except OSError:
            pass  # it ended meanwhile
    return names


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first; empty: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def kill_group_strays() -> None:
    """Kill what is left in this process's group (e.g. DataLoader workers of a worker), when
    the group is its own."""
    group, me = os.getpgid(0), os.getpid()
    if group != me:
        return  # not our own group: leave it alone
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        fields = _stat_fields(int(entry))
        if len(fields) > 2 and int(fields[2]) == group:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


def process_state(pid: int) -> dict[str, str]:
    """The kernel's view of a process: its state letter and the kernel function it waits in."""
    fields = _stat_fields(pid)
    state = {"state": fields[0] if fields else "?", "wchan": ""}
    try:
        with open(f"/proc/{pid}/wchan") as f:
            state["wchan"] = f.read().strip()
    except OSError:
        pass
    return state
