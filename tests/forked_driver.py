"""A driver script run in a process forked from the test process, for the tests that kill drivers.

A script started with ``python script.py`` pays its own torch import (seconds of CPU on the CI
machine) before its run starts; a child forked from the test process, which has imported torch
and the driver already, starts its run at once. Everything after the fork is the script's own:
its ``__main__``, its stdout and stderr (pipes, as ``subprocess.Popen`` gives them), a root logger
without handlers (warnings reach stderr as they do in a script) and default signal handlers. Its
agents start as new processes (``DDPTRAIN_AGENT_FORKSERVER=0``): the test process's own agent fork
servers stay its own. Killing it is killing a driver: its agents and workers see it die.

Not for tests of what a driver process imports or where it imports it from (its modules are the
test process's), nor for drivers that compute with torch themselves (``use_local``: OpenMP after
a fork). conftest's leftover check finds processes by the tag in ``/proc/PID/environ``, which a
forked child shows as the test process's start-up environment (without the tag): the tests reap
their forked driver themselves (its agents and workers are tagged as always).
"""

from __future__ import annotations

import gc
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

__all__ = ["ForkedDriver"]


class ForkedDriver:
    """``python script args...`` in a forked child; the part of ``subprocess.Popen`` tests use
    (``pid``, ``stdout``, ``kill``, ``poll``, ``wait``, ``communicate``, ``returncode``), text mode."""

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
        import ddptrain.driver.controller  # noqa: F401  (imports torch here once: the child need not)

        def nothing_to_read(write_fd: int) -> tuple[int, int]:
            return os.open(os.devnull, os.O_RDONLY), write_fd

        if terminal is not None:
            (out_r, out_w), (err_r, err_w) = nothing_to_read(os.dup(terminal)), nothing_to_read(os.dup(terminal))
        else:
            out_r, out_w = os.pipe() if stdout == "pipe" else nothing_to_read(os.open(os.devnull, os.O_WRONLY))
            err_r, err_w = {
                "pipe": os.pipe,
                "devnull": lambda: nothing_to_read(os.open(os.devnull, os.O_WRONLY)),
                "inherit": lambda: nothing_to_read(os.dup(2)),
                "stdout": lambda: nothing_to_read(os.dup(out_w)),
            }[stderr]()
        sys.stdout.flush()
        sys.stderr.flush()
        # Garbage of earlier runs in this process (e.g. a store kept alive by a caught error's
        # traceback) is freed here, where its threads exist: in the child its C++ destructor
        # would join a thread the fork did not copy (std::system_error, abort).
        gc.collect()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            gc.freeze()  # and what is left of this process's objects is never collected there
            os.close(out_r)
            os.close(err_r)
            _run_script_and_exit(str(script), args, env, out_w, err_w, terminal)
        os.close(out_w)
        os.close(err_w)
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = open(out_r, encoding="utf-8", errors="replace")  # noqa: SIM115
        self.stderr = open(err_r, encoding="utf-8", errors="replace")  # noqa: SIM115

    def kill(self) -> None:
        """SIGKILL the driver (nothing if it was reaped already)."""
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the driver (nothing if it was reaped already)."""
        if self.returncode is None:
            os.kill(self.pid, signum)

    def poll(self) -> int | None:
        """The exit code (``-N``: killed by signal N) once the driver ended, else ``None``."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float = 60.0) -> int:
        """Wait for the driver to exit (``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked driver {self.pid}", timeout)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

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


def _run_script_and_exit(
    script: str, args: list[str], env: dict[str, str] | None, out_w: int, err_w: int, terminal: int | None
) -> None:  # pragma: no cover
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY) if terminal is None else os.dup(terminal)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for fd in (devnull, out_w, err_w):
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        for signum in (signal.SIGTERM, signal.SIGALRM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.setLevel(logging.WARNING)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.environ["DDPTRAIN_AGENT_FORKSERVER"] = "0"
        os.environ.pop("PYTEST_CURRENT_TEST", None)
        sys.argv = [script, *args]
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
