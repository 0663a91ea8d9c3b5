"""What a trial runs: a ddptrain trainer with overridden arguments, or a function (driver side).

* A trainer (any ``BaseTrainer``, or ``as_trainable(trainer)``): each trial fits a
  shallow copy whose constructor arguments are overridden by the trial's config (Ray V1's
  pattern): ``train_loop_config`` is merged into the trainer's, ``scaling_config`` (a
  ``ScalingConfig`` or a dict of its fields) replaces or updates it, other constructor
  arguments (``datasets``, ``backend_config``...) are replaced, and any other key is merged
  into ``train_loop_config`` (so ``tune.run(as_trainable(trainer), config={"lr": ...})``
  works). The trial's folder is the run directory of that fit.
* A function ``f(config)`` reporting with ``tune.report`` (or fitting a trainer with
  ``TuneReportCallback``). It asks for 1 CPU unless wrapped in ``with_resources``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddptrain import _env
from ddptrain.base_trainer import BaseTrainer
from ddptrain.config import RunConfig, ScalingConfig
from ddptrain.errors import ConfigError
from ddptrain.launch.hosts import HostSpec, gpus_needed, parse_hosts
from ddptrain.result import Result

__all__ = ["TrainerTrainable", "FunctionTrainable", "as_trainable", "with_resources", "wrap_trainable"]

_TRAINER_ARGS = ("datasets", "dataset_config", "backend_config", "resume_from_checkpoint")


@dataclass
class PreparedTrial:
    """A trial's trainable, ready to run, and what it needs: ``cpus`` and ``gpus`` of this
    machine, and the host list its workers run on (``None``: they run here)."""

    cpus: float
    gpus: float
    trainer: BaseTrainer | None = None
    hosts: list[HostSpec] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def merge_dicts(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Ray's ``merge_dicts``: nested dicts merged into a new one, ``update`` wins."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_dicts(merged[key], value)
        else:
            merged[key] = value
    return merged


class TrainerTrainable:
    """A ddptrain trainer as a sweep's trainable (what ``as_trainable(trainer)`` returns).

    Args:
        trainer: The trainer each trial copies.
        driver_resources: Resources the trial's driver reserves (``{"CPU": n}``); none by default.
    """

    def __init__(self, trainer: BaseTrainer, driver_resources: dict[str, float] | None = None) -> None:
        if not isinstance(trainer, BaseTrainer):
            raise ConfigError(f"`as_trainable` needs a ddptrain trainer, got {trainer!r}.")
        self.trainer = trainer
        self.driver_resources = dict(driver_resources or {})

    @property
    def name(self) -> str:
        return type(self.trainer).__name__

    def base_run_config(self) -> RunConfig:
        return self.trainer.run_config

    def prepare(self, config: dict[str, Any]) -> PreparedTrial:
        """A copy of the trainer with ``config`` applied, and the CPUs and GPUs its workers need."""
        trainer = copy.copy(self.trainer)
        overrides = dict(config)
        loop_config = dict(trainer.train_loop_config or {})
        if "train_loop_config" in overrides:
            given = overrides.pop("train_loop_config")
            if not isinstance(given, dict):
                raise ConfigError(f"`param_space['train_loop_config']` must be a dict, got {given!r}.")
            loop_config = merge_dicts(loop_config, given)
        if "scaling_config" in overrides:
            scaling = overrides.pop("scaling_config")
            if isinstance(scaling, dict):
                scaling = dataclasses.replace(trainer.scaling_config, **scaling)
            if not isinstance(scaling, ScalingConfig):
                raise ConfigError(
                    f"`param_space['scaling_config']` must be a ScalingConfig or a dict of its fields, got {scaling!r}."
                )
            trainer.scaling_config = scaling
        if "run_config" in overrides:
            raise ConfigError("`param_space` cannot override `run_config`: pass it to the Tuner.")
        for name in _TRAINER_ARGS:
            if name in overrides:
                setattr(trainer, name, overrides.pop(name))
        loop_config = merge_dicts(loop_config, overrides)  # Ray V1: other keys go to the loop's config
        trainer.train_loop_config = loop_config
        trainer.datasets = dict(trainer.datasets)
        scaling = trainer.scaling_config
        driver_cpus = self.driver_resources.get("CPU", 0)
        raw_hosts = scaling.hosts if scaling.hosts is not None else _env.hostfile()
        if raw_hosts is not None and scaling.max_workers > 0:  # the workers run there: only the driver here
            return PreparedTrial(cpus=driver_cpus, gpus=0.0, trainer=trainer, hosts=parse_hosts(raw_hosts))
        cpus = scaling.max_workers * scaling.num_cpus_per_worker + driver_cpus
        # The GPUs its workers are placed on: at a fraction each, whole GPUs' worth of shares.
        gpus = gpus_needed(scaling.max_workers, scaling.num_gpus_per_worker) if scaling.use_gpu else 0
        return PreparedTrial(cpus=cpus, gpus=float(gpus), trainer=trainer)

    def run(self, prepared: PreparedTrial, run_config: RunConfig, hosts: list[HostSpec] | None = None) -> Result:
        """Fit the prepared trainer with the trial's run config, on ``hosts`` if given (its
        share of the host list, each host with ``slots`` = its workers there)."""
        assert prepared.trainer is not None
        prepared.trainer.run_config = run_config
        if hosts is not None:
            prepared.trainer.scaling_config = dataclasses.replace(prepared.trainer.scaling_config, hosts=hosts)
        return prepared.trainer.fit()


class FunctionTrainable:
    """A function ``f(config)`` (or ``f()``) as a sweep's trainable.

    Args:
        fn: The function; it reports with ``ddptrain.tune.report``.
        resources: What each trial reserves: ``{"CPU": n, "GPU": m}`` (default ``{"CPU": 1}``).
    """

    def __init__(self, fn: Callable[..., Any], resources: dict[str, float] | None = None) -> None:
        self.fn = fn
        self.resources = {"CPU": 1.0} if resources is None else {k.upper(): float(v) for k, v in resources.items()}
        try:
            params = [
                p
                for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
            ]
        except (TypeError, ValueError):
            params = [None]  # type: ignore[list-item]
        self._takes_config = bool(params)

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", type(self.fn).__name__)

    def base_run_config(self) -> RunConfig | None:
        return None

    def prepare(self, config: dict[str, Any]) -> PreparedTrial:
        return PreparedTrial(cpus=self.resources.get("CPU", 0.0), gpus=self.resources.get("GPU", 0.0))

    def run(self, config: dict[str, Any]) -> Any:
        return self.fn(config) if self._takes_config else self.fn()


Trainable = TrainerTrainable | FunctionTrainable


def as_trainable(trainer: BaseTrainer) -> TrainerTrainable:
    """``trainer`` as a trainable for ``Tuner`` or ``tune.run`` (Ray's ``trainer.as_trainable()``).

    Example:
        >>> analysis = tune.run(as_trainable(trainer), config={"lr": tune.grid_search([1e-3, 1e-2])})
    """
    return TrainerTrainable(trainer)


def with_resources(trainable: Any, resources: dict[str, float] | ScalingConfig) -> TrainerTrainable | FunctionTrainable:
    """``trainable`` with the resources each trial reserves (Ray's ``tune.with_resources``).

    For a function: ``{"CPU": n, "GPU": m}`` (lower-case keys accepted). For a trainer: a
    ``ScalingConfig`` replacing the trainer's, or ``{"CPU": n}`` reserved for the trial's driver.
    """
    wrapped = wrap_trainable(trainable)
    if isinstance(wrapped, TrainerTrainable):
        if isinstance(resources, ScalingConfig):
            trainer = copy.copy(wrapped.trainer)
            trainer.scaling_config = resources
            return TrainerTrainable(trainer, wrapped.driver_resources)
        return TrainerTrainable(wrapped.trainer, {k.upper(): float(v) for k, v in resources.items()})
    if isinstance(resources, ScalingConfig):
        total = resources.total_resources
        resources = {"CPU": total.get("CPU", 0.0), "GPU": total.get("GPU", 0.0)}
    return FunctionTrainable(wrapped.fn, dict(resources))


def wrap_trainable(trainable: Any) -> TrainerTrainable | FunctionTrainable:
    """Any accepted trainable as a ``TrainerTrainable`` or ``FunctionTrainable``."""
    if isinstance(trainable, (TrainerTrainable, FunctionTrainable)):
        return trainable
    if isinstance(trainable, BaseTrainer):
        return TrainerTrainable(trainable)
    if isinstance(trainable, type):
        # A class that knows how to run as a function trial (RaySGD's BaseTorchTrainable).
        as_function = getattr(trainable, "_ddptrain_function_trainable", None)
        if callable(as_function):
            return wrap_trainable(as_function())
        raise ConfigError(
            f"Trainable classes ({trainable.__name__}) are not supported by ddptrain.tune: pass a ddptrain "
            "trainer, `as_trainable(trainer)`, a function `f(config)` that calls `tune.report`, or RaySGD's "
            "`TorchTrainer.as_trainable(...)` (a BaseTorchTrainable)."
        )
    if callable(trainable):
        return FunctionTrainable(trainable)
    raise ConfigError(f"The trainable must be a ddptrain trainer or a function, got {trainable!r}.")
