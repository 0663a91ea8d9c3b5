"""The one reader of a run: what ``Result.from_path``, tune, ``ddptrain runs``, ``show``,
``logs``, ``export``, ``plot`` and the dashboard know of a run directory, a run folder of this
machine or a run on remote storage (``s3://bucket/prefix/name``).

:func:`read_run` reads a run as a :class:`RunRecord`: the fields of ``run.json`` that are
sound, its status (ABORTED when its driver died without a word), the summary of its reports
(:mod:`ddptrain.storage.metrics` parses ``metrics.jsonl``), its committed checkpoints (the
checkpoint index, through the checkpoint manager), and what could not be read. Reading is
tolerant: a missing file is an empty one, a line cut short by a crash or still being written
is skipped, and a file that cannot be read is named in ``problems`` with the rest shown as usual.

A run on remote storage is read from a copy of its small files (``run.json``,
``metrics.jsonl``, ``checkpoints.json``; a log file when one is asked for), pulled into a
private folder under ``$DDPTRAIN_CACHE_DIR/read/`` (``Result.from_path``: a temporary one),
never into a driver's working copy. Its checkpoints are listed where they are, on the store.
"""

from __future__ import annotations

import math
import os
import posixpath
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ddptrain import _env
from ddptrain.storage import layout as storage
from ddptrain.storage import metrics as run_metrics
from ddptrain.storage import run_files
from ddptrain.storage.checkpoint_manager import CheckpointManager
from ddptrain.storage.layout import RunLayout
from ddptrain.storage.lock import driver_is_alive
from ddptrain.storage.metrics import MetricsSummary
from ddptrain.storage.remote import RemoteRoot, on_remote_storage, resolve
from ddptrain.storage.remote_checkpoints import RemoteCheckpointManager

__all__ = [
    "STATUSES",
    "RunNotFound",
    "RunRecord",
    "RunView",
    "find_run",
    "list_views",
    "open_result_run",
    "open_run",
    "read_metric_lines",
    "read_metrics",
    "read_run",
]

STATUSES = ("RUNNING", "RESTARTING", "FINISHED", "ERRORED", "ABORTED", "PREEMPTED")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _are_texts(value: Any) -> bool:
    return isinstance(value, list) and all(map(_is_text, value))


def _is_failure(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and _is_count(value.get("attempt"))
        and _is_text(value.get("error"))
        and (value.get("log") is None or _is_text(value["log"]))
    )


def _is_validation_error(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and _is_text(value.get("checkpoint"))
        and _is_text(value.get("error"))
        and (value.get("log") is None or _is_text(value["log"]))
    )


# The fields of run.json that are read, and whether a value is what ddptrain writes there.
_FIELDS: dict[str, Callable[[Any], bool]] = {
    "status": lambda value: value in STATUSES,
    "started": _is_number,
    "ended": _is_number,
    "attempt": _is_count,
    "error": _is_text,
    "upload_error": _is_text,
    "attempt_errors": lambda value: isinstance(value, list) and all(map(_is_failure, value)),
    "validation_errors": lambda value: isinstance(value, list) and all(map(_is_validation_error, value)),
    "num_workers": _is_count,
    "use_gpu": lambda value: isinstance(value, bool),
    "hosts": _are_texts,
    "argv": _are_texts,
    "backend_config": _is_text,
    "host": _is_text,
    "resizes": lambda value: (
        isinstance(value, list)
        and all(
            isinstance(r, dict) and _is_count(r.get("from")) and _is_count(r.get("to")) and _is_text(r.get("why"))
            for r in value
        )
    ),
    "preempted": lambda value: (
        isinstance(value, dict)
        and _is_text(value.get("reason"))
        and (value.get("checkpoint") is None or _is_text(value["checkpoint"]))
    ),
}


class RunNotFound(Exception):
    """No run directory by that name or path."""


def find_run(run: str) -> Path:
    """A local run directory from a path, or a run name under the default storage path."""
    if on_remote_storage(run):
        raise RunNotFound(
            f"{run} is on remote storage; this command needs a run folder of this machine. The driver that ran "
            f"it keeps a working copy under {_env.cache_dir()}/runs/."
        )
    path = Path(run.removeprefix("file://")).expanduser()
    if RunLayout(path).run_json.is_file():
        return path.resolve()
    candidate = Path(_env.default_storage_path(), run).expanduser()
    if RunLayout(candidate).run_json.is_file():
        return candidate.resolve()
    where = f"{path} is not" if candidate == path else f"neither {path} nor {candidate} is"
    message = f"no run {run!r}: {where} a ddptrain run directory (no {RunLayout.RUN_JSON})"
    if _holds_runs(path):
        message += f". {path} is a storage path that holds runs: list them with `ddptrain runs {run}`"
    raise RunNotFound(message)


def _holds_runs(folder: Path) -> bool:
    """Whether ``folder`` is a storage path: a folder with run directories in it."""
    try:
        return any(RunLayout(entry).run_json.is_file() for entry in folder.iterdir() if entry.is_dir())
    except OSError:
        return False


@dataclass(frozen=True)
class RunView:
    """A run, as the inspection commands read it.

    Attributes:
        folder: A folder of this machine with the run's files: the run directory itself, or
            a private copy of the small files of a run on remote storage.
        shown: The run as users name it: its path, or its URI.
        remote: The storage root a run on remote storage is under (``None``: a local run).
        run_path: The run's folder on ``remote`` (default: ``name`` under its root).
    """

    folder: Path
    shown: str
    remote: RemoteRoot | None = None
    run_path: str | None = None

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.folder)

    def shown_path(self, path: Path) -> str:
        """A file of the run (a path below ``folder``) as users know it."""
        return str(path) if self.remote is None else f"{self.shown}/{path.relative_to(self.folder).as_posix()}"

    def checkpoints(self) -> CheckpointManager:
        """The run's committed checkpoints (on the store, for a run on remote storage).

        Raises:
            RunDirectoryError: The checkpoint index cannot be read.
        """
        if self.remote is None:
            return CheckpointManager.from_run_dir(str(self.folder))
        return RemoteCheckpointManager.from_copy(str(self.folder), self.remote, self._remote_path())

    def _remote_path(self, *parts: str) -> str:
        assert self.remote is not None
        return posixpath.join(self.remote.path(self.name) if self.run_path is None else self.run_path, *parts)

    def info(self) -> tuple[dict[str, Any], list[str]]:
        """The fields of the run's ``run.json`` that are sound (of the types ddptrain writes
        there), and what is wrong with it (a missing ``run.json``, one that is not JSON...)."""
        shown = self.shown_path(self.layout.run_json)
        try:
            info = run_files.read_json(self.folder, RunLayout.RUN_JSON)
        except run_files.RunFileError as exc:
            return {}, [str(exc).replace(str(self.layout.run_json), shown)]
        if not isinstance(info, dict):
            what = "is missing" if info is None else f"holds a JSON {type(info).__name__}, not an object"
            return {}, [f"{shown} {what}"]
        bad = [key for key, sound in _FIELDS.items() if info.get(key) is not None and not sound(info[key])]
        checked = {key: info[key] for key in _FIELDS if info.get(key) is not None and key not in bad}
        problems = [f"{shown}: " + ", ".join(f"`{key}` is {str(info[key])[:60]!r}" for key in bad)] if bad else []
        return checked, problems

    def metric_lines(self) -> Iterator[dict[str, Any]]:
        """Every report, ``{"time", "attempt", "metrics"}``, oldest first, read as it goes (a
        line cut short by a crash is skipped).

        Raises:
            RunFileError: ``metrics.jsonl`` cannot be read (a link, a FIFO...).
        """
        return run_metrics.iter_metric_lines(self.folder)

    def metrics_summary(self) -> MetricsSummary:
        """The reports' summary (see :func:`ddptrain.storage.metrics.read_metrics_summary`).

        Raises:
            RunFileError: ``metrics.jsonl`` cannot be read.
        """
        return run_metrics.read_metrics_summary(self.folder)

    def metrics_tail(self, count: int) -> tuple[list[dict[str, Any]], MetricsSummary]:
        """The last ``count`` reports and the summary they end (see
        :func:`ddptrain.storage.metrics.read_metrics_tail`).

        Raises:
            RunFileError: ``metrics.jsonl`` cannot be read.
        """
        return run_metrics.read_metrics_tail(self.folder, count)

    def metrics_after(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        """The reports of the complete lines from byte ``offset``, and the offset after them
        (see :func:`ddptrain.storage.metrics.read_metrics_after`).

        Raises:
            ValueError: ``offset`` is not the end of a line of the file.
            RunFileError: ``metrics.jsonl`` cannot be read.
        """
        return run_metrics.read_metrics_after(self.folder, offset)

    def driver_alive(self, info: dict[str, Any]) -> bool | None:
        """Whether a live driver holds the run (``info``: its ``run.json``). For a run on remote
        storage that is known only on the host its driver ran on, where the driver's working
        copy is; ``None`` elsewhere."""
        if self.remote is None:
            return driver_is_alive(self.folder)
        if driver_is_alive(Path(self.remote.cache_dir(self.name))):
            return True
        return False if info.get("host") == socket.gethostname() else None

    def attempts(self) -> list[int]:
        """The numbers of the attempts that left logs, in order.

        Raises:
            RunFileError: ``logs`` is not a folder of the run (a link, a file).
        """
        if self.remote is None:
            return RunLayout.attempt_numbers(run_files.list_folder(self.folder, RunLayout.LOGS))
        return RunLayout.attempt_numbers(self.remote.list_names(self._remote_path(RunLayout.LOGS)))

    def _log_name(self, attempt: int, rank: int | None = None) -> str:
        """An attempt's log folder, or a rank's log file in it (relative, posix)."""
        folder = RunLayout.attempt_logs_name(attempt)
        return folder if rank is None else f"{folder}/{RunLayout.rank_log_name(rank)}"

    def log_ranks(self, attempt: int) -> list[int]:
        """The ranks that left a log in ``attempt``, in order.

        Raises:
            RunFileError: The attempt's log folder is not a folder of the run.
        """
        if self.remote is None:
            return RunLayout.log_ranks(run_files.list_folder(self.folder, self._log_name(attempt)))
        return RunLayout.log_ranks(self.remote.list_names(self._remote_path(self._log_name(attempt))))

    def open_log(self, attempt: int, rank: int) -> IO[bytes] | None:
        """A rank's log of an attempt, open for reading (downloaded first for a run on remote
        storage), or ``None`` when there is none.

        Raises:
            RunFileError: It is not a regular file of the run (a link, a FIFO...).
        """
        name = self._log_name(attempt, rank)
        if self.remote is not None:
            data = self.remote.read_bytes(self._remote_path(name))
            if data is None:
                return None
            path = self.folder / name
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            storage.write_atomic(path, data, private=True)
        return run_files.open_file(self.folder, name)


def _pull(root: RemoteRoot, name: str) -> RunView | None:
    """Run ``name`` under ``root``, its small files pulled; ``None`` when it is not a run."""
    folder = root.cache_dir(name, purpose="read")
    if not root.pull_run(root.path(name), folder):
        return None
    return RunView(Path(folder), root.shown(root.path(name)), root)


def _open_remote(uri: str) -> RunView:
    base, _, query = uri.partition("?")  # URI options (`?endpoint_override=...`) are the file system's
    scheme, _, rest = base.partition("://")
    parent, _, name = rest.rstrip("/").rpartition("/")
    if not parent or not name:
        raise RunNotFound(f"no run {uri!r}: give a run's URI, such as {scheme}://bucket/prefix/name")
    root = resolve(f"{scheme}://{parent}" + (f"?{query}" if query else ""))
    if root is None:  # a scheme fsspec serves from the local file system
        return RunView(find_run(uri), uri)
    view = _pull(root, name)
    if view is None:
        raise RunNotFound(f"no run {uri!r}: {uri} is not a ddptrain run (it has no {RunLayout.RUN_JSON})")
    return view


def open_run(run: str) -> RunView:
    """A run from its path or URI, or from its name under the default storage path (which may
    be a URI itself).

    Raises:
        RunNotFound: There is no such run; says where it was looked for.
        ConfigError: The URI's file system is not installed (names the extra to install).
    """
    if on_remote_storage(run):
        return _open_remote(run)
    default = _env.default_storage_path()
    if on_remote_storage(default) and not RunLayout(Path(run).expanduser()).run_json.is_file():
        base, _, query = default.partition("?")
        return _open_remote(f"{base.rstrip('/')}/{run}" + (f"?{query}" if query else ""))
    folder = find_run(run)
    return RunView(folder, str(folder))


def list_views(storage_path: str) -> list[RunView]:
    """Every run directly under ``storage_path``, a local folder or a URI (a link to a folder
    elsewhere is not one of its runs)."""
    if on_remote_storage(storage_path):
        root = resolve(storage_path)
        if root is not None:
            views = [_pull(root, name) for name in root.list_names(root.root)]
            return [view for view in views if view is not None]
    folder = Path(storage_path.removeprefix("file://")).expanduser().resolve()
    if not folder.is_dir():
        return []
    return [RunView(p, str(p)) for p in sorted(folder.iterdir()) if run_files.is_run(p)]


@dataclass
class RunRecord:
    """A run as :func:`read_run` read it: plain data, of the types ddptrain writes, whatever
    the run's files hold.

    Attributes:
        view: The run that was read.
        info: The fields of ``run.json`` that are sound (see :meth:`RunView.info`).
        status: One of :data:`STATUSES`: what ``run.json`` says (FINISHED when it has ended
            but no status, RUNNING otherwise), ABORTED when it says RUNNING or RESTARTING but
            no live driver holds the run any more.
        metrics: The summary of its reports (empty when ``metrics.jsonl`` cannot be read).
        checkpoints: Each kept checkpoint's path and metrics (validated ones merged in), in the
            index's order.
        checkpoint_status: Each kept checkpoint's path and status (``COMMITTED``,
            ``PENDING_VALIDATION``, ``VALIDATED``).
        best_checkpoint: The best kept checkpoint's path (by the score attribute).
        latest_checkpoint: The latest committed checkpoint's path.
        score_attribute: The metric checkpoints are scored by.
        problems: What could not be read (the rest is read as usual).
    """

    view: RunView
    info: dict[str, Any]
    status: str
    metrics: MetricsSummary
    checkpoints: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    checkpoint_status: dict[str, str] = field(default_factory=dict)
    best_checkpoint: str | None = None
    latest_checkpoint: str | None = None
    score_attribute: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def started(self) -> float | None:
        started: float | None = self.info.get("started")
        return started

    @property
    def duration_s(self) -> float | None:
        """From the start to the end (to now while it runs; to its last report when it has no
        end)."""
        ended = self.info.get("ended") or (time.time() if self.status in ("RUNNING", "RESTARTING") else None)
        if ended is None and self.metrics.last:
            ended = self.metrics.last["time"]
        started = self.started
        return (ended - started) if started and ended else None


def read_run(view: RunView) -> RunRecord:
    """Read ``view``'s run: ``run.json``, the summary of its reports, its checkpoint index.

    Never raises for what the run's files hold: what cannot be read is in ``problems``.
    Reading it does not grow with its reports (see
    :func:`ddptrain.storage.metrics.read_metrics_summary`): for a long run of an older
    ddptrain, ``metrics.stats`` (each metric's last, min, max) is ``None``.
    """
    info, problems = view.info()
    status = info.get("status", "FINISHED" if info.get("ended") else "RUNNING")
    if status in ("RUNNING", "RESTARTING") and view.driver_alive(info) is False:
        status = "ABORTED"  # its driver died without a word
    try:
        metrics = view.metrics_summary()
    except run_files.RunFileError as exc:
        metrics = MetricsSummary(stats=None)
        problems.append(str(exc))
    if metrics.foreign:
        problems.append(f"{view.shown_path(view.layout.metrics)}: {metrics.foreign} line(s) are not reports (skipped)")
    record = RunRecord(view, info, status, metrics, problems=problems)
    try:
        manager = view.checkpoints()
        record.checkpoints = [(c.path, m) for c, m in manager.reported_checkpoints()]
        record.checkpoint_status = manager.statuses()
        ranked = manager.best_checkpoints()
        record.best_checkpoint = ranked[-1][0].path if ranked else None
        record.latest_checkpoint = manager.latest.path if manager.latest else None
        record.score_attribute = manager.config.checkpoint_score_attribute
    except Exception as exc:  # an unreadable index: say so, show the rest
        problems.append(str(exc))
    return record


def read_metric_lines(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every line of ``run_dir/metrics.jsonl`` (``{"time", "attempt", "metrics"}``), oldest first.

    A line cut short by a crash is skipped.

    Raises:
        RunFileError: ``metrics.jsonl`` is not a regular file of the run folder (a link, a FIFO...).
    """
    return list(run_metrics.iter_metric_lines(run_dir))


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rank 0's metrics of every report in ``run_dir/metrics.jsonl``, oldest first.

    A line cut short by a crash is skipped.
    """
    return [line["metrics"] for line in read_metric_lines(run_dir)]


@contextmanager
def open_result_run(path: str, storage_filesystem: Any = None) -> Iterator[RunView]:
    """The run at ``path`` (a local path, a URI, or a path on ``storage_filesystem``), for
    ``Result.from_path``: a run on remote storage is read from its small files pulled into a
    temporary folder, removed on the way out.

    Raises:
        RuntimeError: ``path`` is not a ddptrain run directory.
    """
    root = resolve(path, storage_filesystem)
    if root is None:
        run_dir = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
        if not RunLayout(run_dir).run_json.exists():
            hint = ""
            if _holds_runs(Path(run_dir)):
                hint = f" It holds runs: give one of them, e.g. {os.path.join(run_dir, '<run name>')}."
            raise RuntimeError(f"{run_dir} is not a ddptrain run directory (it has no {RunLayout.RUN_JSON}).{hint}")
        yield RunView(Path(run_dir), run_dir)
        return
    with tempfile.TemporaryDirectory(prefix="ddptrain_result_") as local:
        if not root.pull_run(root.root, local):
            raise RuntimeError(f"{root.display()} is not a ddptrain run directory (it has no {RunLayout.RUN_JSON}).")
        yield RunView(Path(local), root.display(), root, root.root)
