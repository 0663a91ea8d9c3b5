"""A driver script run as a process of its own without its own torch import, for the tests that
kill, interrupt or watch a driver.

``python script.py`` pays a torch import (seconds of CPU on the CI machine) before its run starts.
:class:`ForkedDriver` asks a zygote for the process instead: one helper per test process, started
at the first ``ForkedDriver``, that imports ``ddptrain.driver.controller`` (torch and the driver)
and nothing of the tests, starts no Python thread (numpy's OpenBLAS pool stops itself at a fork)
and never runs a fit. For each driver it forks a child that takes the test's script, arguments,
environment (``os.environ`` at the call when ``env`` is not given), working directory, umask and
standard streams (pipes or a pty, passed as file descriptors), and runs the script as ``__main__``
with the ``sys.path``, buffering, default signal handlers and handler-less root logger that
``python script.py`` would have. Killing it is killing a driver: its agents and workers see it
die.

Its local agents come from an agent fork server as a driver's do (``ddptrain.launch.forkserver``),
but the server is forked by the zygote too instead of started as ``python -c ...`` (another torch
import, seconds of CPU per driver): on the driver's request (its own socket pair with the zygote),
the zygote forks a child that takes the agent's environment, working directory, umask,
``sys.path``, signal handlers and command line (``sys.orig_argv``, for an agent that replaces
itself) and runs the agent's entry point as that server. The zygote reaps it and sends its exit
code to the driver. It ends with its driver (the end of its socket), as a server does. Only its
``/proc/PID/cmdline`` (and that of the agents it forks) is the zygote's.

The zygote runs with the test session's environment, conftest's tag included, so its drivers show
the tag in ``/proc/PID/environ``: conftest's leftover check counts a driver a test left running,
and skips the zygote itself (:func:`zygote_pids`). The zygote ends with the test process (end of
its socket, parent-death signal), and its drivers with it.

Not for tests of what a driver process imports or where it imports it from: torch and ddptrain
were imported by the zygote, before the script's environment and ``sys.path`` applied.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import io
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ForkedDriver", "zygote_pids"]

_START_TIMEOUT_S = 180.0  # the first driver waits for the zygote's torch import (a loaded CI machine)
_MAX_MESSAGE = 1 << 20  # a request: the script, its arguments and its whole environment
# The environment of the test session (conftest's tag set, no test's monkeypatching yet): the
# zygote's, whichever test starts it.
_SESSION_ENV = dict(os.environ)


class ForkedDriver:
    """``python script args...`` as a child of the zygote; the part of ``subprocess.Popen`` tests
    use (``pid``, ``stdout``, ``stderr``, ``kill``, ``send_signal``, ``poll``, ``wait``,
    ``communicate``, ``returncode``), in text mode."""

    def __init__(
        self,
        script: Path | str,
        args: list[str],
        env: dict[str, str] | None = None,
        stdout: str = "pipe",
        stderr: str = "pipe",
        terminal: int | None = None,
    ) -> None:
        """``stdout``: ``"pipe"`` (read it from :attr:`stdout`) or ``"devnull"``; ``stderr``: the
        same, ``"inherit"`` (the test process's, ``Popen``'s ``stderr=None``) or ``"stdout"``
        (``subprocess.STDOUT``). ``terminal``: a pty's fd the driver gets as its stdin, stdout
        and stderr (then :attr:`stdout` and :attr:`stderr` read nothing)."""
        self.returncode: int | None = None
        self._lock = threading.Lock()  # a signal is never sent to a pid the zygote has reaped
        self._forked = threading.Event()
        self._exited = threading.Event()
        self._zygote_gone = ""  # why the zygote ended before reporting this driver's exit
        self.pid = 0
        ends: list[int] = []  # this process's copies of the child's stdin, stdout and stderr
        readers: list[int] = []
        try:
            if terminal is not None:
                ends = [os.dup(terminal) for _ in range(3)]
                readers = [os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_RDONLY)]
            else:
                ends.append(os.open(os.devnull, os.O_RDONLY))
                for stream, choice in (("stdout", stdout), ("stderr", stderr)):
                    if choice == "pipe":
                        read_end, write_end = os.pipe()
                    elif choice == "devnull":
                        read_end, write_end = os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY)
                    elif (stream, choice) == ("stderr", "inherit"):
                        read_end, write_end = os.open(os.devnull, os.O_RDONLY), os.dup(2)
                    elif (stream, choice) == ("stderr", "stdout"):
                        read_end, write_end = os.open(os.devnull, os.O_RDONLY), os.dup(ends[1])
                    else:
                        raise ValueError(f"ForkedDriver: {stream}={choice!r} is not supported")
                    readers.append(read_end)
                    ends.append(write_end)
            request = {
                "script": str(script),
                "args": [str(a) for a in args],
                "env": dict(os.environ if env is None else env),
                "cwd": os.getcwd(),
                "umask": _umask(),
            }
            _zygote().fork(self, request, ends)
        except BaseException:
            for fd in readers:
                os.close(fd)
            raise
        finally:
            for fd in ends:
                os.close(fd)
        self.stdout = open(readers[0], encoding="utf-8", errors="replace")  # noqa: SIM115
        self.stderr = open(readers[1], encoding="utf-8", errors="replace")  # noqa: SIM115

    def kill(self) -> None:
        """SIGKILL the driver (nothing once it has exited)."""
        self.send_signal(signal.SIGKILL)

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the driver (nothing once it has exited)."""
        with self._lock:
            if self.returncode is None and not self._zygote_gone:
                os.kill(self.pid, signum)

    def poll(self) -> int | None:
        """The exit code (``-N``: killed by signal N) once the driver exited, else ``None``."""
        if self._zygote_gone:
            raise RuntimeError(self._zygote_gone)
        return self.returncode

    def wait(self, timeout: float = 60.0) -> int:
        """Wait for the driver to exit (``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked driver {self.pid}", timeout)
        code = self.poll()
        assert code is not None
        return code

    def communicate(self, timeout: float = 60.0) -> tuple[str, str]:
        """Read stdout and stderr to their end and wait for the driver to exit, within
        ``timeout`` seconds (``subprocess.TimeoutExpired`` after it, as ``Popen`` raises)."""
        deadline = time.monotonic() + timeout
        texts: dict[str, str] = {}
        readers = [
            threading.Thread(target=lambda n=name, f=f: texts.__setitem__(n, f.read()), daemon=True)
            for name, f in (("out", self.stdout), ("err", self.stderr))
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        self.wait(max(0.0, deadline - time.monotonic()))
        if any(reader.is_alive() for reader in readers):
            raise subprocess.TimeoutExpired(f"forked driver {self.pid}", timeout)
        self.stdout.close()
        self.stderr.close()
        return texts["out"], texts["err"]

    # Called by the zygote's reader thread.
    def _started(self, pid: int) -> None:
        self.pid = pid
        self._forked.set()

    def _ended(self, code: int) -> None:
        with self._lock:
            self.returncode = code
        self._exited.set()

    def _lost(self, why: str) -> None:
        self._zygote_gone = why
        self._forked.set()
        self._exited.set()


class _Zygote:
    """The test process's end of the zygote: requests out, pids and exit codes back.

    Messages, one per ``SOCK_SEQPACKET`` packet. To the zygote: a request as JSON with the child's
    stdin, stdout and stderr as file descriptors; ``R <pid>`` once that driver's exit code is
    recorded (the zygote then reaps it: until then its pid cannot be reused). From the zygote:
    ``P <pid>`` for each fork, in order; ``X <pid> <exit code>``; ``E <text>`` if it failed to
    start (then it exits).
    """

    def __init__(self) -> None:
        self.owner = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        import ddptrain

        try:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(theirs.fileno()), str(os.getpid()), str(ddptrain.__file__)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=_SESSION_ENV,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # Ctrl-C on the test's terminal is not for it
            )
        finally:
            theirs.close()
        self.sock = ours
        self.alive = True
        self.error = ""
        self._send_lock = threading.Lock()
        self._waiting: collections.deque[ForkedDriver] = collections.deque()  # for their pid, in order
        self._drivers: dict[int, ForkedDriver] = {}
        threading.Thread(target=self._read, name="forked-driver-zygote", daemon=True).start()

    def fork(self, driver: ForkedDriver, request: dict, fds: list[int]) -> None:
        with self._send_lock:
            if not self.alive:
                raise RuntimeError(self._why_gone())
            self._waiting.append(driver)
            try:
                socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            except OSError:
                self._waiting.remove(driver)
                raise
        if not driver._forked.wait(_START_TIMEOUT_S):
            raise RuntimeError(
                f"the forked-driver zygote (pid {self.proc.pid}) did not fork {request['script']} in "
                f"{_START_TIMEOUT_S:.0f} s ({'it is still running' if self.proc.poll() is None else self._why_gone()})"
            )
        if driver._zygote_gone:
            raise RuntimeError(f"{request['script']} was not started: {driver._zygote_gone}")

    def _why_gone(self) -> str:
        code = self.proc.poll()
        status = "is still running" if code is None else f"exited with status {code}"
        return f"the forked-driver zygote (pid {self.proc.pid}) ended its socket and {status}" + (
            f":\n{self.error}" if self.error else ""
        )

    def _send(self, message: bytes) -> None:
        with self._send_lock, contextlib.suppress(OSError):
            self.sock.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self.sock.recv(_MAX_MESSAGE)
            except OSError:
                message = b""
            if not message:
                break
            kind, _, rest = message.decode(errors="replace").partition(" ")
            if kind == "P":
                pid = int(rest)
                driver = self._waiting.popleft()
                self._drivers[pid] = driver
                driver._started(pid)
            elif kind == "X":
                pid, code = (int(field) for field in rest.split())
                ended = self._drivers.pop(pid, None)
                if ended is not None:
                    ended._ended(code)
                self._send(f"R {pid}".encode())
            elif kind == "E":
                self.error = rest
        with self._send_lock:
            self.alive = False
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)
        why = self._why_gone()
        for driver in [*self._waiting, *self._drivers.values()]:
            driver._lost(why)

    def close(self) -> None:
        """End the zygote (its socket's end), within a bound."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5.0)
        self.sock.close()


_lock = threading.Lock()
_zygotes: list[_Zygote] = []  # the one of this process, last


def _zygote() -> _Zygote:
    with _lock:
        if not _zygotes or not _zygotes[-1].alive or _zygotes[-1].owner != os.getpid():
            if not _zygotes:
                atexit.register(_close_all)
            _zygotes.append(_Zygote())
        return _zygotes[-1]


def _close_all() -> None:
    for zygote in _zygotes:
        if zygote.owner == os.getpid():
            zygote.close()


def zygote_pids() -> list[int]:
    """The pids of this process's zygotes (they outlive a test on purpose; their drivers do not)."""
    with _lock:
        return [z.proc.pid for z in _zygotes if z.owner == os.getpid() and z.proc.poll() is None]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# The zygote (``python forked_driver.py FD PARENT DDPTRAIN_INIT``), and its children.


def _die_with(parent: int) -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the prctl
        os._exit(1)


def _serve(fd: int, parent: int, ddptrain_init: str) -> None:  # pragma: no cover (the zygote)
    _die_with(parent)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    sock = socket.socket(fileno=fd)
    own_path = _python_path(os.environ)
    try:
        import ddptrain
        import ddptrain.driver.controller  # noqa: F401  (torch and the driver: what every driver imports)

        if os.path.realpath(str(ddptrain.__file__)) != os.path.realpath(ddptrain_init):
            raise RuntimeError(f"the zygote imported ddptrain from {ddptrain.__file__}, the tests from {ddptrain_init}")
        if threading.active_count() != 1:
            raise RuntimeError(f"the zygote's imports started threads: {threading.enumerate()}")
    except BaseException:
        sock.send(("E " + traceback.format_exc()[-50_000:]).encode())  # a packet fits a socket buffer
        os._exit(1)
    # What ``python script.py`` has after the script's folder and PYTHONPATH's entries.
    site_path = [p for p in sys.path[1:] if p not in own_path]
    running: dict[int, int] = {}  # pidfd -> pid of a driver that has not exited
    exited: set[int] = set()  # reported, not reaped yet
    channels: set[socket.socket] = set()  # each running driver's, for its agent fork servers
    servers: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> pid of a server, its driver's channel
    while True:
        ready = select.select([sock, *running, *channels, *servers], [], [], 1.0)[0]
        if os.getppid() != parent:
            os._exit(0)
        for pidfd in ready:
            if pidfd in servers:
                pid, channel = servers.pop(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):  # its driver may be gone
                    channel.send(f"X {pid} {os.waitstatus_to_exitcode(status)}".encode())
            elif pidfd in channels:
                _fork_agent_server(sock, running, pidfd, channels, servers, site_path)
            elif pidfd in running:
                pid = running.pop(pidfd)
                os.close(pidfd)
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                assert info is not None
                code = -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status
                exited.add(pid)
                sock.send(f"X {pid} {code}".encode())
        if sock not in ready:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except OSError:
            message, fds = b"", []
        if not message:  # the test process's end closed
            os._exit(0)
        if message.startswith(b"R "):
            pid = int(message[2:])
            if pid in exited:
                exited.discard(pid)
                os.waitpid(pid, 0)
            continue
        request = json.loads(message)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            _close_zygotes(sock, running, channels, servers)
            ours.close()
            _die_with(os.getppid())  # a driver the tests can no longer see ends with the zygote
            _run_script_and_exit(request, fds, site_path, theirs)
        theirs.close()
        channels.add(ours)
        for fd in fds:
            os.close(fd)
        running[os.pidfd_open(pid)] = pid
        sock.send(f"P {pid}".encode())


def _close_zygotes(
    sock: socket.socket, running: dict[int, int], channels: set[socket.socket], servers: dict[int, object]
) -> None:
    """In a child of the zygote: close what is the zygote's (its sockets and pidfds)."""
    sock.close()
    for channel in channels:
        channel.close()
    for pidfd in [*running, *servers]:
        os.close(pidfd)


def _fork_agent_server(
    sock: socket.socket,
    running: dict[int, int],
    channel: socket.socket,
    channels: set[socket.socket],
    servers: dict[int, tuple[int, socket.socket]],
    site_path: list[str],
) -> None:  # pragma: no cover (the zygote)
    """A driver asks for an agent fork server (``ddptrain.launch.forkserver``): fork one that
    starts as the agent's command line would, from here, where torch is imported already."""
    try:
        message, fds, _, _ = socket.recv_fds(channel, _MAX_MESSAGE, 1)
    except OSError:
        message, fds = b"", []
    if not message or len(fds) != 1:  # the driver is gone
        for fd in fds:
            os.close(fd)
        channels.discard(channel)
        channel.close()
        return
    pid = os.fork()
    if pid == 0:
        _close_zygotes(sock, running, channels, servers)
        _run_agent_server(json.loads(message), fds[0], site_path)
    os.close(fds[0])
    servers[os.pidfd_open(pid)] = (pid, channel)
    with contextlib.suppress(OSError):  # its driver may be gone (a test SIGKILLed it): reaped as it ends
        channel.send(f"P {pid}".encode())


def _run_agent_server(request: dict, control_fd: int, site_path: list[str]) -> None:  # pragma: no cover
    """Become what ``python -c BOOT`` (``ddptrain.wire.boot.agent_command``) with ``control_fd``
    in its environment is: an agent fork server, in a session of its own, with the agent's
    environment, working directory, umask, ``sys.path`` and signal handlers."""
    try:
        from ddptrain.agent import main as agent
        from ddptrain.wire.boot import FORKSERVER_FD_VAR

        os.setsid()
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        env: dict[str, str] = request["env"]
        os.environ.clear()
        os.environ.update(env)
        os.environ[FORKSERVER_FD_VAR] = str(control_fd)
        sys.path[:] = [*_python_path(env), *site_path]
        sys.argv = ["-c"]
        sys.orig_argv = request["argv"]  # an agent that replaces itself (exec) runs the real command
        sys.modules["__main__"] = types.ModuleType("__main__")
        for signum in (signal.SIGTERM, signal.SIGALRM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        agent.entry(env.get("OPENBLAS_NUM_THREADS"))  # exits (in the server and in every agent)
    finally:
        os._exit(1)


def _python_path(env: Mapping[str, str]) -> list[str]:
    """The folders ``PYTHONPATH`` puts on ``sys.path`` (relative ones from the working directory)."""
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _output(fd: int, unbuffered: bool, errors: str) -> io.TextIOWrapper:
    """``sys.stdout`` (1) or ``sys.stderr`` (2) on ``fd`` as Python makes them (``PYTHONUNBUFFERED``:
    written through; else line-buffered on a terminal and for stderr, block-buffered otherwise)."""
    raw = io.FileIO(fd, "w", closefd=False)
    line_buffering = not unbuffered and (raw.isatty() or fd == 2)
    buffer = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        buffer,
        encoding="utf-8",
        errors=errors,
        newline="\n",
        line_buffering=line_buffering,
        write_through=unbuffered,
    )


class _ServerProcess:
    """What ``ddptrain.launch.forkserver`` uses of the ``Popen`` of its server (``pid``,
    ``poll``, ``wait``), for a server the zygote forked: the zygote reaps it and sends its exit
    code on the driver's channel."""

    def __init__(self, servers: _AgentServers, pid: int) -> None:
        self._servers = servers
        self.pid = pid

    def poll(self) -> int | None:
        return self._servers.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("ddptrain agent fork server", timeout or 0.0)
            time.sleep(0.05)
        return code


class _AgentServers:
    """In a forked driver: its agent fork servers are forked by the zygote, which has imported
    torch already, instead of started as new processes (``launch.forkserver._start_server``)."""

    def __init__(self, channel: socket.socket) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self._codes: dict[int, int] = {}  # the exit codes the zygote sent

    def start(self, env: dict[str, str], fd: int) -> _ServerProcess:
        from ddptrain.wire.boot import agent_command, import_pins

        request = {
            "env": env,
            "cwd": os.getcwd(),
            "umask": _umask(),
            "argv": agent_command(sys.executable, import_pins()),
        }
        with self._lock:
            socket.send_fds(self._channel, [json.dumps(request).encode()], [fd])
            while True:
                if not select.select([self._channel], [], [], _START_TIMEOUT_S)[0]:
                    raise OSError(f"the zygote did not fork an agent fork server in {_START_TIMEOUT_S:.0f} s")
                kind, pid = self._read()[:2]
                if kind == "P":
                    return _ServerProcess(self, pid)

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            while select.select([self._channel], [], [], 0)[0]:
                self._read()
        return self._codes.get(pid)

    def _read(self) -> list:
        message = self._channel.recv(64)
        if not message:
            raise OSError("the forked-driver zygote is gone")
        kind, pid, *code = message.decode().split()
        if kind == "X":
            self._codes[int(pid)] = int(code[0])
        return [kind, int(pid), *code]


def _run_script_and_exit(
    request: dict, fds: list[int], site_path: list[str], channel: socket.socket
) -> None:  # pragma: no cover
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        env: dict[str, str] = request["env"]
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = _output(1, unbuffered, "strict")
        sys.stderr = _output(2, unbuffered, "backslashreplace")
        for signum in (signal.SIGTERM, signal.SIGALRM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.setLevel(logging.WARNING)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()  # putenv: torch's C++ code sees the driver's environment too
        os.environ.update(env)
        os.environ.pop("PYTEST_CURRENT_TEST", None)
        from ddptrain.launch import forkserver

        forkserver._start_server = _AgentServers(channel).start  # type: ignore[assignment]
        script = os.path.abspath(request["script"])
        python_path = _python_path(env)
        sys.path[:] = [os.path.dirname(script), *python_path, *site_path]
        sys.argv = [request["script"], *request["args"]]
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    try:
        _serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    except BaseException:  # the test process sees why (its stderr is /dev/null)
        with contextlib.suppress(OSError):
            socket.socket(fileno=int(sys.argv[1])).send(("E " + traceback.format_exc()[-50_000:]).encode())
        os._exit(1)
