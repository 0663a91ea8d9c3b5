"""``BasicVariantGenerator``: grid search times ``num_samples``, random sampling (driver side).

Grid axes are expanded in order (the last ``grid_search`` in the space varies fastest, as in
Ray), and the whole grid is repeated ``num_samples`` times; every other domain is drawn anew
for each trial. With ``random_state`` (or ``np.random.seed(...)`` before the sweep) the
configs are the same on every run.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from ddptrain.tune.search.sample import Domain, Function
from ddptrain.tune.search.searcher import Searcher

__all__ = ["BasicVariantGenerator", "generate_variants", "resolve_config"]

Path = tuple[Any, ...]


def _walk(space: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every leaf of a nested dict/list space as (path, value); grid markers are leaves."""
    if isinstance(space, dict) and not _is_grid(space):
        for key, value in space.items():
            yield from _walk(value, (*path, key))
    elif isinstance(space, list):
        for i, value in enumerate(space):
            yield from _walk(value, (*path, i))
    else:
        yield path, space


def _is_grid(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"grid_search"}


def _set(config: Any, path: Path, value: Any) -> None:
    for key in path[:-1]:
        config = config[key]
    config[path[-1]] = value


class _Spec:
    """What a ``sample_from`` function sees: ``spec.config`` (attribute or key access)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = _AttrDict(config)


class _AttrDict(dict[str, Any]):
    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return _AttrDict(value) if isinstance(value, dict) else value


def resolve_config(space: dict[str, Any], grid_point: dict[Path, Any], rng: np.random.RandomState) -> dict[str, Any]:
    """One concrete config: grid values from ``grid_point``, domains drawn with ``rng``,
    ``sample_from`` functions last (they may read the other values)."""
    config = copy.deepcopy(space)
    functions = []
    for path, value in _walk(space):
        if _is_grid(value):
            _set(config, path, grid_point[path])
        elif isinstance(value, Function):
            functions.append(path)
        elif isinstance(value, Domain):
            _set(config, path, value.sample(rng))
    for path in functions:  # in order: a later function sees earlier ones' values
        leaf: Any = space
        for key in path:
            leaf = leaf[key]
        _set(config, path, leaf.sample(rng, _Spec(config)))
    return config


def generate_variants(space: dict[str, Any], num_samples: int, rng: np.random.RandomState) -> list[dict[str, Any]]:
    """Every config of the sweep: the grid's points in order, repeated ``num_samples`` times."""
    grids = [(path, value["grid_search"]) for path, value in _walk(space) if _is_grid(value)]
    configs = []
    for _ in range(num_samples):
        for values in itertools.product(*(v for _, v in grids)):
            point = {path: value for (path, _), value in zip(grids, values, strict=True)}
            configs.append(resolve_config(space, point, rng))
    return configs


class BasicVariantGenerator(Searcher):
    """Grid search and random search, the default search algorithm.

    Args:
        random_state: Seed (or a ``numpy.random.RandomState``) for the random domains. Default:
            numpy's global random state, so ``np.random.seed(0)`` before the sweep also makes it
            reproducible.
        points_to_evaluate: Configs (or partial configs) tried first, before the generated ones.
        max_concurrent: Accepted for compatibility with Ray; use ``TuneConfig.max_concurrent_trials``.
    """

    def __init__(
        self,
        random_state: int | np.random.RandomState | None = None,
        points_to_evaluate: list[dict[str, Any]] | None = None,
        max_concurrent: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(random_state, np.random.RandomState):
            self._rng = random_state
        elif random_state is None:
            self._rng = np.random.mtrand._rand
        else:
            self._rng = np.random.RandomState(random_state)
        self._points = [dict(p) for p in points_to_evaluate or []]
        self._queue: list[dict[str, Any]] = []
        self._num_samples = 1

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict[str, Any]) -> bool:
        super().set_search_properties(metric, mode, config)
        self._space = config
        return True

    def set_num_samples(self, num_samples: int) -> None:
        """Set by the sweep from ``TuneConfig.num_samples``, before the first ``suggest``."""
        self._num_samples = num_samples
        variants = generate_variants(self._space, num_samples, self._rng)
        points = [_merge(copy.deepcopy(variants[0] if variants else {}), p) for p in self._points]
        self._queue = points + variants

    @property
    def total_trials(self) -> int | None:
        return len(self._queue) + self._taken

    _taken = 0

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if not self._queue:
            return Searcher.FINISHED
        self._taken += 1
        return self._queue.pop(0)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base
