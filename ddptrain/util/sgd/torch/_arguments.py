"""The checks of ``TorchTrainer``'s constructor arguments.

They run on the driver before any worker starts, so that a wrong argument is reported at once,
saying what was given and what to pass instead, rather than as a failure inside a worker.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ddptrain.errors import ConfigError
from ddptrain.util.sgd.torch.constants import VALID_SCHEDULER_STEP
from ddptrain.util.sgd.torch.training_operator import TrainingOperator

__all__: list[str] = []


def check_arguments(
    *,
    training_operator_cls: Any,
    num_workers: Any,
    scheduler_step_freq: Any,
    use_gpu: bool | str,
    use_fp16: bool | str,
    apex_args: dict[str, Any] | None,
    config: Any,
) -> bool:
    """Raise ``ConfigError`` for an argument ``TorchTrainer`` cannot use, and warn that Apex
    is not used when it was asked for.

    Returns:
        ``use_gpu`` with ``"auto"`` resolved: whether this machine has CUDA GPUs (counted the
        way that does not start CUDA in this process, see :func:`_has_gpus`).
    """
    if not (isinstance(training_operator_cls, type) and issubclass(training_operator_cls, TrainingOperator)):
        raise ConfigError(
            f"`training_operator_cls` must be a subclass of TrainingOperator, got {training_operator_cls!r}. "
            "For creator functions use `TrainingOperator.from_creators(...)`."
        )
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ConfigError(f"`num_workers` must be an integer >= 1, got {num_workers!r}.")
    if scheduler_step_freq not in VALID_SCHEDULER_STEP:
        raise ConfigError(f"`scheduler_step_freq` must be one of {VALID_SCHEDULER_STEP}, got {scheduler_step_freq!r}.")
    if use_gpu == "auto":
        use_gpu = _has_gpus()
    if not isinstance(use_gpu, bool):
        raise ConfigError(f"`use_gpu` must be True, False or 'auto', got {use_gpu!r}.")
    if use_fp16 == "apex" or apex_args:
        # stacklevel 3: the user's TorchTrainer(...) call, past its __init__.
        warnings.warn("Apex is not used: ddptrain's `use_fp16` is torch.amp; `apex_args` is ignored.", stacklevel=3)
    if config is not None and not isinstance(config, dict):
        raise ConfigError(f"`config` must be a dict, got {type(config).__name__}.")
    return use_gpu


def _has_gpus() -> bool:
    """Whether this machine has CUDA GPUs, asked without starting CUDA here: NVML's count, as
    the rest of ddptrain counts them. ``torch.cuda.is_available()`` would call into CUDA (cuInit)
    in the driver, after which no process it forks can use CUDA."""
    return torch.cuda.device_count() > 0
