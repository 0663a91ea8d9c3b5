"""Asynchronous validation of committed checkpoints (``ValidationConfig``), in the driver.

Each checkpoint reported with ``validation=...`` is queued once committed; one validation runs
at a time, in report order (as Ray's ``MAX_IN_FLIGHT_VALIDATIONS = 1``: a second process would
take the training's CPU share), in a process of its own
(:mod:`ddptrain.driver.validation_child`, a plain ``python`` that imports neither torch nor
the driver), in its own session so that whatever it starts is killed with it. Where it runs
is a :class:`Where`: the driver's host (:class:`LocalHost`, the default) or a listed SSH host
(``ValidationConfig(host=...)``, :class:`ddptrain.driver.validation_ssh.SSHValidationHost`).
The driver polls it (:meth:`Validations.poll`), never waits on it, except at the end of
``fit()`` (:meth:`Validations.finish`, bounded by ``DDPTRAIN_VALIDATION_WAIT_S``). A
validation running past ``DDPTRAIN_VALIDATION_TIMEOUT_S`` is killed and reported as failed.
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
from typing import IO, Any, Protocol

import cloudpickle

from ddptrain import _env, ray_compat
from ddptrain.checkpoint import Checkpoint
from ddptrain.driver.gpu_env import set_gpu_defaults
from ddptrain.launch.reaping import exited, reap, wait_exited

__all__ = ["Finished", "LocalHost", "Process", "Task", "Validations", "Where", "parse_result"]

_logger = logging.getLogger(__name__)

_CHILD = (
    # This ddptrain first; the working directory ('' with -c: another user may have planted
    # modules there) off the path before anything is imported.
    "import sys; sys.path[:] = [sys.argv[1]] + [p for p in sys.path if p]; "
    "from ddptrain.driver.validation_child import main; sys.exit(main(sys.argv[2], driver=int(sys.argv[3])))"
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


class Process(Protocol):
    """One validation's process, wherever it runs."""

    def ended(self) -> bool:
        """Whether it ended. Never blocks."""

    def kill(self, grace_s: float) -> None:
        """End it and what it started (bounded by about ``grace_s``)."""

    def outcome(self) -> tuple[dict[str, Any] | None, str]:
        """Once ended: its result (``result.json``, ``None`` if it wrote none), and what to say
        when there is none; what it left behind (processes, its folder) is removed."""


class Where(Protocol):
    """Where the run's validations run."""

    def start(self, request: dict[str, Any], log: str) -> Process:
        """Start the validation of ``request`` (``checkpoint``: the committed checkpoint), its
        output appended to the file ``log``."""

    def close(self) -> None:
        """Nothing more runs there (its connection closes). Safe to call twice."""


@dataclass
class _Running:
    task: Task
    process: Process
    log: str
    started: float
    wall_started: float


class Validations:
    """The run's validation queue and its one running process.

    Args:
        fn: The trainer's ``ValidationConfig.fn`` (``None``: only ``report(validate_fn=...)``).
        fn_kwargs: Its default keyword arguments (``ValidationConfig.task_config``).
        log_dir: Where each validation's output goes (``<checkpoint>.log``).
        where: Where they run (default: this machine, no GPU visible).
        clock: ``time.monotonic`` (a test's fake clock).
    """

    def __init__(
        self,
        fn: Callable[..., Any] | None,
        fn_kwargs: dict[str, Any] | None,
        log_dir: Path,
        where: Where | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._default = cloudpickle.dumps((fn, dict(fn_kwargs or {}))) if fn is not None else None
        self.log_dir = log_dir
        self.where: Where = where if where is not None else LocalHost()
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
            if running.process.ended() or timed_out:
                done.append(self._reap(running, timed_out))
        if self.running is None and self.queue:
            self._start(self.queue.popleft())
        return done

    def finish(
        self,
        timeout_s: float,
        say: Callable[[str], None],
        notice: Callable[[], tuple[float, str] | None] = lambda: None,
    ) -> list[Finished]:
        """Wait up to ``timeout_s`` for the queued and running validations (the console says
        what it waits for); those left then are killed or dropped, reported as failed.

        ``notice()``: a preemption notice's ``(deadline on clock, reason)``, or ``None``. The
        wait ends by that deadline (at once after a second notice), as training would have.
        """
        done = self.poll()
        if not self.pending:
            return done
        say(
            f"ddptrain: waiting up to {timeout_s:g} s for the validation of checkpoint(s) "
            f"{', '.join(self.pending)} (DDPTRAIN_VALIDATION_WAIT_S)"
        )
        deadline = self.clock() + timeout_s
        why = f"not done {timeout_s:g} s after training ended (DDPTRAIN_VALIDATION_WAIT_S)"
        while self.pending and self.clock() < deadline:
            preempted = notice()
            if preempted is not None and preempted[0] < deadline:  # a notice, or a second one (now)
                deadline, reason = preempted
                why = f"the run was preempted ({reason}) before it ended"
                left_s = max(0.0, deadline - self.clock())
                say(f"ddptrain: preemption notice ({reason}): validations not done in {left_s:.0f} s are stopped")
            time.sleep(min(0.05, max(0.0, deadline - self.clock())))
            done += self.poll()
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
        self.where.close()
        return done

    # ----------------------------------------------------------------- the process
    def _start(self, task: Task) -> None:
        request = {
            "default": self._default,
            "spec": task.spec,
            "checkpoint": task.checkpoint,
            "sys_path": list(sys.path),
            "ray_compat": ray_compat.installed(),
        }
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = str(self.log_dir / f"{task.name}.log")
        started_at = time.time()
        process = self.where.start(request, log)
        self.running = _Running(task, process, log, self.clock(), started_at)
        _logger.info("ddptrain: validating checkpoint %s (%s, log %s)", task.name, process, log)

    def _reap(self, running: _Running, timed_out: bool, why: str | None = None) -> Finished:
        """End ``running`` (killed if it still runs) and read its result."""
        self.running = None
        process = running.process
        error = None
        if not process.ended():
            process.kill(_env.shutdown_grace_s())
            if timed_out:
                error = (
                    f"Validation killed after {_env.validation_timeout_s():g} s (DDPTRAIN_VALIDATION_TIMEOUT_S); "
                    f"its output is in {running.log}."
                )
            else:
                error = f"Validation killed: {why}."
        seconds = self.clock() - running.started
        result, failure = process.outcome()
        if error is None and result is None:
            error = failure
        if error is None and result is not None:
            error = result.get("error")
        metrics = result.get("metrics") if result is not None and error is None else None
        return Finished(running.task, metrics, error, running.log, seconds, why is None, running.wall_started)


class LocalHost:
    """The driver's host: a ``python`` started here, in a private temp folder.

    Args:
        uses_gpu: Leave the driver's GPUs visible to the function (else ``CUDA_VISIBLE_DEVICES=""``).
    """

    def __init__(self, uses_gpu: bool = False) -> None:
        self.uses_gpu = uses_gpu

    def start(self, request: dict[str, Any], log: str) -> Process:
        folder = tempfile.mkdtemp(prefix="ddptrain-validation-")  # 0700: the pickled function is private
        log_file = None
        try:
            with open(os.path.join(folder, "task.pkl"), "wb") as f:
                cloudpickle.dump(request, f)
            log_file = open(log, "ab")  # noqa: SIM115 (closed when the process is reaped)
            env = dict(os.environ)
            env.setdefault("OMP_NUM_THREADS", "1")
            if not self.uses_gpu:
                env["CUDA_VISIBLE_DEVICES"] = ""
            else:
                set_gpu_defaults(env, gpus_per_worker=1)
            root = str(Path(__file__).resolve().parents[2])  # where this ddptrain is imported from
            process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, root, folder, str(os.getpid())],
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
        return _LocalProcess(process, folder, log_file, log)

    def close(self) -> None:
        pass


class _LocalProcess:
    def __init__(self, process: subprocess.Popen[bytes], folder: str, log_file: IO[bytes], log: str) -> None:
        self.process = process
        self.folder = folder
        self.log_file = log_file
        self.log = log

    def __str__(self) -> str:
        return f"pid {self.process.pid}"

    def ended(self) -> bool:
        return exited(self.process)  # not reaped: its pid names its group until the last killpg

    def kill(self, grace_s: float) -> None:
        _kill(self.process, grace_s)

    def outcome(self) -> tuple[dict[str, Any] | None, str]:
        _kill_group(self.process.pid)  # what the function started and left behind
        reaped = reap(self.process, "the validation process")
        self.log_file.close()
        try:
            result = _read_result(self.folder)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
        if not reaped:
            return result, f"The validation process (pid {self.process.pid}) did not end when killed; see {self.log}."
        code = self.process.returncode
        return result, f"The validation process exited with code {code} without a result; see {self.log}."


def _read_result(folder: str) -> dict[str, Any] | None:
    """The ``result.json`` a validation process wrote in ``folder`` (``None``: none, or not a dict)."""
    try:
        with open(os.path.join(folder, "result.json"), "rb") as f:
            return parse_result(f.read())
    except OSError:
        return None


def parse_result(data: bytes | None) -> dict[str, Any] | None:
    """A ``result.json``'s content as a dict (``None``: none, or not a dict)."""
    try:
        result = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return result if isinstance(result, dict) else None


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _kill(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to the process's group, SIGKILL after ``grace_s``. Not reaped: ``outcome``
    signals the group once more, then reaps it (see ``ddptrain.launch.reaping``)."""
    _kill_group(process.pid, signal.SIGTERM)
    wait_exited(process, grace_s)
    _kill_group(process.pid)
    wait_exited(process, grace_s + 5.0)  # SIGKILL: at once
