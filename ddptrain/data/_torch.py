"""Torch side of the data iterator: numpy batches to tensors, devices, ``to_torch``.

Imported only when torch batches are asked for, so ``ddptrain.data`` itself does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.utils.data

from ddptrain import context
from ddptrain.torch.train_loop_utils import _same_mapping, get_device

__all__ = [
    "resolve_device",
    "from_numpy",
    "all_tensor_kinds",
    "tensor_converter",
    "move",
    "moved",
    "TorchIterableDataset",
    "feature_tensor",
]

# dtype kinds torch.from_numpy takes: bool, signed and unsigned ints, floats, complex.
_TENSOR_KINDS = "biufc"


def resolve_device(device: Any) -> torch.device:
    """``"auto"``: this worker's device inside a training function (``ddptrain.torch.get_device()``),
    else the CPU. Anything else is given to ``torch.device``; a CUDA device without a number is
    the caller's current GPU (its worker's), numbered now: batches are moved in a prefetch
    thread, where plain ``"cuda"`` would mean GPU 0 (the current device is per thread)."""
    if isinstance(device, str) and device == "auto":
        if context._session is None:
            return torch.device("cpu")

        return get_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"`device` must be 'auto', a torch.device or a device string, got {device!r}.") from exc
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


# A tensor on the same memory as a numpy array.
from_numpy = torch.from_numpy


def all_tensor_kinds(columns: Mapping[str, np.ndarray]) -> bool:
    """Whether every column has a dtype that ``torch.from_numpy`` takes."""
    return all(c.dtype.kind in _TENSOR_KINDS for c in columns.values())


def _column_tensor(name: str, column: np.ndarray) -> Any:
    if column.dtype.kind in _TENSOR_KINDS:
        return torch.from_numpy(column)
    if column.dtype.kind in "US":
        return column.tolist()
    if column.dtype.hasobject:
        try:
            return torch.utils.data.default_collate(list(column))
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"Column {name!r} cannot be made into a tensor batch: {exc}. Pass a `collate_fn` that "
                "builds the batch (e.g. pads values of different shapes), or use `iter_batches()`."
            ) from exc
    return column  # e.g. datetimes: left as numpy


def tensor_converter(
    columns: Mapping[str, np.ndarray], dtypes: torch.dtype | Mapping[str, torch.dtype] | None
) -> Callable[[Mapping[str, np.ndarray]], dict[str, Any]]:
    """A function from a numpy batch to a dict of tensors (zero-copy where the dtype allows)."""
    if dtypes is not None and not isinstance(dtypes, (torch.dtype, Mapping)):
        raise ValueError(f"`dtypes` must be a torch.dtype or a dict of them per column, got {dtypes!r}.")
    if isinstance(dtypes, Mapping):
        unknown = sorted(set(dtypes) - set(columns))
        if unknown:
            raise ValueError(f"`dtypes` names unknown column(s) {unknown}; the columns are {list(columns)}.")
    casts = {name: (dtypes.get(name) if isinstance(dtypes, Mapping) else dtypes) for name in columns}

    def convert(batch: Mapping[str, np.ndarray]) -> dict[str, Any]:
        out = {}
        for name, array in batch.items():
            value = _column_tensor(name, array)
            cast = casts.get(name)
            if cast is not None and isinstance(value, torch.Tensor):
                value = value.to(cast)
            out[name] = value
        return out

    return convert


def move(value: Any, device: torch.device, pin_memory: bool) -> Any:
    """``value`` (a tensor, or a dict, list or tuple of them) on ``device``."""
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        if pin_memory and device.type == "cuda" and value.device.type == "cpu":
            return value.pin_memory().to(device, non_blocking=True)
        return value.to(device)
    if isinstance(value, Mapping):  # dicts, and what collators return (BatchEncoding is a UserDict)
        return _same_mapping(value, {key: move(item, device, pin_memory) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(move(item, device, pin_memory) for item in value)
    return value


def moved(convert: Callable[[Any], Any] | None, device: torch.device, pin_memory: bool) -> Callable[[Any], Any]:
    """``convert`` followed by a move of its output to ``device``."""
    if convert is None:
        return lambda batch: move(batch, device, pin_memory)
    return lambda batch: move(convert(batch), device, pin_memory)


def feature_tensor(
    batch: Mapping[str, np.ndarray], names: list[str], dtype: torch.dtype | None, unsqueeze: bool
) -> torch.Tensor:
    """Columns ``names`` of a batch as one tensor: ``(N, k)`` (columns side by side), or ``(N,)``
    for a single scalar column without ``unsqueeze``."""
    parts = []
    for name in names:
        tensor = torch.as_tensor(np.asarray(batch[name]))
        if tensor.dim() > 1:
            tensor = tensor.reshape(len(tensor), -1)
        elif unsqueeze or len(names) > 1:
            tensor = tensor.unsqueeze(1)
        parts.append(tensor)
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return tensor.to(dtype) if dtype is not None else tensor


class TorchIterableDataset(torch.utils.data.IterableDataset):
    """A torch ``IterableDataset`` whose every pass calls ``generate()`` again (``to_torch``)."""

    def __init__(self, generate: Callable[[], Iterator[Any]]) -> None:
        self._generate = generate

    def __iter__(self) -> Iterator[Any]:
        return self._generate()
