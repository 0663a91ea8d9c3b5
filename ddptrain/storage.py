"""The run directory on disk: staging and atomic commit of checkpoints, metrics, config.

Layout of ``<storage_path>/<name>/``::

    run.json                 the run's config summary
    metrics.jsonl            one line per report (rank 0's metrics)
    checkpoints.json         committed checkpoints, replaced atomically
    checkpoint_000003/       committed checkpoints (renamed into place when complete)
    logs/attempt_0/rank_0.log
    .staging/                per-rank checkpoint files waiting to be committed
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

__all__ = [
    "stage_files",
    "commit_checkpoint",
    "clean_leftovers",
    "check_dir_name",
    "safe_child",
    "write_json_atomic",
    "to_jsonable",
]

STAGING = ".staging"
# Files and folders of the run directory that a checkpoint may never be named after.
RESERVED_NAMES = frozenset({"run.json", "trainer.pkl", "metrics.jsonl", "checkpoints.json", "logs"})
_DIR_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")


def check_dir_name(name: str) -> None:
    """Refuse checkpoint folder names that are not plain names, or that name run files."""
    if not isinstance(name, str) or not _DIR_NAME.match(name) or name in (".", ".."):
        raise ValueError(
            f"`checkpoint_dir_name` must be a plain folder name (letters, digits, '._=+-', no '/'), got {name!r}."
        )
    if name in RESERVED_NAMES:
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


def stage_files(run_dir: str, source: str, attempt: int, report_index: int, rank: int) -> str:
    """Copy one rank's checkpoint files into the staging area; returns the staged folder."""
    if not os.path.isdir(source):
        raise FileNotFoundError(f"Checkpoint directory {source!r} does not exist.")
    target = Path(run_dir, STAGING, f"a{attempt}_r{report_index}", f"rank_{rank}")
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
    shutil.copytree(source, partial)
    os.rename(partial, target)
    return str(target)


def commit_checkpoint(run_dir: str, staged: list[str], name: str) -> str:
    """Merge staged folders into ``run_dir/name`` and rename it into place.

    Files of earlier entries of ``staged`` win over later ones with the same relative path.
    """
    final = safe_child(run_dir, name)
    building = final.with_name(f".{final.name}.{uuid.uuid4().hex}.partial")
    building.mkdir(parents=True)
    for folder in reversed(staged):
        for src_root, _dirs, files in os.walk(folder):
            rel = os.path.relpath(src_root, folder)
            dest_root = building / rel
            dest_root.mkdir(parents=True, exist_ok=True)
            for file in files:
                os.replace(os.path.join(src_root, file), dest_root / file)
    if final.exists():
        old = final.with_name(f".{final.name}.{uuid.uuid4().hex}.old")
        os.rename(final, old)
        os.rename(building, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(building, final)
    for folder in staged:
        shutil.rmtree(folder, ignore_errors=True)
        for parent in (Path(folder).parent, Path(folder).parent.parent):
            try:
                parent.rmdir()  # only once empty: another report may be staging next to it
            except OSError:
                break
    return str(final)


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


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON to a temporary file and rename it over ``path``.

    Readers see the old or the new file, whole, whatever process dies when. There is no
    fsync: on ext4 it would also force out every checkpoint byte written just before (about
    200 MB/s here), and a process crash, which is what this guards against, needs none.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def clean_leftovers(run_dir: str) -> None:
    """Undo or remove what an interrupted commit left; committed checkpoints are never lost.

    A checkpoint being replaced under its own name is moved aside as ``.<name>.<id>.old``
    until its successor is renamed into place: if the successor never arrived, the old one
    is moved back. Staged files and half-built checkpoints are removed.
    """
    root = Path(run_dir)
    if not root.is_dir():
        return
    shutil.rmtree(root / STAGING, ignore_errors=True)
    for entry in root.iterdir():
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
