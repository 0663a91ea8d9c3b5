"""Warm worker groups handed from one ``fit()`` to the next, inside :func:`reuse_workers`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module stays light: `import ddptrain` imports it
    from ddptrain.driver.plan import Plan
    from ddptrain.driver.worker_group import WorkerGroup

__all__ = ["keeps_warm", "put_warm", "reuse_workers", "take_warm"]

_lock = threading.Lock()  # fits in several threads (a sweep's trials) share the pool
_warm: list[WorkerGroup] | None = None  # None: fits do not keep their workers


@contextlib.contextmanager
def reuse_workers() -> Iterator[None]:
    """Let the ``fit()`` calls inside keep their worker processes for the next one.

    A ``fit()`` whose plan (scaling config, worker environment, ``sys.path``, working
    directory) matches a finished one's starts on its warm workers instead of new processes:
    no interpreter start, no torch import. What the workers' earlier functions left behind
    (module globals, threads, environment changes, CUDA caches) stays with them; that is why
    this is opt-in. A failed ``fit()`` never hands on its workers. Only single-machine groups
    are kept; every worker is stopped when the block ends. Nested blocks share the outer one.

    Example:
        >>> with ddptrain.reuse_workers():          # doctest: +SKIP
        ...     for lr in (0.1, 0.01):
        ...         TorchTrainer(train_func, train_loop_config={"lr": lr}, ...).fit()
    """
    global _warm
    with _lock:
        if _warm is not None:
            outer = True
        else:
            outer = False
            _warm = []
    if outer:
        yield
        return
    try:
        yield
    finally:
        with _lock:
            groups, _warm = _warm or [], None
        for group in groups:
            group.stop_workers()
            group.shutdown()


def take_warm(plan: Plan) -> WorkerGroup | None:
    """A warm group that can run ``plan``, taken out of the pool (``None``: none)."""
    key = plan.reuse_key()
    dead = []
    found = None
    with _lock:
        for group in list(_warm or []):
            if not group.alive:
                _warm.remove(group)  # type: ignore[union-attr]
                dead.append(group)
            elif group.plan.reuse_key() == key:
                _warm.remove(group)  # type: ignore[union-attr]
                found = group
                break
    for group in dead:
        group.shutdown()
    return found


def keeps_warm(plan: Plan) -> bool:
    """Whether a group of ``plan`` that finishes its run is kept for the next ``fit()``."""
    return _warm is not None and plan.placement is None


def put_warm(group: WorkerGroup) -> bool:
    """Keep a group whose run finished for the next ``fit()``; ``False`` when the
    ``reuse_workers()`` block has ended meanwhile (the caller then shuts it down)."""
    with _lock:
        if _warm is None:
            return False
        _warm.append(group)
    return True
