"""How the trainer's datasets reach the workers.

Driver side, at every start of the worker group (:class:`DatasetIngest`): evaluate the
datasets given as functions, cut the datasets of ``DataConfig.datasets_to_split`` into equal
row ranges, and describe each rank's shard with a :class:`ShardSpec`: references to the
shared memory of its numeric columns, and the pickled values of its other columns (that
rank's rows only). Worker side (:func:`open_shards`): map the memory and build the
``DataIterator`` that ``get_dataset_shard`` returns. No column of numbers is ever pickled.
"""

from __future__ import annotations

import logging
import pickle
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

from ddptrain.config import DataConfig
from ddptrain.data import read_api
from ddptrain.data._shm import ColumnRef, attach_columns
from ddptrain.data.dataset import Dataset
from ddptrain.data.iterator import DataIterator
from ddptrain.errors import ConfigError

__all__ = ["ShardSpec", "DatasetIngest", "as_dataset", "check_datasets", "open_shards"]

_logger = logging.getLogger(__name__)

_BUILDERS = "ddptrain.data.from_items / from_numpy / from_pandas / from_torch / read_numpy / read_csv"


@dataclass(frozen=True)
class ShardSpec:
    """One rank's shard of one dataset, as sent to its worker (small: no column of numbers)."""

    description: str
    num_rows: int
    names: tuple[str, ...]
    shared: dict[str, ColumnRef]
    inline: bytes  # cloudpickled {column: values} of the columns outside shared memory


def _is_factory(value: Any) -> bool:
    return callable(value) and not isinstance(value, Dataset)


def _kind(value: Any) -> str | None:
    """How ``value`` becomes a Dataset, or ``None`` when it cannot."""
    if isinstance(value, Dataset):
        return "dataset"
    if isinstance(value, np.ndarray):
        return "numpy"
    pandas = sys.modules.get("pandas")
    if pandas is not None and isinstance(value, pandas.DataFrame):
        return "pandas"
    if isinstance(value, (list, tuple)):
        return "items"
    torch_data = sys.modules.get("torch.utils.data")
    if torch_data is not None and isinstance(value, torch_data.Dataset):
        return "torch"
    if hasattr(value, "__len__") and hasattr(value, "__getitem__") and not isinstance(value, (str, bytes, Mapping)):
        return "torch"  # a map-style dataset that does not subclass torch's
    return None


def as_dataset(value: Any, name: str) -> Dataset:
    """The trainer dataset ``name`` as a :class:`Dataset` (lists, arrays, DataFrames and torch
    datasets are converted with the matching ``from_*`` function)."""

    kind = _kind(value)
    if kind == "dataset":
        return value
    if kind == "numpy":
        return read_api.from_numpy(value)
    if kind == "pandas":
        return read_api.from_pandas(value)
    if kind == "items":
        return read_api.from_items(value)
    if kind == "torch":
        return read_api.from_torch(value)
    raise ConfigError(
        f"`datasets[{name!r}]` must be a ddptrain.data.Dataset (build one with {_BUILDERS}) or a "
        f"function that returns one, got {type(value).__name__}."
    )


def check_datasets(datasets: Mapping[str, Any], config: DataConfig) -> None:
    """Refuse datasets that cannot work, before anything starts."""
    for name, value in datasets.items():
        if not isinstance(name, str):
            raise ConfigError(f"`datasets` keys must be dataset names (str), got {name!r}.")
        if not _is_factory(value) and _kind(value) is None:
            as_dataset(value, name)  # raises the error
    if config.datasets_to_split != "all":
        unknown = [n for n in config.datasets_to_split if n not in datasets]
        if unknown:
            raise ConfigError(
                f"`DataConfig(datasets_to_split=...)` names {unknown}, which the trainer was not given; "
                f"its datasets are {sorted(datasets)}."
            )


def _evaluate(factory: Any, name: str) -> Dataset:
    value = factory()
    if _is_factory(value):
        raise ConfigError(f"The function given as `datasets[{name!r}]` returned another function, not a dataset.")
    return as_dataset(value, name)


class DatasetIngest:
    """The trainer's datasets during one ``fit()`` (driver side).

    Args:
        datasets: Name to dataset, or to a function without arguments that builds one; such
            a function is called again at every start of the worker group.
        config: Which datasets are split across the workers.
        world_size: Number of workers.
    """

    def __init__(self, datasets: Mapping[str, Any], config: DataConfig, world_size: int) -> None:
        check_datasets(datasets, config)
        self._sources = dict(datasets)
        self._config = config
        self._world_size = max(world_size, 1)
        self._fixed = {name: as_dataset(v, name) for name, v in datasets.items() if not _is_factory(v)}
        self._live: dict[str, Dataset] = {}  # this start's datasets; kept until the next start

    def _split(self, name: str) -> bool:
        return self._config.datasets_to_split == "all" or name in self._config.datasets_to_split

    def _start(self) -> dict[str, Dataset]:
        """This start's datasets: functions are called again; the last start's are released."""
        self._live = {}
        self._live = {
            name: self._fixed[name] if name in self._fixed else _evaluate(value, name)
            for name, value in self._sources.items()
        }
        return self._live

    def _ranges(self, name: str, num_rows: int) -> list[tuple[int, int]]:
        world = self._world_size
        if not self._split(name):
            return [(0, num_rows)] * world
        size = num_rows // world
        if num_rows and not size:
            _logger.warning(
                "ddptrain: dataset %r has %d rows, fewer than the %d workers: every shard is empty",
                name,
                num_rows,
                world,
            )
        elif num_rows % world:
            _logger.info(
                "ddptrain: dataset %r: %d rows in %d equal shards of %d; the last %d rows are left out",
                name,
                num_rows,
                world,
                size,
                num_rows % world,
            )
        return [(rank * size, (rank + 1) * size) for rank in range(world)]

    def shards(
        self, remote_ranks: Collection[int] = (), world_size: int | None = None
    ) -> dict[int, dict[str, ShardSpec]]:
        """Every rank's shard specs for a new start of the worker group.

        Args:
            remote_ranks: Ranks on other hosts than the driver: they cannot map its memory, so
                their specs carry every column's values.
            world_size: The new start's number of workers (an elastic run's changes between
                starts; default: the one given at construction).
        """
        if world_size is not None:
            self._world_size = max(world_size, 1)
        specs: dict[int, dict[str, ShardSpec]] = {rank: {} for rank in range(self._world_size)}
        for name, dataset in self._start().items():
            split = self._split(name)
            made: dict[tuple[int, int, bool], ShardSpec] = {}
            for rank, (start, stop) in enumerate(self._ranges(name, dataset.count())):
                local = rank not in remote_ranks
                if (start, stop, local) not in made:
                    shared, inline = dataset._describe(start, stop, share=local)
                    where = f"shard {rank} of {self._world_size}" if split else "all (not split)"
                    made[start, stop, local] = ShardSpec(
                        description=f"dataset {name!r}, {where}",
                        num_rows=stop - start,
                        names=tuple(dataset.columns()),
                        shared=shared,
                        inline=cloudpickle.dumps(inline) if inline else b"",
                    )
                specs[rank][name] = made[start, stop, local]
        return specs

    def local_iterators(self) -> dict[str, DataIterator]:
        """Local mode (the function runs in this process): each dataset whole."""
        return {name: DataIterator(ds, f"dataset {name!r}") for name, ds in self._start().items()}

    def release(self) -> None:
        """Drop this start's datasets (the memory of those built by functions goes with them)."""
        self._live = {}


def open_shards(specs: Mapping[str, ShardSpec]) -> dict[str, DataIterator]:
    """The worker's ``DataIterator`` per dataset name, its numeric columns mapped from the driver."""
    refs = {(name, column): ref for name, spec in specs.items() for column, ref in spec.shared.items()}
    mapped = attach_columns(refs)
    iterators = {}
    for name, spec in specs.items():
        inline = pickle.loads(spec.inline) if spec.inline else {}
        columns = {c: mapped[name, c] if (name, c) in mapped else inline[c] for c in spec.names}
        iterators[name] = DataIterator(Dataset(columns, spec.num_rows), spec.description)
    return iterators
