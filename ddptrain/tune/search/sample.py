"""Search spaces: ``grid_search``, ``choice``, ``uniform``, ``loguniform``, ``randint``... (driver side).

Each sampling function returns a :class:`Domain` placed as a value anywhere in a (nested)
``param_space`` dict; ``grid_search`` returns Ray's ``{"grid_search": [...]}`` marker. A
:class:`~ddptrain.tune.search.BasicVariantGenerator` turns the space into concrete configs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Domain",
    "Categorical",
    "Float",
    "Integer",
    "Function",
    "Normal",
    "grid_search",
    "choice",
    "uniform",
    "quniform",
    "loguniform",
    "qloguniform",
    "randint",
    "qrandint",
    "lograndint",
    "randn",
    "qrandn",
    "sample_from",
]


class Domain:
    """A distribution a config value is drawn from."""

    def sample(self, rng: np.random.RandomState, spec: Any = None) -> Any:
        """One value drawn with ``rng`` (``spec.config`` is the config resolved so far)."""
        raise NotImplementedError


def _quantize(value: float, q: float | None) -> float:
    return value if q is None else float(np.round(value / q) * q)


@dataclass(frozen=True)
class Categorical(Domain):
    """One of ``categories``, uniformly."""

    categories: tuple[Any, ...]

    def sample(self, rng: np.random.RandomState, spec: Any = None) -> Any:
        return self.categories[int(rng.randint(len(self.categories)))]


@dataclass(frozen=True)
class Float(Domain):
    """A float in ``[lower, upper)``, uniform or log-uniform, optionally rounded to multiples of ``q``."""

    lower: float
    upper: float
    log: bool = False
    q: float | None = None
    base: float = 10.0

    def sample(self, rng: np.random.RandomState, spec: Any = None) -> Any:
        if self.log:
            low, high = math.log(self.lower, self.base), math.log(self.upper, self.base)
            value = float(self.base ** rng.uniform(low, high))
        else:
            value = float(rng.uniform(self.lower, self.upper))
        return _quantize(value, self.q)


@dataclass(frozen=True)
class Normal(Domain):
    """A float from the normal distribution ``N(mean, sd)``, optionally rounded to multiples of ``q``."""

    mean: float = 0.0
    sd: float = 1.0
    q: float | None = None

    def sample(self, rng: np.random.RandomState, spec: Any = None) -> Any:
        return _quantize(float(rng.normal(self.mean, self.sd)), self.q)


@dataclass(frozen=True)
class Integer(Domain):
    """An integer in ``[lower, upper)`` (``upper`` excluded, as Ray's ``randint``)."""

    lower: int
    upper: int
    log: bool = False
    q: int | None = None
    base: float = 10.0

    def sample(self, rng: np.random.RandomState, spec: Any = None) -> Any:
        if self.log:
            low, high = math.log(self.lower, self.base), math.log(self.upper, self.base)
            value = int(self.base ** rng.uniform(low, high))
        else:
            value = int(rng.randint(self.lower, self.upper))
        if self.q is not None:
            value = int(round(value / self.q) * self.q)
        return min(max(value, self.lower), self.upper - 1 if self.q is None else self.upper)


class Function(Domain):
    """A value computed by ``func(spec)``; ``spec.config`` is the rest of the config, resolved."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func

    def sample(self, rng: np.random.RandomState, spec: Any = None) -> Any:
        try:
            return self.func(spec)
        except TypeError:
            return self.func()

    def __repr__(self) -> str:
        return f"sample_from({getattr(self.func, '__name__', self.func)})"


def _check_range(name: str, lower: float, upper: float, positive: bool = False) -> None:
    if not lower < upper:
        raise ValueError(f"`{name}` needs lower < upper, got lower={lower}, upper={upper}.")
    if positive and lower <= 0:
        raise ValueError(f"`{name}` needs lower > 0 (it samples on a log scale), got lower={lower}.")


def grid_search(values: Sequence[Any]) -> dict[str, list[Any]]:
    """Try every value: the sweep runs one trial per value (times ``num_samples``), in order.

    Example:
        >>> param_space = {"lr": tune.grid_search([1e-3, 1e-2])}
    """
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"`grid_search` takes a list of the values to try, e.g. `grid_search([1, 2])`, got {values!r}.")
    values = list(values)
    if not values:
        raise ValueError("`grid_search` needs at least one value, got an empty list.")
    return {"grid_search": values}


def choice(categories: Sequence[Any]) -> Categorical:
    """One of ``categories``, each as likely."""
    categories = tuple(categories)
    if not categories:
        raise ValueError("`choice` needs at least one category, got an empty list.")
    return Categorical(categories)


def uniform(lower: float, upper: float) -> Float:
    """A float drawn uniformly from ``[lower, upper)``."""
    _check_range("uniform", lower, upper)
    return Float(float(lower), float(upper))


def quniform(lower: float, upper: float, q: float) -> Float:
    """A float drawn uniformly from ``[lower, upper]`` and rounded to a multiple of ``q``."""
    _check_range("quniform", lower, upper)
    return Float(float(lower), float(upper), q=q)


def loguniform(lower: float, upper: float, base: float = 10) -> Float:
    """A float drawn uniformly on a log scale from ``[lower, upper)`` (e.g. learning rates)."""
    _check_range("loguniform", lower, upper, positive=True)
    return Float(float(lower), float(upper), log=True, base=base)


def qloguniform(lower: float, upper: float, q: float, base: float = 10) -> Float:
    """``loguniform`` rounded to a multiple of ``q``."""
    _check_range("qloguniform", lower, upper, positive=True)
    return Float(float(lower), float(upper), log=True, q=q, base=base)


def randint(lower: int, upper: int) -> Integer:
    """An integer drawn uniformly from ``[lower, upper)``: ``upper`` is excluded, as in Ray."""
    _check_range("randint", lower, upper)
    return Integer(int(lower), int(upper))


def qrandint(lower: int, upper: int, q: int = 1) -> Integer:
    """An integer from ``[lower, upper]`` rounded to a multiple of ``q`` (``upper`` included, as in Ray)."""
    _check_range("qrandint", lower, upper)
    return Integer(int(lower), int(upper), q=q)


def lograndint(lower: int, upper: int, base: float = 10) -> Integer:
    """An integer from ``[lower, upper)`` drawn on a log scale."""
    _check_range("lograndint", lower, upper, positive=True)
    return Integer(int(lower), int(upper), log=True, base=base)


def randn(mean: float = 0.0, sd: float = 1.0) -> Normal:
    """A float from the normal distribution ``N(mean, sd)``."""
    if sd <= 0:
        raise ValueError(f"`randn` needs sd > 0, got {sd}.")
    return Normal(float(mean), float(sd))


def qrandn(mean: float, sd: float, q: float) -> Normal:
    """``randn`` rounded to a multiple of ``q``."""
    if sd <= 0:
        raise ValueError(f"`qrandn` needs sd > 0, got {sd}.")
    return Normal(float(mean), float(sd), q=q)


def sample_from(func: Callable[..., Any]) -> Function:
    """A value computed from the rest of the config: ``sample_from(lambda spec: spec.config.a * 2)``.

    ``spec.config`` holds the other values of the trial's config (attribute or key access);
    ``func`` may also take no argument (e.g. ``lambda: np.random.randint(10)``).
    """
    if not callable(func):
        raise ValueError(f"`sample_from` needs a function, got {func!r}.")
    return Function(func)
