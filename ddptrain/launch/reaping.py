"""Child processes whose process group we signal after they end.

A process group's id is its leader's pid. Once the leader is reaped (``wait``, ``poll``), the
kernel may give that pid to a new process, which may lead a group of its own; a ``killpg`` on
the old id would then reach strangers. So the launchers never reap a group leader before they
have signalled its group for the last time: :func:`exited` looks without reaping (the leader
stays a zombie, holding its pid), and the ``wait`` comes after the last ``killpg``.

That last ``wait`` is bounded too (:func:`reap`): a process SIGKILLed may still not end (in
uninterruptible I/O on a hung file system), or end as a zombie that its parent cannot reap
(held by a debugger that traces it and is itself stopped). ``fit()`` then says which process it
gave up on, and why, instead of hanging.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from typing import Protocol

from ddptrain._proc import parse_stat, state_letter

__all__ = ["REAP_TIMEOUT_S", "exit_status", "exited", "reap", "stat_says_stopped", "stopped_by_signal", "wait_exited"]

_logger = logging.getLogger(__name__)
REAP_TIMEOUT_S = 5.0  # how long a process SIGKILLed may take to be reaped before it is left


class _Waitable(Protocol):
    @property
    def pid(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


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
    return state_letter(pid) in ("T", "t")


def stat_says_stopped(stat: bytes) -> bool:
    """Whether a ``/proc/PID/stat`` line says its process is stopped (state ``T`` or ``t``)."""
    fields = parse_stat(stat.decode(errors="replace"))
    return bool(fields) and fields[0] in ("T", "t")


def reap(process: _Waitable, what: str, timeout_s: float = REAP_TIMEOUT_S) -> bool:
    """Reap ``process``, SIGKILLed already, waiting up to ``timeout_s``; whether it was. One
    that was not is named in a warning (``what``, its pid and its state) and left as it is.

    Args:
        process: A ``subprocess.Popen``, or anything with its ``pid`` and ``wait(timeout)``.
        what: What it is, for the warning: ``"the ddptrain agent"``.
    """
    try:
        process.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        pid = process.pid
        _logger.warning(
            "ddptrain: %s (pid %s) was not reaped within %.0f s of its SIGKILL (%s); not waiting for it any longer",
            what,
            pid,
            timeout_s,
            _why_not_reaped(pid),
        )
        return False


def _why_not_reaped(pid: int | None) -> str:
    """What ``/proc`` says of a process that a SIGKILL did not let us reap."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return "its state cannot be read"
    state = fields.get("State", "?").strip()
    tracer = fields.get("TracerPid", "0").strip()
    if tracer not in ("", "0"):
        return (
            f"state {state}; it is traced by pid {tracer} (a debugger?), which must let it go: "
            f"`kill -CONT {tracer}` if that one is stopped, or end it"
        )
    if state.startswith("D"):
        return f"state {state}: waiting in the kernel, on a file system or device that does not answer"
    return f"state {state}"
