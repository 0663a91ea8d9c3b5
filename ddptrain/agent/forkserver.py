"""The agent fork server: one process per driver that has imported torch, and forks agents.

Started by the driver's local launcher (``ddptrain.launch.forkserver``) with the agent's own
command line and ``wire.boot.FORKSERVER_FD_VAR`` naming its end of a ``SOCK_SEQPACKET``
socket pair. It never runs user code: it imports torch and the worker module once (at the first
request, with that agent's stderr as its own, so an import error or warning reaches the driver
exactly as an agent's would) and then, for each request, forks an agent, which returns from
:func:`serve` and runs ``ddptrain.agent.main`` as a freshly started agent does. A restarted
attempt or the next ``fit()`` thus starts its agent without importing torch again.

Messages (one per packet): the driver sends ``F`` and the agent's environment as JSON, with
three file descriptors (the agent's stdin, stdout and stderr), and ``R <pid>`` once it has
killed that agent's process group; the server answers ``P <pid>`` for each fork and
``X <pid> <exit code>`` when an agent exits. An agent that exited stays a zombie until its
``R`` (so its process-group id cannot be reused while the driver may still kill the group).
The server exits when the driver's end closes (the driver exited or killed it), and after an
import failure once that agent has ended (the driver then starts a new server).
"""

from __future__ import annotations

import json
import os
import select
import socket

__all__ = ["serve"]

_TICK_S = 0.1  # how often exits are looked for
_MAX_MESSAGE = 1 << 20  # an environment of up to 1 MiB


def _exit_code(pid: int) -> int | None:
    """The exit code of child ``pid`` if it has exited (left a zombie until reaped), else None."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return -1
    if info is None:
        return None
    return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status


def _import_agent_modules(stderr_fd: int) -> bool:
    """Import what every agent imports (torch first), with ``stderr_fd`` as stderr meanwhile."""
    saved = os.dup(2)
    os.dup2(stderr_fd, 2)
    try:
        import torch  # noqa: F401

        from ddptrain.worker import main  # noqa: F401
    except BaseException:
        return False  # the forked agent imports again, and reports the error as a frame
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return True


def serve(control_fd: int) -> None:
    """Serve fork requests on ``control_fd``; returns only in a forked agent (stdin, stdout
    and stderr in place, in a session of its own). Exits the process otherwise."""
    sock = socket.socket(fileno=control_fd)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the driver's terminal is not ours; each agent gets its own streams
        os.dup2(devnull, fd)
    running: set[int] = set()  # forked, not exited
    exited: set[int] = set()  # exited, reported, not reaped
    imported = failed = False
    while True:
        for pid in sorted(running):
            code = _exit_code(pid)
            if code is not None:
                running.discard(pid)
                exited.add(pid)
                sock.send(f"X {pid} {code}".encode())
        if failed and not running:
            os._exit(1)
        if not select.select([sock], [], [], _TICK_S)[0]:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except OSError:
            message, fds = b"", []
        if not message:  # the driver's end closed
            os._exit(0)
        if message.startswith(b"R "):
            pid = int(message[2:])
            if pid in exited:
                exited.discard(pid)
                os.waitpid(pid, 0)
            continue
        if not message.startswith(b"F") or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            continue
        env = json.loads(message[1:])
        if not imported:
            imported = True
            failed = not _import_agent_modules(fds[2])
        pid = os.fork()
        if pid == 0:  # the agent
            sock.close()
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in (*fds, devnull):
                os.close(fd)
            os.environ.clear()  # the agent's own environment (putenv: its workers' C code sees it too)
            os.environ.update(env)
            return
        for fd in fds:
            os.close(fd)
        running.add(pid)
        sock.send(f"P {pid}".encode())
