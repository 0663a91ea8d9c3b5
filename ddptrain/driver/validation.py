"""Asynchronous validation of committed checkpoints (``ValidationConfig``), in the driver.

Each checkpoint reported with ``validation=...`` is queued once committed; one validation runs
at a time, in report order (as Ray's ``MAX_IN_FLIGHT_VALIDATIONS = 1``: a second process would
take the training's CPU share), in a process of its own on the driver's host
(:mod:`ddptrain.driver.validation_child`, a plain ``python`` that imports neither torch nor
the driver), in its own session so that whatever it starts is killed with it. The driver
polls it (:meth:`Validations.poll`), never waits on it, except at the end of ``fit()``
(:meth:`Validations.finish`, bounded by ``DDPTRAIN_VALIDATION_WAIT_S``). A validation running
past ``DDPTRAIN_VALIDATION_TIMEOUT_S`` is killed and reported as failed.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import cloudpickle

from ddptrain import _env, ray_compat
from ddptrain.checkpoint import Checkpoint

__all__ = ["Finished", "Task", "Validations"]

_logger = logging.getLogger(__name__)

_CHILD = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from ddptrain.driver.validation_child import main; sys.exit(main(sys.argv[2]))"
)


@dataclass(frozen=True)
class Task:
    """One validation to run: checkpoint ``name`` of report ``index`` (made in ``attempt``),
    and the report's request (``spec``: cloudpickled ``(fn, args, fn_kwargs)``, each may be
    ``None``, opaque to the driver)."""

    name: str
    checkpoint: Checkpoint
    index: int
    attempt: int
    spec: bytes


@dataclass(frozen=True)
class Finished:
    """A validation that ended: its metrics, or ``error`` (a traceback, or why it was killed),
    and its output's log file. ``ran``: the function ran to an end (its metrics, its error,
    or its timeout); not when the run stopped first."""

    task: Task
    metrics: dict[str, Any] | None
    error: str | None
    log: str
    seconds: float
    ran: bool = True
    started: float | None = None  # when its process started (``time.time()``)


@dataclass
class _Running:
    task: Task
    process: subprocess.Popen[bytes]
    folder: str
    log: str
    log_file: IO[bytes]
    started: float
    wall_started: float


class Validations:
    """The run's validation queue and its one running process.

    Args:
        fn: The trainer's ``ValidationConfig.fn`` (``None``: only ``report(validate_fn=...)``).
        fn_kwargs: Its default keyword arguments (``ValidationConfig.task_config``).
        log_dir: Where each validation's output goes (``<checkpoint>.log``).
        uses_gpu: Leave the driver's GPUs visible to the function (else ``CUDA_VISIBLE_DEVICES=""``).
        clock: ``time.monotonic`` (a test's fake clock).
    """

    def __init__(
        self,
        fn: Callable[..., Any] | None,
        fn_kwargs: dict[str, Any] | None,
        log_dir: Path,
        uses_gpu: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._default = cloudpickle.dumps((fn, dict(fn_kwargs or {}))) if fn is not None else None
        self.log_dir = log_dir
        self.uses_gpu = uses_gpu
        self.clock = clock
        self.queue: collections.deque[Task] = collections.deque()
        self.running: _Running | None = None

    @property
    def pending(self) -> list[str]:
        """The checkpoints whose validation is running or queued, oldest first."""
        running = [self.running.task.name] if self.running is not None else []
        return running + [task.name for task in self.queue]

    def submit(self, task: Task) -> None:
        """Queue the validation of a committed checkpoint (started by the next :meth:`poll`)."""
        self.queue.append(task)

    def poll(self) -> list[Finished]:
        """Reap the running validation if it ended (or kill it past its timeout), and start the
        next one; returns what ended. Never blocks for more than a kill's grace."""
        done: list[Finished] = []
        running = self.running
        if running is not None:
            timed_out = self.clock() - running.started > _env.validation_timeout_s()
            if running.process.poll() is not None or timed_out:
                done.append(self._reap(running, timed_out))
        if self.running is None and self.queue:
            self._start(self.queue.popleft())
        return done

    def finish(self, timeout_s: float, say: Callable[[str], None]) -> list[Finished]:
        """Wait up to ``timeout_s`` for the queued and running validations (the console says
        what it waits for); those left then are killed or dropped, reported as failed."""
        done = self.poll()
        if not self.pending:
            return done
        say(
            f"ddptrain: waiting up to {timeout_s:g} s for the validation of checkpoint(s) "
            f"{', '.join(self.pending)} (DDPTRAIN_VALIDATION_WAIT_S)"
        )
        deadline = self.clock() + timeout_s
        while self.pending and self.clock() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - self.clock())))
            done += self.poll()
        why = f"not done {timeout_s:g} s after training ended (DDPTRAIN_VALIDATION_WAIT_S)"
        return done + self.close(why)

    def close(self, why: str = "the run stopped") -> list[Finished]:
        """Kill the running validation and drop the queue (every path out of ``fit()``);
        returns them as failed with ``why``. Safe to call twice."""
        done = []
        running = self.running
        if running is not None:
            done.append(self._reap(running, False, why))
        done += [Finished(task, None, f"Validation not run: {why}.", "", 0.0, ran=False) for task in self.queue]
        self.queue.clear()
        return done

    # ----------------------------------------------------------------- the process
    def _start(self, task: Task) -> None:
        folder = tempfile.mkdtemp(prefix="ddptrain-validation-")  # 0700: the pickled function is private
        request = {
            "default": self._default,
            "spec": task.spec,
            "checkpoint": task.checkpoint,
            "sys_path": list(sys.path),
            "ray_compat": ray_compat.installed(),
        }
        log_file = None
        try:
            with open(os.path.join(folder, "task.pkl"), "wb") as f:
                cloudpickle.dump(request, f)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = str(self.log_dir / f"{task.name}.log")
            log_file = open(log, "ab")  # noqa: SIM115 (closed when the process is reaped)
            env = dict(os.environ)
            env.setdefault("OMP_NUM_THREADS", "1")
            if not self.uses_gpu:
                env["CUDA_VISIBLE_DEVICES"] = ""
            root = str(Path(__file__).resolve().parents[2])  # where this ddptrain is imported from
            started_at = time.time()
            process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, root, folder],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: killed with whatever it starts
            )
        except BaseException:
            if log_file is not None:
                log_file.close()
            shutil.rmtree(folder, ignore_errors=True)
            raise
        cpus = _env.validation_cpus()
        if cpus:  # from its start: its imports take CPU too (it pins itself again, for what it starts)
            with contextlib.suppress(OSError):
                os.sched_setaffinity(process.pid, cpus)
        self.running = _Running(task, process, folder, log, log_file, self.clock(), started_at)
        _logger.info("ddptrain: validating checkpoint %s (pid %d, log %s)", task.name, process.pid, log)

    def _reap(self, running: _Running, timed_out: bool, why: str | None = None) -> Finished:
        """End ``running`` (killed if it still runs) and read its result."""
        self.running = None
        process = running.process
        error = None
        if process.poll() is None:
            _kill(process, _env.shutdown_grace_s())
            if timed_out:
                error = (
                    f"Validation killed after {_env.validation_timeout_s():g} s (DDPTRAIN_VALIDATION_TIMEOUT_S); "
                    f"its output is in {running.log}."
                )
            else:
                error = f"Validation killed: {why}."
        else:
            _kill_group(process.pid)  # what the function started and left behind
        running.log_file.close()
        seconds = self.clock() - running.started
        try:
            result = _read_result(running.folder)
        finally:
            shutil.rmtree(running.folder, ignore_errors=True)
        if error is None and result is None:
            error = f"The validation process exited with code {process.returncode} without a result; see {running.log}."
        if error is None and result is not None:
            error = result.get("error")
        metrics = result.get("metrics") if result is not None and error is None else None
        return Finished(running.task, metrics, error, running.log, seconds, why is None, running.wall_started)


def _read_result(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, "result.json")) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _kill(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to the process's group, SIGKILL after ``grace_s``; reaped."""
    _kill_group(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(process.pid)
    process.wait()
