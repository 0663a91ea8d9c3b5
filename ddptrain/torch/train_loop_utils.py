"""Helpers used inside the training function: devices, model and data loader preparation."""

from __future__ import annotations

import logging
import os
import random
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ddptrain import context

__all__ = [
    "get_device",
    "get_devices",
    "prepare_model",
    "prepare_data_loader",
    "enable_reproducibility",
]

_logger = logging.getLogger(__name__)


def get_devices() -> list[torch.device]:
    """The devices of this worker: its CUDA devices with ``use_gpu``, else ``[cpu]``. In a
    function trial of ``ddptrain.tune``: the trial's GPUs (``tune.get_context().get_devices()``)."""
    session = context._session
    if session is None or session.channel is None:  # local mode, or outside a worker
        trials = sys.modules.get("ddptrain.tune.session")  # loaded by a sweep, never by us
        if trials is not None and trials._get_session() is not None:  # a function trial's thread
            return trials.get_context().get_devices()
        if torch.cuda.is_available():
            return [torch.device("cuda", torch.cuda.current_device())]
        return [torch.device("cpu")]
    if session.devices and torch.cuda.is_available():
        return [torch.device("cuda", index) for index in session.devices]
    return [torch.device("cpu")]


def get_device() -> torch.device:
    """This worker's (first) device: ``cuda:<i>`` with ``use_gpu``, else ``cpu``."""
    return get_devices()[0]


def _world() -> tuple[int, int]:
    session = context._session
    if session is None:
        return 1, 0
    return session.context.get_world_size(), session.context.get_world_rank()


def prepare_model(
    model: torch.nn.Module,
    move_to_device: bool | torch.device = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Move ``model`` to this worker's device and wrap it for data-parallel training.

    Args:
        model: The model.
        move_to_device: ``True`` moves it to :func:`get_device`; a ``torch.device`` moves it there.
        parallel_strategy: ``"ddp"`` (DistributedDataParallel), ``"fsdp"``
            (FullyShardedDataParallel) or ``None``. Only applied when there are 2+ workers.
        parallel_strategy_kwargs: Extra arguments of the wrapper.

    Returns:
        The moved, and possibly wrapped, model.
    """
    if parallel_strategy not in ("ddp", "fsdp", None):
        raise ValueError(f"`parallel_strategy` must be 'ddp', 'fsdp' or None, got {parallel_strategy!r}.")
    device = move_to_device if isinstance(move_to_device, torch.device) else get_device()
    if move_to_device:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _logger.debug("Moving model to device %s", device)
        model = model.to(device)
    world_size, rank = _world()
    kwargs = dict(parallel_strategy_kwargs or {})
    if world_size > 1 and parallel_strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if rank == 0:
            _logger.info("Wrapping the model in DistributedDataParallel")
        if device.type == "cuda":
            kwargs.setdefault("device_ids", [device])
            kwargs.setdefault("output_device", device)
        model = DistributedDataParallel(model, **kwargs)
    elif world_size > 1 and parallel_strategy == "fsdp":
        _warn_fsdp_without_nccl()
        if device.type != "cuda":
            raise RuntimeError(
                "FSDP needs CUDA devices: use `ScalingConfig(use_gpu=True)`, or "
                "`parallel_strategy='ddp'` when training on CPUs."
            )
        from torch.distributed.fsdp import FullyShardedDataParallel

        if rank == 0:
            _logger.info("Wrapping the model in FullyShardedDataParallel")
        if device.type == "cuda":
            kwargs.setdefault("device_id", device)
        model = FullyShardedDataParallel(model, **kwargs)
    return model


def _warn_fsdp_without_nccl() -> None:
    """FSDP on GPU workers whose process group is not NCCL's: say so, since nothing else does.
    Workers that share a GPU (``resources_per_worker={"GPU": 0.5}``) get gloo, as NCCL refuses
    two ranks on one GPU; FSDP's all-gathers and reduce-scatters then pass through host memory
    (slow), where gloo supports them on CUDA tensors at all."""
    import torch.distributed as dist

    session = context._session
    if session is None or not session.devices or not dist.is_available() or not dist.is_initialized():
        return
    backend = str(dist.get_backend())
    if "nccl" in backend:
        return
    warnings.warn(
        f"prepare_model(parallel_strategy='fsdp') on GPU workers whose process group uses {backend!r}, "
        "not NCCL (workers that share a GPU get gloo, since NCCL refuses two ranks on one GPU): FSDP's "
        "collectives go through host memory, slowly, and may fail on CUDA tensors. Give each worker a whole "
        "GPU to get NCCL, or use parallel_strategy='ddp'.",
        stacklevel=3,
    )


class _DeviceLoader:
    """Iterates a DataLoader and moves every batch (tensors in nested lists, tuples and mappings,
    such as the ``BatchEncoding`` of a transformers collator) to a device."""

    def __init__(self, loader: DataLoader[Any], device: torch.device) -> None:
        self._loader = loader
        self._device = device
        self._non_blocking = device.type == "cuda"

    def _move(self, item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return item.to(self._device, non_blocking=self._non_blocking)
        if isinstance(item, Mapping):  # dicts, and what collators return (BatchEncoding is a UserDict)
            return _same_mapping(item, {k: self._move(v) for k, v in item.items()})
        if isinstance(item, (list, tuple)):
            moved = [self._move(v) for v in item]
            return type(item)(*moved) if hasattr(item, "_fields") else type(item)(moved)
        return item

    def __iter__(self) -> Iterator[Any]:
        for batch in self._loader:
            yield self._move(batch)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_loader", "_device", "_non_blocking"):
            # Not set yet (copy/pickle build the object without __init__): no recursion.
            raise AttributeError(name)
        return getattr(self._loader, name)


def _same_mapping(original: Mapping[Any, Any], moved: dict[Any, Any]) -> Any:
    """``moved`` as the type of ``original`` where that type rebuilds from a dict (a plain
    ``dict`` otherwise, e.g. a ``defaultdict``)."""
    if type(original) is dict:
        return moved
    try:
        return type(original)(moved)  # type: ignore[call-arg]
    except Exception:
        return moved


def _with_sampler(loader: DataLoader[Any], world_size: int, rank: int) -> DataLoader[Any]:
    if isinstance(loader.dataset, IterableDataset):
        if rank == 0:
            warnings.warn(
                "prepare_data_loader: the DataLoader wraps an IterableDataset, which cannot get a "
                "DistributedSampler, so every rank will see the whole dataset. Shard it yourself "
                "with get_context().get_world_rank()/get_world_size().",
                stacklevel=3,
            )
        return loader
    if loader.batch_size is None and loader.batch_sampler is not None:
        warnings.warn(
            "prepare_data_loader: the DataLoader uses a custom batch_sampler, which is kept as is; "
            "shard the data yourself.",
            stacklevel=3,
        )
        return loader
    sampler = loader.sampler
    if not isinstance(sampler, (RandomSampler, SequentialSampler)):
        warnings.warn(
            f"prepare_data_loader: the custom sampler {type(sampler).__name__} is replaced by a DistributedSampler.",
            stacklevel=3,
        )
    return with_distributed_sampler(loader, world_size, rank, shuffle=not isinstance(sampler, SequentialSampler))


def with_distributed_sampler(loader: DataLoader[Any], num_replicas: int, rank: int, shuffle: bool) -> DataLoader[Any]:
    """A copy of ``loader`` that reads ``rank``'s part of its dataset through a
    ``DistributedSampler``, with the loader's other settings (batch size, workers, collate
    function, pinning...) kept."""
    extra: dict[str, Any] = {}
    for name in ("pin_memory_device", "in_order"):  # DataLoader arguments of newer torch versions
        if hasattr(loader, name):
            extra[name] = getattr(loader, name)
    if loader.num_workers > 0:
        extra["prefetch_factor"] = loader.prefetch_factor
        extra["persistent_workers"] = loader.persistent_workers
        extra["multiprocessing_context"] = loader.multiprocessing_context
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=DistributedSampler(loader.dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle),
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        **extra,
    )


def prepare_data_loader(
    data_loader: DataLoader[Any],
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
    auto_transfer: bool = True,
) -> Any:
    """Shard a DataLoader across workers and move its batches to this worker's device.

    With 2+ workers a ``DistributedSampler`` replaces the loader's sampler, keeping its batch
    size, workers, collate function and other settings (shuffling if the loader shuffled).
    Call ``loader.sampler.set_epoch(epoch)`` each epoch to reshuffle. An ``IterableDataset``
    cannot be sharded this way: you get a warning, and every rank sees all of it.

    Args:
        data_loader: The loader.
        add_dist_sampler: Add the ``DistributedSampler``.
        move_to_device: Move batches to :func:`get_device`: the tensors in them, also inside
            lists, tuples and mappings (a collator's ``BatchEncoding`` keeps its type).
        auto_transfer: Copy to CUDA asynchronously (``non_blocking``).
    """
    world_size, rank = _world()
    loader = data_loader
    if add_dist_sampler and world_size > 1 and not isinstance(loader.sampler, DistributedSampler):
        loader = _with_sampler(loader, world_size, rank)
    if move_to_device:
        return _DeviceLoader(loader, get_device())
    return loader


def enable_reproducibility(seed: int = 0) -> None:
    """Seed torch, random and numpy and make torch pick deterministic algorithms.

    Call it at the start of the training function. Data loading with several DataLoader
    workers may still be nondeterministic unless you seed them too.
    """
    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
