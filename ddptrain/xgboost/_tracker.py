"""XGBoost's collective tracker, in a child process of the driver.

The tracker (``xgboost.tracker.RabitTracker``) tells the workers where their peers are when
their ``CommunicatorContext`` starts, and waits for each of them to say goodbye when it ends.
In-process it cannot be stopped: its thread waits in C++ for workers that, after a failure,
never come, and freeing it blocks until they do. A child process can be killed; it also exits
when the driver dies (its stdin closes).

Driver side: :class:`TrackerProcess`. Child side: :func:`main`, run as
``python -c "...; from ddptrain.xgboost._tracker import main; main()" CONFIG SYS_PATH``.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from ddptrain.errors import LaunchError

__all__ = ["TrackerProcess"]

_logger = logging.getLogger(__name__)
# The driver's path, and never the working directory ('' with -c), which another user may have
# planted modules in: it is taken off before anything is imported.
_CHILD = (
    "import sys; sys.path[:] = [p for p in sys.path if p]; import json; sys.path[:0] = json.loads(sys.argv[2]); "
    "from ddptrain.xgboost._tracker import main; main()"
)
_WATCH_S = 0.5  # how often the driver checks that the worker group still runs
_TERM_S = 2.0  # from SIGTERM to SIGKILL of the tracker


class TrackerProcess:
    """A running tracker for ``n_workers`` workers, listening on ``host`` (an IPv4 address,
    ``"0.0.0.0"`` for every interface).

    Args:
        n_workers: Workers in the communication group.
        host: Address the tracker listens on.
        start_timeout_s: How long the child may take to import XGBoost and start listening.

    Raises:
        LaunchError: The tracker did not start (its error output is in the message).
    """

    def __init__(self, n_workers: int, host: str, start_timeout_s: float = 60.0) -> None:
        self._lock = threading.Lock()
        self._stderr: collections.deque[str] = collections.deque(maxlen=20)
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr_thread: threading.Thread | None = None
        self.port = 0
        config = json.dumps({"n_workers": n_workers, "host": host})
        paths = json.dumps([os.path.abspath(p) for p in sys.path if p])
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, config, paths],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            self._stderr_thread = threading.Thread(target=self._drain_stderr, name="xgboost-tracker-log", daemon=True)
            self._stderr_thread.start()
            self.port = self._read_port(start_timeout_s)
        except BaseException:
            self.stop(0.0)
            raise

    def _read_port(self, timeout_s: float) -> int:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        line = b""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise LaunchError(self._failure(f"did not start listening within {timeout_s:g} s"))
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    proc.wait(5.0)
                    if self._stderr_thread is not None:
                        self._stderr_thread.join(2.0)
                    raise LaunchError(self._failure(f"exited with code {proc.returncode} before listening"))
                line += chunk
        port: int = json.loads(line)["port"]
        return port

    def _failure(self, what: str) -> str:
        output = "\n".join(self._stderr) or "(no output)"
        return f"XGBoost's tracker on the driver {what}. Its output:\n{output}"

    def _drain_stderr(self) -> None:
        proc = self._proc
        if proc is None or proc.stderr is None:
            return
        for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            if line:  # what the workers print through XGBoost (rank 0's eval log) and errors
                self._stderr.append(line)
                try:
                    sys.stderr.write(f"[xgboost] {line}\n")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass

    def watch(self, running: Callable[[], bool]) -> None:
        """Stop the tracker as soon as ``running()`` turns false (the worker group failed or
        was shut down): its workers will never come back to it."""

        def loop() -> None:
            while self.alive:
                if not running():
                    self.stop(0.0)
                    return
                time.sleep(_WATCH_S)

        threading.Thread(target=loop, name="xgboost-tracker-watch", daemon=True).start()

    @property
    def alive(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None

    def stop(self, wait_s: float) -> None:
        """Give the tracker ``wait_s`` seconds to finish (every worker said goodbye), then end
        it: SIGTERM, then SIGKILL. Safe to call twice and from two threads."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(_TERM_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        if proc.returncode not in (0, -15, -9):
            _logger.warning("ddptrain: XGBoost's tracker exited with code %s", proc.returncode)


def main() -> None:
    """The child: start the tracker, print its port, run it until the workers are done (or
    stdin closes: the driver stopped it or died)."""
    config = json.loads(sys.argv[1])
    from xgboost.tracker import RabitTracker

    # sortby="task": XGBoost's ranks follow the task ids, which hold ddptrain's ranks.
    tracker = RabitTracker(n_workers=config["n_workers"], host_ip=config["host"], sortby="task")
    tracker.start()
    port = tracker.worker_args()["dmlc_tracker_port"]
    sys.stdout.write(json.dumps({"port": port}) + "\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the tracker prints a line per worker ("Task ... got rank ..."): drop it

    def exit_with_driver() -> None:
        sys.stdin.buffer.read()
        os._exit(0)

    threading.Thread(target=exit_with_driver, daemon=True).start()
    try:
        tracker.wait_for()
    except Exception as exc:
        sys.stderr.write(f"{exc}\n".split("Stack trace:")[0].strip() + "\n")
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)
