"""The run directory on disk: its layout, staging and atomic commit of checkpoints, metrics, config.

Layout of ``<storage_path>/<name>/`` (:class:`RunLayout` is the one place these names are
spelled)::

    run.json                 the run's config summary and status
    trainer.pkl              the pickled trainer, for ``restore()``
    metrics.jsonl            one line per report (rank 0's metrics)
    metrics_summary.json     what readers need of metrics.jsonl without reading it all (run_metrics)
    checkpoints.json         committed checkpoints, replaced atomically
    checkpoint_000003/       committed checkpoints (renamed into place when complete)
    .commit.json             the checkpoint being committed, while it is (see checkpoint_manager)
    logs/attempt_0/rank_0.log
    .staging/                per-rank checkpoint files waiting to be committed
    tracking/                MLflow / W&B run ids of each rank, to log on into them on resume
    .stack-request           ``ddptrain stack`` asking the live driver (``.stack-states.json``: its answer)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddptrain.errors import disk_full_error

__all__ = [
    "RunLayout",
    "write_atomic",
    "stage_files",
    "build_checkpoint",
    "move_into_place",
    "remove_staged",
    "clean_leftovers",
    "check_dir_name",
    "safe_child",
    "write_json_atomic",
    "to_jsonable",
    "naming_full_disk",
]


class RunLayout:
    """Where each of a run directory's own files is.

    The class attributes are names relative to the run directory, in posix form, so they are
    also the keys below a run's folder on remote storage. An instance joins them to one run
    directory of this machine. The names never change: runs written by earlier versions must
    still load. Every other entry of a run directory is a checkpoint folder.
    """

    RUN_JSON = "run.json"
    TRAINER = "trainer.pkl"
    METRICS = "metrics.jsonl"
    METRICS_SUMMARY = "metrics_summary.json"
    INDEX = "checkpoints.json"
    INTENT = ".commit.json"
    LOGS = "logs"
    STAGING = ".staging"
    TRACKING = "tracking"
    STACK_REQUEST = ".stack-request"
    STACK_STATES = ".stack-states.json"
    # What a reader of a run (``Result.from_path``, ``ddptrain show``...) copies from remote
    # storage; a folder without RUN_JSON is not a run.
    SMALL_FILES = (RUN_JSON, METRICS, INDEX)
    # Names a checkpoint folder may never take.
    RESERVED = frozenset({RUN_JSON, TRAINER, METRICS, METRICS_SUMMARY, INDEX, LOGS})

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.root = Path(run_dir)

    @property
    def run_json(self) -> Path:
        return self.root / self.RUN_JSON

    @property
    def trainer(self) -> Path:
        return self.root / self.TRAINER

    @property
    def metrics(self) -> Path:
        return self.root / self.METRICS

    @property
    def metrics_summary(self) -> Path:
        return self.root / self.METRICS_SUMMARY

    @property
    def index(self) -> Path:
        return self.root / self.INDEX

    @property
    def intent(self) -> Path:
        return self.root / self.INTENT

    @property
    def logs(self) -> Path:
        return self.root / self.LOGS

    @property
    def staging(self) -> Path:
        return self.root / self.STAGING

    @property
    def stack_request(self) -> Path:
        return self.root / self.STACK_REQUEST

    @property
    def stack_states(self) -> Path:
        return self.root / self.STACK_STATES

    def checkpoint(self, name: str) -> Path:
        """The folder of checkpoint ``name`` (checked names only: see :func:`safe_child`)."""
        return self.root / name

    @staticmethod
    def attempt_number(name: str) -> int | None:
        """The attempt an entry of ``logs/`` holds the logs of (``None``: not an attempt's)."""
        number = name.removeprefix("attempt_")
        return int(number) if name.startswith("attempt_") and number.isdigit() else None

    @classmethod
    def attempt_logs_name(cls, attempt: int) -> str:
        """An attempt's log folder (relative, posix)."""
        return f"{cls.LOGS}/attempt_{attempt}"

    def attempt_logs(self, attempt: int) -> Path:
        return self.root / self.attempt_logs_name(attempt)

    @staticmethod
    def rank_log_name(rank: int) -> str:
        """The name of a rank's log file in its attempt's folder."""
        return f"rank_{rank}.log"

    def rank_log(self, attempt: int, rank: int) -> Path:
        return self.attempt_logs(attempt) / self.rank_log_name(rank)

    @staticmethod
    def log_ranks(names: list[str]) -> list[int]:
        """The ranks whose log files entries ``names`` of an attempt's folder are, in order."""
        ranks = ((name, name.removeprefix("rank_").removesuffix(".log")) for name in names)
        return sorted(int(r) for name, r in ranks if r.isdigit() and name == RunLayout.rank_log_name(int(r)))

    def rank_logs(self, attempt: int) -> dict[int, Path]:
        """The log files of an attempt, by rank, in rank order."""
        folder = self.attempt_logs(attempt)
        names = [entry.name for entry in folder.iterdir()] if folder.is_dir() else []
        return {rank: self.rank_log(attempt, rank) for rank in self.log_ranks(names)}

    @classmethod
    def attempt_numbers(cls, names: list[str]) -> list[int]:
        """The attempts that entries ``names`` of ``logs/`` hold the logs of, in order."""
        return sorted(n for n in map(cls.attempt_number, names) if n is not None)

    def attempts(self) -> list[int]:
        """The numbers of the attempts that have a log folder, in order (``[]`` without logs)."""
        return self.attempt_numbers([entry.name for entry in self.logs.iterdir()] if self.logs.is_dir() else [])

    @classmethod
    def staged_name(cls, attempt: int, report_index: int, rank: int) -> str:
        """Where a rank's files of one report wait to be committed (relative, posix)."""
        return f"{cls.STAGING}/a{attempt}_r{report_index}/rank_{rank}"

    def staged(self, attempt: int, report_index: int, rank: int) -> Path:
        return self.root / self.staged_name(attempt, report_index, rank)

    def fetched(self, attempt: int, report_index: int, rank: int) -> Path:
        """Where a rank's staged files are copied back to from a host that cannot see the run
        directory (staging too: a failed attempt's leftovers go with it)."""
        return self.staging / f"fetched_a{attempt}_r{report_index}" / f"rank_{rank}"

    def tracking_file(self, library: str, rank: int) -> Path:
        """Where a rank remembers its MLflow / W&B run, to log on into it after a resume."""
        return self.root / self.TRACKING / f"{library}_rank_{rank}.json"


_DIR_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")


def check_dir_name(name: str) -> None:
    """Refuse checkpoint folder names that are not plain names, or that name run files."""
    if not isinstance(name, str) or not _DIR_NAME.match(name) or name in (".", ".."):
        raise ValueError(
            f"`checkpoint_dir_name` must be a plain folder name (letters, digits, '._=+-', no '/'), got {name!r}."
        )
    if name in RunLayout.RESERVED:
        raise ValueError(
            f"`checkpoint_dir_name` {name!r} is the name of one of the run's own files; choose another name."
        )


def safe_child(run_dir: str, name: str) -> Path:
    """``run_dir/name``, refusing names that would land outside ``run_dir`` or on its own files."""
    check_dir_name(name)
    root = Path(run_dir).resolve()
    target = (root / name).resolve()
    if target.parent != root:
        raise ValueError(f"Checkpoint folder name {name!r} would escape the run directory {run_dir}.")
    return target


@contextlib.contextmanager
def naming_full_disk(path: str | Path) -> Iterator[None]:
    """Turn a full file system met while writing ``path`` into a
    :class:`~ddptrain.errors.DiskFullError` that names it and the space left there."""
    try:
        yield
    except OSError as exc:
        error = disk_full_error(exc, path)
        if error is None or error is exc:
            raise
        raise error from exc


def not_a_folder(path: str) -> OSError:
    """The error for a reported checkpoint at ``path`` that is not a folder."""
    if os.path.exists(path):
        return NotADirectoryError(
            f"Checkpoint {path!r} is a file, not a folder: a checkpoint is a folder of files. Write the file into "
            "a new folder (`tempfile.mkdtemp()`) and pass `Checkpoint.from_directory(folder)`."
        )
    return FileNotFoundError(f"Checkpoint directory {path!r} does not exist.")


def stage_files(run_dir: str, source: str, attempt: int, report_index: int, rank: int, move: bool = False) -> str:
    """Copy one rank's checkpoint files into the staging area; returns the staged folder.
    ``move``: the caller gives ``source`` up, so it is renamed instead when it is on the same
    file system (no bytes copied).

    Raises:
        DiskFullError: The run directory's file system is full; nothing staged is left.
    """
    if not os.path.isdir(source):
        raise not_a_folder(source)
    target = RunLayout(run_dir).staged(attempt, report_index, rank)
    if target.exists():
        shutil.rmtree(target)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
    if move:
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(source, target)
            return str(target)
        except OSError:  # another file system (or a mount point): copy
            pass
    try:
        with naming_full_disk(target):  # measures the free space before the cleanup below
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(source, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # give the space back at once
        raise
    os.rename(partial, target)
    return str(target)


def build_checkpoint(run_dir: str, staged: list[str], name: str) -> Path:
    """Merge staged folders into a hidden ``.<name>.<id>.partial`` folder of ``run_dir``.

    Files of earlier entries of ``staged`` win over later ones with the same relative path.
    Files are moved, not copied; the staged folders are left empty.
    """
    final = safe_child(run_dir, name)
    building = final.with_name(f".{final.name}.{uuid.uuid4().hex}.partial")
    with naming_full_disk(building):
        building.mkdir(parents=True)
        for folder in reversed(staged):
            for src_root, _dirs, files in os.walk(folder):
                rel = os.path.relpath(src_root, folder)
                dest_root = building / rel
                dest_root.mkdir(parents=True, exist_ok=True)
                for file in files:
                    os.replace(os.path.join(src_root, file), dest_root / file)
    return building


def move_into_place(building: Path, final: Path) -> None:
    """Rename a built checkpoint to its final name, replacing a folder of that name.

    The folder being replaced is moved aside as ``.<name>.<id>.old`` first; if the rename
    fails, it is moved back. After a crash, :func:`clean_leftovers` does the same.
    """
    if not final.exists():
        os.rename(building, final)
        return
    old = final.with_name(f".{final.name}.{uuid.uuid4().hex}.old")
    os.rename(final, old)
    try:
        os.rename(building, final)
    except BaseException:
        os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def remove_staged(staged: list[str]) -> None:
    """Remove staged folders, and their parents once empty."""
    for folder in staged:
        shutil.rmtree(folder, ignore_errors=True)
        for parent in (Path(folder).parent, Path(folder).parent.parent):
            try:
                parent.rmdir()  # only once empty: another report may be staging next to it
            except OSError:
                break


def to_jsonable(value: Any) -> Any:
    """A JSON-friendly copy of a metrics value (numpy scalars become numbers, others text)."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return to_jsonable(item())
        except (TypeError, ValueError):
            pass
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return to_jsonable(tolist())
    return repr(value)


def write_atomic(path: str | Path, data: bytes, *, private: bool = False) -> None:
    """Write ``data`` to a temporary file and rename it over ``path``.

    Readers see the old or the new file, whole, whatever process dies when. There is no
    fsync: on ext4 it would also force out every checkpoint byte written just before (about
    200 MB/s here), and a process crash, which is what this guards against, needs none.
    ``private`` files are created 0600 (never readable by others, not even for a moment).
    On a full file system it raises :class:`~ddptrain.errors.DiskFullError` naming ``path``,
    and ``path`` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with naming_full_disk(path):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def write_json_atomic(path: str | Path, data: Any, *, private: bool = False) -> None:
    """Write JSON atomically (see :func:`write_atomic`)."""
    write_atomic(path, json.dumps(data, indent=1).encode(), private=private)


def clean_leftovers(run_dir: str) -> None:
    """Undo or remove what an interrupted commit left; committed checkpoints are never lost.

    A checkpoint being replaced under its own name is moved aside as ``.<name>.<id>.old``
    until its successor is renamed into place: if the successor never arrived, the old one
    is moved back. Staged files, half-built checkpoints and half-written JSON files
    (``.<name>.<id>.tmp``) are removed.
    """
    root = Path(run_dir)
    if not root.is_dir():
        return
    shutil.rmtree(RunLayout(root).staging, ignore_errors=True)
    for entry in root.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(".tmp") and entry.is_file():
            entry.unlink(missing_ok=True)
        if not (entry.name.startswith(".") and entry.is_dir()):
            continue
        if entry.name.endswith(".old"):
            original = root / entry.name[1:].rsplit(".", 2)[0]
            if not original.exists():
                os.rename(entry, original)
                continue
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.endswith(".partial"):
            shutil.rmtree(entry, ignore_errors=True)
