"""``UploadProcess``: where a worker's ``ASYNC`` checkpoint uploads run, a process of their own.

An upload to an object store spends CPU in the client (hashing, TLS, the HTTP library's event
loop). Run on a thread of the training process, that CPU and the GIL are taken from the
training thread; run here, the training process only waits on a pipe for the answer, and the
uploader can run at a lower CPU priority (``DDPTRAIN_UPLOAD_NICE``).

The worker starts it at its first ``ASYNC`` upload (``python -c``, importing this ddptrain and
never the working directory's modules), sends it the run's
:class:`~ddptrain.wire.protocol.StorageSpec` once, then one job per upload; the uploader builds
the worker's side of the run's storage and calls :meth:`RunStorage.stage` for each job, in
order, one at a time, and answers with the folder or the error. It ends when its stdin ends,
and the kernel kills it when the thread that started it dies (``PR_SET_PDEATHSIG``), so a
killed worker never leaves an upload running; it is in the worker's process group too.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import cloudpickle

from ddptrain import _env
from ddptrain._proc import die_with_parent
from ddptrain.errors import StorageError
from ddptrain.storage.open import worker_storage

__all__ = ["UploadProcess", "main"]

_HEADER = struct.Struct("!Q")
_CHILD = (
    "import sys; sys.path[:1] = [sys.argv[1]]; "  # not the working directory ('' with -c): this ddptrain
    "from ddptrain.storage.upload_process import main; sys.exit(main(int(sys.argv[2]), int(sys.argv[3])))"
)
CLOSE_WAIT_S = 5.0  # how long close() waits for the uploader to end before it kills it


def _write(stream: IO[bytes], message: Any) -> None:
    data = cloudpickle.dumps(message)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream: IO[bytes]) -> Any:
    """The next message, or ``None`` when the stream ended."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


class UploadProcess:
    """A worker's uploader: :meth:`stage` as ``RunStorage.stage``, run in another process
    (started by the first call).

    Args:
        spec: The run's ``StorageSpec`` (what the worker built its storage from).
        run_name: The run's name.
    """

    def __init__(self, spec: Any, run_name: str) -> None:
        self._setup = (spec, run_name)
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one job at a time

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def stage(self, source: str, name: str, attempt: int, index: int, rank: int, move: bool = False) -> str:
        """Upload (stage) one rank's checkpoint files, as ``RunStorage.stage`` does.

        Raises:
            FileNotFoundError: ``source`` is not a folder.
            StorageError: The upload failed, or the uploader ended before it answered.
        """
        with self._lock:
            process = self._start()
            assert process.stdin is not None and process.stdout is not None
            try:
                _write(process.stdin, (source, name, attempt, index, rank, move))
                answer = _read(process.stdout)
            except (BrokenPipeError, OSError):
                answer = None
            if answer is None:
                raise StorageError(
                    f"Uploading checkpoint {name!r} of report #{index} failed: the worker's upload process "
                    f"(pid {process.pid}) ended before it answered ({_ended(process)})."
                )
            ok, value = answer
            if ok:
                return str(value)
            raise _error(value)

    def close(self) -> None:
        """End the uploader (an upload still running is killed); idempotent."""
        with contextlib.suppress(Exception):  # close() runs in finally blocks: it must not raise
            self._close()

    def _close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
        try:
            process.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def _start(self) -> subprocess.Popen[bytes]:
        if self._process is not None:
            return self._process
        root = str(Path(__file__).resolve().parents[2])  # where this ddptrain is imported from
        process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, root, str(os.getpid()), str(_env.upload_nice())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,  # answers; its stderr is the worker's (its log)
        )
        assert process.stdin is not None
        try:
            _write(process.stdin, self._setup)
        except OSError:
            pass  # it ended already: the first job says so
        self._process = process
        return process


def _ended(process: subprocess.Popen[bytes]) -> str:
    try:
        code = process.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return "its pipe closed"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _error(value: tuple[bytes | None, str]) -> BaseException:
    pickled, described = value
    if pickled is not None:
        try:
            error = pickle.loads(pickled)
            if isinstance(error, BaseException):
                return error
        except Exception:
            pass
    return StorageError(described)


def main(parent: int, nice: int) -> int:
    """The uploader (started by the worker ``parent``, at ``nice``): jobs from stdin, answers
    to stdout, until stdin ends."""
    if not die_with_parent(parent):  # the worker died before the request took effect
        return 1
    for stray in (signal.SIGUSR1, signal.SIGUSR2):  # SLURM's --signal reaches every process of a step
        signal.signal(stray, signal.SIG_IGN)
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
    jobs = sys.stdin.buffer
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a library prints goes to the worker's log, not into the answers
    setup = _read(jobs)
    if setup is None:
        return 0
    spec, run_name = setup
    storage = worker_storage(spec, run_name)
    while True:
        job = _read(jobs)
        if job is None:
            return 0
        try:
            answer: tuple[bool, Any] = (True, storage.stage(*job))
        except BaseException as exc:  # the worker raises it as its own
            answer = (False, (_pickled(exc), f"{type(exc).__name__}: {exc}"))
        _write(answers, answer)


def _pickled(error: BaseException) -> bytes | None:
    try:
        data = cloudpickle.dumps(error)
        pickle.loads(data)  # an exception whose class cannot be rebuilt is sent as its text
        return data
    except Exception:
        return None
