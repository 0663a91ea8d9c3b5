"""Memory evidence for a worker killed by ``SIGKILL`` (read by the agent, on the worker's host).

The kernel's OOM killer sends ``SIGKILL``, and counts the kill in the victim's memory cgroup
(``oom_kill`` in ``memory.events`` for cgroup v2, in ``memory.oom_control`` for v1) before it
sends the signal. The agent reads that counter when it starts and again when a worker dies of
``SIGKILL``: if it grew, the worker was probably killed for want of memory. The worker's peak
RSS comes from ``wait4``; the cgroup's limit and peak use from its files. Every figure is
optional: nothing here fails when cgroups cannot be read.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["memory_cgroup", "oom_kills", "evidence"]

_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge number


def _mounts() -> dict[str, tuple[str, str]]:
    """``"2"`` or ``"1"`` (the cgroup v1 memory controller) to (mount root, mount point)."""
    found: dict[str, tuple[str, str]] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, details = left.split(), right.split()
        if len(fields) < 5 or len(details) < 3:
            continue
        root, point = fields[3], fields[4].replace("\\040", " ")
        if details[0] == "cgroup2":
            found.setdefault("2", (root, point))
        elif details[0] == "cgroup" and "memory" in details[2].split(","):
            found.setdefault("1", (root, point))
    return found


def memory_cgroup(pid: int | str = "self") -> tuple[str, int] | None:
    """The folder of ``pid``'s memory cgroup and its version (1 or 2), or ``None``."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    mounts = _mounts()
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and "1" in mounts:
            candidates.append((mounts["1"], path, 1))
        elif controllers == "" and "2" in mounts:
            candidates.append((mounts["2"], path, 2))
    for (root, point), path, version in candidates:
        if root != "/" and (path == root or path.startswith(root + "/")):
            path = path[len(root) :]
        folder = os.path.join(point, path.lstrip("/"))
        marker = "memory.events" if version == 2 else "memory.oom_control"
        if os.path.exists(os.path.join(folder, marker)):
            return folder, version
    return None


def _read(folder: str, name: str) -> str | None:
    try:
        with open(os.path.join(folder, name)) as f:
            return f.read()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    try:
        value = int(text.strip()) if text is not None else None
    except ValueError:  # "max"
        return None
    return value if value is not None and value < _UNLIMITED else None


def oom_kills(cgroup: tuple[str, int] | None = None) -> int | None:
    """How many processes the OOM killer has killed in the cgroup (this process's by default)."""
    cgroup = cgroup or memory_cgroup()
    if cgroup is None:
        return None
    folder, version = cgroup
    text = _read(folder, "memory.events" if version == 2 else "memory.oom_control")
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return _number(value)
    return None


def _limit(folder: str, version: int) -> int | None:
    """The tightest memory limit of the cgroup or its ancestors (within the mount)."""
    limits = []
    while True:
        value = _number(_read(folder, "memory.max" if version == 2 else "memory.limit_in_bytes"))
        if value is not None:
            limits.append(value)
        parent = os.path.dirname(folder)
        if parent == folder or not os.path.exists(os.path.join(parent, "cgroup.procs")):
            break
        folder = parent
    return min(limits) if limits else None


def evidence(oom_kills_before: int | None, maxrss_kb: int) -> dict[str, Any]:
    """What is known about the memory of a worker that just died of SIGKILL.

    Args:
        oom_kills_before: :func:`oom_kills` read before the worker started.
        maxrss_kb: The worker's peak RSS in KiB, from ``wait4``.
    """
    found: dict[str, Any] = {"maxrss": maxrss_kb * 1024 if maxrss_kb else None}
    cgroup = memory_cgroup()
    if cgroup is None:
        return found
    folder, version = cgroup
    after = oom_kills(cgroup)
    found["cgroup"] = folder
    if after is not None and oom_kills_before is not None:
        found["oom_killed"] = after > oom_kills_before
    found["limit"] = _limit(folder, version)
    found["peak"] = _number(_read(folder, "memory.peak" if version == 2 else "memory.max_usage_in_bytes"))
    return found
