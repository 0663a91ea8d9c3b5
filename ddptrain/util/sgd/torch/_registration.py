"""What ``TrainingOperator.register`` and ``register_data`` do to the components a user hands
them: accept each as one object or a list/tuple (and hand it back in that shape), check the
models, wrap them in ``DistributedDataParallel``, and give a ``DataLoader`` a
``DistributedSampler``.

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


def as_given(items: list[Any], given: Any) -> Any:
    """``items`` in the shape the user passed them: a tuple if ``given`` was a list or tuple,
    else the one item."""
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
