"""The one place that reads ``DDPTRAIN_*`` environment variables (driver and workers)."""

from __future__ import annotations

import os

__all__ = [
    "default_storage_path",
    "report_warn_interval_s",
    "shutdown_grace_s",
    "store_connect_timeout_s",
    "worker_start_timeout_s",
    "in_worker",
    "loading_training_function",
    "console_ranks",
    "WORKER_MARKER",
]

# Set in every worker process, so that the library can tell it runs inside a worker.
WORKER_MARKER = "DDPTRAIN_WORKER"


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"`{name}` must be a number of seconds, got {raw!r}.") from None
    if value < 0:
        raise ValueError(f"`{name}` must be >= 0, got {raw!r}.")
    return value


def default_storage_path() -> str:
    """Where runs go when ``RunConfig.storage_path`` is not set."""
    return os.path.expanduser(os.environ.get("DDPTRAIN_STORAGE_PATH") or "~/ddptrain_results")


def report_warn_interval_s() -> float:
    """Seconds a rank may lag behind the others at a ``report()`` before it is named in a warning."""
    return _float("DDPTRAIN_REPORT_WARN_INTERVAL_S", 5.0)


def shutdown_grace_s() -> float:
    """Seconds workers get between SIGTERM and SIGKILL when the group is torn down."""
    return _float("DDPTRAIN_SHUTDOWN_GRACE_S", 3.0)


def store_connect_timeout_s() -> float:
    """Seconds a worker waits to connect to the driver's store."""
    return _float("DDPTRAIN_STORE_CONNECT_TIMEOUT_S", 60.0)


def worker_start_timeout_s() -> float:
    """Seconds the driver waits for every worker to come up before it gives up."""
    return _float("DDPTRAIN_WORKER_START_TIMEOUT_S", 120.0)


def in_worker() -> bool:
    """Whether this process is a ddptrain worker (or its agent)."""
    return os.environ.get(WORKER_MARKER) == "1"


def loading_training_function() -> bool:
    """Whether this process is unpickling a training function (an agent, before forking)."""
    return os.environ.get("DDPTRAIN_UNPICKLING") == "1"


def console_ranks() -> set[int] | None:
    """Ranks whose output is echoed to the driver's console (``None``: all), from
    ``DDPTRAIN_CONSOLE_RANKS`` such as ``"0"`` or ``"0,3"``."""
    raw = os.environ.get("DDPTRAIN_CONSOLE_RANKS", "").strip()
    if raw in ("", "all"):
        return None
    try:
        return {int(part) for part in raw.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"`DDPTRAIN_CONSOLE_RANKS` must be 'all' or comma-separated ranks, got {raw!r}.") from None
