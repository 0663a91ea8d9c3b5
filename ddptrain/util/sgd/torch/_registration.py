"""What ``TrainingOperator.register`` and ``register_data`` do to the components a user hands
them: accept each as one object or a list/tuple, check the models, wrap them in
``DistributedDataParallel``, give a ``DataLoader`` a ``DistributedSampler``, and hand the
components back in the shape they came in.

Kept apart from the operator so that the class shows the RaySGD API a user overrides, and this
module the rules that apply to every subclass alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from ddptrain.errors import ConfigError
from ddptrain.torch.train_loop_utils import with_distributed_sampler

__all__: list[str] = []


def as_list(component: Any) -> list[Any]:
    """``None`` → ``[]``, a list or tuple → a list of its items, anything else → ``[it]``."""
    if component is None:
        return []
    if isinstance(component, (list, tuple)):
        return list(component)
    return [component]


def checked_models(models: Any) -> list[torch.nn.Module]:
    """``models`` as a list; raises ``ConfigError`` for anything that is not a module."""
    model_list = as_list(models)
    for model in model_list:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"`models` must be torch.nn.Module(s), got {type(model).__name__}.")
    return model_list


def wrap_ddp(
    models: list[torch.nn.Module], device: torch.device, ddp_args: dict[str, Any] | None
) -> list[torch.nn.Module]:
    """Each model (already on ``device``) in ``DistributedDataParallel``."""
    ids = [device.index] if device.type == "cuda" else None
    return [DistributedDataParallel(model, device_ids=ids, **(ddp_args or {})) for model in models]


def shaped_like(
    models: tuple[list[Any], Any], optimizers: tuple[list[Any], Any], criterion: Any, schedulers: tuple[list[Any], Any]
) -> Any:
    """What ``register`` returns: ``(models, optimizers[, criterion][, schedulers])``, each
    given as ``(registered list, what the user passed)`` and returned single or as a tuple
    as it was passed; a lone component comes back alone."""
    returned: list[Any] = [_like(*models), _like(*optimizers)]
    if criterion is not None:
        returned.append(criterion)
    if schedulers[0]:
        returned.append(_like(*schedulers))
    return tuple(returned) if len(returned) > 1 else returned[0]


def _like(items: list[Any], given: Any) -> Any:
    return tuple(items) if isinstance(given, (list, tuple)) else items[0]


def with_sampler(loader: Iterable[Any] | None, world_size: int, world_rank: int) -> Iterable[Any] | None:
    """A ``DataLoader`` over a map-style dataset rebuilt with a ``DistributedSampler`` (shuffling
    if the loader shuffled); any other loader, or one with such a sampler already, as it is."""
    if not isinstance(loader, DataLoader):
        return loader
    if isinstance(loader.dataset, IterableDataset) or isinstance(loader.sampler, DistributedSampler):
        return loader
    shuffle = isinstance(loader.sampler, RandomSampler)
    return with_distributed_sampler(loader, world_size, world_rank, shuffle)
