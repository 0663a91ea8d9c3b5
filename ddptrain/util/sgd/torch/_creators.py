"""RaySGD's older creator functions (``model_creator``, ``optimizer_creator``, ...) turned into a
``TrainingOperator`` subclass, behind ``TrainingOperator.from_creators``.

It also owns the machine-wide file lock under which ``data_creator`` runs, so that the workers
of one machine do not download a data set to the same path at once.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from filelock import FileLock

from ddptrain.errors import ConfigError
from ddptrain.storage.ownership import private_temp_dir

if TYPE_CHECKING:
    from ddptrain.util.sgd.torch.training_operator import TrainingOperator

__all__: list[str] = []


def operator_from_creators(
    base: type[TrainingOperator],
    model_creator: Callable[[dict[str, Any]], Any],
    optimizer_creator: Callable[[Any, dict[str, Any]], Any],
    data_creator: Callable[[dict[str, Any]], Any] | None,
    loss_creator: Any,
    scheduler_creator: Callable[[Any, dict[str, Any]], Any] | None,
    serialize_data_creation: bool,
) -> type[TrainingOperator]:
    """A subclass of ``base`` whose ``setup`` calls the creators and registers what they
    return (see ``TrainingOperator.from_creators`` for each creator's contract)."""
    if not callable(model_creator) or not callable(optimizer_creator):
        raise ConfigError("`model_creator` and `optimizer_creator` must be callables.")

    class CustomCreatorOperator(base):  # type: ignore[valid-type,misc]
        def setup(self, config: dict[str, Any]) -> None:
            models = model_creator(config)
            optimizers = optimizer_creator(models, config)
            criterion = _make_loss(loss_creator, config)
            schedulers = scheduler_creator(optimizers, config) if scheduler_creator is not None else None
            # register() sets self.model(s), self.optimizer(s)...: what it returns is not needed.
            self.register(models=models, optimizers=optimizers, criterion=criterion, schedulers=schedulers)
            if data_creator is not None:
                loaders = _create_data(data_creator, config, serialize_data_creation)
                if isinstance(loaders, (list, tuple)):
                    train_loader, validation_loader = (list(loaders) + [None, None])[:2]
                else:
                    train_loader, validation_loader = loaders, None
                self.register_data(train_loader=train_loader, validation_loader=validation_loader)

    CustomCreatorOperator.__name__ = CustomCreatorOperator.__qualname__ = f"{base.__name__}FromCreators"
    return CustomCreatorOperator


def _make_loss(loss_creator: Any, config: dict[str, Any]) -> Any:
    """``loss_creator`` may be a loss class (built without arguments) or ``config -> loss``."""
    if loss_creator is None:
        return None
    if inspect.isclass(loss_creator) and issubclass(loss_creator, torch.nn.Module):
        return loss_creator()
    return loss_creator(config)


_lock: FileLock | None = None


def data_creation_lock() -> FileLock:
    """The machine-wide lock (one per user) under which data is created, one worker at a time.
    One object per process, so that taking it again inside (``TorchTrainer(serialize_data_creation=True)``
    around a ``from_creators`` operator) does not wait on itself. It lives in a private folder:
    a lock file in /tmp, under a name anyone can predict, let another user hold it forever (the
    workers waited without end) or make it a link."""
    global _lock
    if _lock is None:
        _lock = FileLock(os.path.join(private_temp_dir(), "sgd_data_creator.lock"))
    return _lock


_held_for_setup = False


@contextlib.contextmanager
def serialized_setup(enabled: bool) -> Iterator[None]:
    """With ``enabled``: hold :func:`data_creation_lock` while an operator's ``setup`` runs, up
    to its ``register`` (see :func:`release_before_collectives`)."""
    global _held_for_setup
    if not enabled:
        yield
        return
    lock = data_creation_lock()
    lock.acquire()
    _held_for_setup = True
    try:
        yield
    finally:
        release_before_collectives()


def release_before_collectives() -> None:
    """Let the next worker of this machine in: ``register`` wraps models in DDP, a collective
    that needs every worker in, and would wait forever on a worker waiting for the lock."""
    global _held_for_setup
    if _held_for_setup:
        _held_for_setup = False
        data_creation_lock().release()


def _create_data(data_creator: Callable[[dict[str, Any]], Any], config: dict[str, Any], serialize: bool) -> Any:
    if not serialize:
        return data_creator(config)
    with data_creation_lock():
        return data_creator(config)
