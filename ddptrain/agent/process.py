"""What the agent reads and does to processes through Linux's ``/proc`` and ``prctl``.

Kept apart from the agent's logic so that the rules it enforces (no fork with a second
thread, nothing left behind in its process group, workers die with it) read as one page.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from ddptrain._proc import die_with_parent, set_parent_death_signal, stat_fields, state_letter

__all__ = [
    "children_cannot_use_cuda",
    "kill_group_strays",
    "other_threads",
    "process_state",
    "resume_when_orphaned",
    "set_pdeathsig",
    "why_fork_unsafe",
]


def set_pdeathsig(agent_pid: int) -> None:
    """Make the kernel SIGKILL this (forked) process when the agent dies."""
    if not die_with_parent(agent_pid):  # the agent died before the request took effect
        os._exit(1)


def resume_when_orphaned() -> None:
    """Make the kernel send this agent SIGCONT when its parent (the driver, its fork server, or
    the SSH session) dies. An agent stopped by a signal (SIGSTOP, a debugger that let go) would
    otherwise never see its stdin end and stay stopped forever, with its workers; resumed, it
    stops them as for any driver that went away. A SIGCONT to a running agent does nothing."""
    set_parent_death_signal(signal.SIGCONT)


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


def children_cannot_use_cuda(torch: Any) -> bool:
    """Whether a process forked from this one now could not use CUDA.

    Asking CUDA for its device count (``torch.cuda.is_available()``, ``device_count()``) marks
    a process so that its forked children fail at their first CUDA call, without initializing
    CUDA in it (``is_initialized()`` stays False): only a child can tell. So fork one that
    answers with its exit status. Call it single-threaded; the child only reads a flag. CPU-only
    builds of torch cannot be marked, and skip this.
    """
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return False
    pid = os.fork()
    if pid == 0:
        os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 3


def why_fork_unsafe() -> str | None:
    """Why a process forked from this one (torch imported) would not run right: the agent
    after loading the user's code, the fork server after a preload (``None``: it would)."""
    import torch

    if torch.cuda.is_initialized():  # a flag read; it does not touch the driver
        return "it initialized CUDA"
    threads = other_threads()
    if threads:
        return f"it started {len(threads)} thread(s): {', '.join(threads)}"
    if children_cannot_use_cuda(torch):
        return "it asked CUDA about its devices (e.g. `torch.cuda.is_available()` at module level)"
    return None


def kill_group_strays() -> None:
    """Kill what is left in this process's group (e.g. DataLoader workers of a worker), when
    the group is its own."""
    group, me = os.getpgid(0), os.getpid()
    if group != me:
        return  # not our own group: leave it alone
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        fields = stat_fields(int(entry))
        if len(fields) > 2 and int(fields[2]) == group:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


def process_state(pid: int) -> dict[str, str]:
    """The kernel's view of a process: its state letter and the kernel function it waits in."""
    state = {"state": state_letter(pid) or "?", "wchan": ""}
    try:
        with open(f"/proc/{pid}/wchan") as f:
            state["wchan"] = f.read().strip()
    except OSError:
        pass
    return state
