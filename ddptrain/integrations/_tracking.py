"""What the tracking helpers share: the no-op stand-in, where they are called from, and the
tracking run ids remembered in the run directory so that a restarted or resumed ddptrain run
logs on into the same MLflow / W&B run instead of starting another one."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ddptrain.context import ContextError, get_context
from ddptrain.storage.layout import RunLayout, write_json_atomic

__all__ = ["NoOp", "Caller", "caller", "flatten", "load_id", "missing", "noop_if_installed", "save_id"]

_logger = logging.getLogger(__name__)


class NoOp:
    """What ranks other than 0 get: every attribute is another no-op and every call accepts
    anything, does nothing and returns a no-op (so ``with mlflow.start_run() as run:`` and
    ``run.summary["x"] = 1`` work too)."""

    def __getattr__(self, name: str) -> NoOp:
        if name.startswith("__"):  # keeps pickle, copy and introspection honest
            raise AttributeError(name)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> NoOp:
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        pass

    def __getitem__(self, key: Any) -> NoOp:
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __enter__(self) -> NoOp:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __repr__(self) -> str:
        return "NoOp()"


@dataclass(frozen=True)
class Caller:
    """Where a helper was called: ``rank`` is ``None`` outside a training function."""

    rank: int | None
    run_name: str | None
    run_dir: str | None


def caller() -> Caller:
    """This worker's rank, run name and run directory (all ``None`` outside a training function)."""
    try:
        ctx = get_context()
    except ContextError:
        return Caller(None, None, None)
    try:
        run_dir: str | None = ctx.get_storage().experiment_fs_path
    except NotImplementedError:  # local mode has no run storage
        run_dir = None
    return Caller(ctx.get_world_rank(), ctx.get_experiment_name(), run_dir)


def missing(library: str, package: str) -> ImportError:
    """The error for a tracking library that is not installed."""
    return ImportError(
        f"ddptrain.integrations.{library} needs {package}, which is not installed: "
        f"`pip install ddptrain[{library}]` (or `pip install {package}`)."
    )


def noop_if_installed(library: str, package: str) -> NoOp:
    """The no-op for a rank that does not log: the library must be installed (the same
    ImportError on every rank), but is not imported (seconds of start-up for nothing)."""
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise missing(library, package)
    return NoOp()


def flatten(config: Mapping[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level with ``/``-joined keys: ``{"a": {"b": 1}}`` → ``{"a/b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in (config or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "/"))
        else:
            flat[name] = value
    return flat


def _id_file(where: Caller, library: str) -> str | None:
    # Only where the run directory is there already: a host that cannot see the driver's
    # storage must not grow a stray copy of its path.
    if where.run_dir is None or where.rank is None or not os.path.isdir(where.run_dir):
        return None
    return str(RunLayout(where.run_dir).tracking_file(library, where.rank))


def load_id(where: Caller, library: str) -> dict[str, Any] | None:
    """What :func:`save_id` remembered for this rank of this run, or ``None``."""
    path = _id_file(where, library)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save_id(where: Caller, library: str, data: dict[str, Any]) -> None:
    """Remember this rank's tracking run in the run directory (best effort: a failure is logged)."""
    path = _id_file(where, library)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json_atomic(path, data)
    except OSError as exc:
        _logger.warning("ddptrain: could not remember the %s run in %s (%s)", library, path, exc)
