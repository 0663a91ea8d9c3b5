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

What the server's runs turned out to import for themselves, of the few modules in ``PRELOADABLE``
(torch's own, which ``DistributedDataParallel`` imports at its first use: several seconds of CPU
in every worker), the server imports once too, before it forks the next agent: a worker or agent
that imported one says so as it exits (:func:`send_hints`, a datagram on a socket every agent
and worker of the server inherits), and the next agent and its workers then find it in memory.
Nothing of a run's own is imported: a hint only names a module of that fixed list.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import sys

from ddptrain.agent.process import why_fork_unsafe

__all__ = ["PRELOADABLE", "send_hints", "serve"]

_TICK_S = 0.1  # how often exits are looked for
_MAX_MESSAGE = 1 << 20  # an environment of up to 1 MiB

# What a server imports once its runs have shown they import it (see the module's docstring).
PRELOADABLE = ("torch._dynamo",)

# In an agent forked by a server, and in its workers: the server's end for hints, and what the
# server had imported of PRELOADABLE when it forked the agent.
_hints: socket.socket | None = None
_preloaded: frozenset[str] = frozenset()


def send_hints() -> None:
    """In an exiting agent or worker of a server: name what of ``PRELOADABLE`` this process
    imported for itself, so that the server imports it before its next agent. Never blocks,
    never fails (a server that is gone or busy just does not learn it)."""
    if _hints is None:
        return
    names = [name for name in PRELOADABLE if name in sys.modules and name not in _preloaded]
    if names:
        with contextlib.suppress(OSError):
            _hints.send(" ".join(names).encode(), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)


def _read_hints(hints: socket.socket) -> set[str]:
    """The modules of ``PRELOADABLE`` named by the hints waiting on ``hints``."""
    named: set[str] = set()
    while True:
        try:
            data = hints.recv(4096)
        except (BlockingIOError, InterruptedError):
            return named
        named.update(name for name in data.decode(errors="replace").split() if name in PRELOADABLE)


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


def _preload(names: set[str], stderr_fd: int) -> set[str]:
    """Import ``names`` (of ``PRELOADABLE``), with ``stderr_fd`` as stderr meanwhile; those
    that imported. One that fails is left to the workers, which import it as before."""
    import importlib

    done = set()
    saved = os.dup(2)
    os.dup2(stderr_fd, 2)
    try:
        for name in sorted(names):
            try:
                importlib.import_module(name)
            except Exception:
                continue
            done.add(name)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return done


def serve(control_fd: int) -> None:
    """Serve fork requests on ``control_fd``; returns only in a forked agent (stdin, stdout
    and stderr in place, in a session of its own). Exits the process otherwise."""
    global _hints, _preloaded
    sock = socket.socket(fileno=control_fd)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the driver's terminal is not ours; each agent gets its own streams
        os.dup2(devnull, fd)
    hints, hints_out = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)  # not inherited by an exec
    hints.setblocking(False)
    running: set[int] = set()  # forked, not exited
    exited: set[int] = set()  # exited, reported, not reaped
    imported = failed = False
    wanted: set[str] = set()  # of PRELOADABLE: named by hints, not tried yet
    tried: set[str] = set()
    preloaded: set[str] = set()
    while True:
        for pid in sorted(running):
            code = _exit_code(pid)
            if code is not None:
                running.discard(pid)
                exited.add(pid)
                sock.send(f"X {pid} {code}".encode())
        if failed and not running:
            os._exit(1)
        ready = select.select([sock, hints], [], [], _TICK_S)[0]
        if hints in ready:
            wanted |= _read_hints(hints) - tried
        if sock not in ready:
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
        if wanted and not failed:
            preloaded |= _preload(wanted, fds[2])
            tried |= wanted  # once: one that failed to import is left to the workers
            wanted.clear()
            if why_fork_unsafe() is not None:
                os._exit(1)  # forks no more: the driver starts this agent (and the next) as new processes
        pid = os.fork()
        if pid == 0:  # the agent
            sock.close()
            hints.close()
            _hints, _preloaded = hints_out, frozenset(preloaded)
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
