"""``setup_wandb``: Weights & Biases tracking from inside a training function, on rank 0 only.

Ray's ``ray.air.integrations.wandb.setup_wandb`` under ddptrain (``pip install ddptrain[wandb]``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

from ddptrain import context
from ddptrain.errors import ConfigError
from ddptrain.integrations import _tracking

__all__ = ["setup_wandb", "WANDB_ENV_VAR", "WANDB_PROJECT_ENV_VAR", "WANDB_GROUP_ENV_VAR"]

_logger = logging.getLogger(__name__)

# Ray's names for these environment variables.
WANDB_ENV_VAR = "WANDB_API_KEY"
WANDB_PROJECT_ENV_VAR = "WANDB_PROJECT_NAME"
WANDB_GROUP_ENV_VAR = "WANDB_GROUP_NAME"


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise _tracking.missing("wandb", "wandb") from exc
    return wandb


def setup_wandb(
    config: Mapping[str, Any] | None = None,
    api_key: str | None = None,
    api_key_file: str | None = None,
    rank_zero_only: bool = True,
    **kwargs: Any,
) -> Any:
    """Start (or resume) a W&B run and return it.

    Call it inside the training function. On rank 0 (on every rank with
    ``rank_zero_only=False``) it calls ``wandb.init`` and returns the ``wandb.Run``; other
    ranks get a no-op object whose methods accept anything and do nothing, so the same code
    runs on every rank and logs once.

    Defaults, each overridden by the same keyword in ``kwargs`` (passed on to ``wandb.init``):
    ``name`` and ``group`` are the ddptrain run's name (``RunConfig.name``; with
    ``rank_zero_only=False`` each rank's name ends in ``_rank<r>``), ``project`` is
    ``$WANDB_PROJECT_NAME`` (else W&B's own default, ``$WANDB_PROJECT``), ``group`` is
    ``$WANDB_GROUP_NAME`` when set, and ``config`` is logged as the run's config (values W&B
    cannot store are logged as strings). W&B's own variables (``WANDB_MODE=offline``,
    ``WANDB_DIR``, ...) apply as usual.

    Unlike Ray, a ddptrain run that restarts after a failure (``FailureConfig``) or is resumed
    logs on into the same W&B run (``resume="allow"`` with the id kept in ``<run dir>/tracking/``).

    Call ``run.finish()`` at the end of the training function: a worker process leaves
    without Python's exit handlers, so W&B does not finish the run for you.

    Args:
        config: Logged as the run's config. A ``"wandb"`` key in it (Ray's older way to pass
            ``wandb.init`` arguments) is still read, with a ``DeprecationWarning``.
        api_key: W&B API key (sets ``WANDB_API_KEY``); without it W&B's own login applies.
        api_key_file: A file whose first line is the API key.
        rank_zero_only: ``False``: every rank starts its own run.
        **kwargs: Passed to ``wandb.init`` (``project``, ``entity``, ``mode``, ``dir``, ...).

    Returns:
        The ``wandb.Run``, or the no-op object on ranks that do not log.

    Raises:
        ImportError: W&B is not installed (on every rank).
        ValueError: Both ``api_key`` and ``api_key_file`` were given.

    Example::

        from ddptrain.integrations.wandb import setup_wandb

        def train_func(config):
            run = setup_wandb(config, project="my-project")
            for epoch in range(config["epochs"]):
                run.log({"loss": train_one_epoch()})
            run.finish()
    """
    where = _tracking.caller()
    if rank_zero_only and where.rank not in (None, 0):
        return _tracking.noop_if_installed("wandb", "wandb")
    wandb = _import_wandb()
    settings = dict(config or {})
    legacy = dict(settings.pop("wandb", None) or {})
    if legacy:
        warnings.warn(
            "A `wandb` key in the config of setup_wandb() is deprecated (as in Ray): pass its "
            "entries to setup_wandb() as keyword arguments.",
            DeprecationWarning,
            stacklevel=2,
        )
    _set_api_key(api_key or legacy.pop("api_key", None), api_key_file or legacy.pop("api_key_file", None))

    name = where.run_name
    if name is not None and not rank_zero_only and where.rank is not None:
        name = f"{name}_rank{where.rank}"
    init: dict[str, Any] = {
        "name": name,
        "group": os.environ.get(WANDB_GROUP_ENV_VAR) or where.run_name,
        "config": _loggable(settings),
        "allow_val_change": True,
    }
    if os.environ.get(WANDB_PROJECT_ENV_VAR):
        init["project"] = os.environ[WANDB_PROJECT_ENV_VAR]
    init.update(legacy)
    init.update(kwargs)
    remembered = False
    if "id" not in init and where.rank is not None:
        saved = _tracking.load_id(where, "wandb")
        init["id"] = saved["id"] if saved and isinstance(saved.get("id"), str) else uuid.uuid4().hex[:16]
        init.setdefault("resume", "allow")
        remembered = True
    run = wandb.init(**{key: value for key, value in init.items() if value is not None})
    if remembered:
        _tracking.save_id(where, "wandb", {"id": run.id})
    # Worker processes skip wandb's atexit handler: finish the run when the function ends
    # (a no-op if the user already called run.finish()).
    context.on_training_end(lambda failed: run.finish(exit_code=1 if failed else 0))
    return run


def _set_api_key(api_key: str | None, api_key_file: str | None) -> None:
    if api_key and api_key_file:
        raise ConfigError(
            "setup_wandb got both `api_key` and `api_key_file`: pass one of them (or neither, to "
            "use `WANDB_API_KEY` or `wandb login`)."
        )
    if api_key_file:
        with open(os.path.expanduser(api_key_file), encoding="utf-8") as f:
            api_key = f.readline().strip()
    if api_key:
        os.environ[WANDB_ENV_VAR] = api_key


def _loggable(value: Any) -> Any:
    """``value`` with what W&B's config cannot hold (objects, functions, NaN keys...) as strings."""
    if isinstance(value, Mapping):
        return {str(key): _loggable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_loggable(item) for item in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if getattr(value, "size", None) == 1 and callable(getattr(value, "item", None)):
        return _loggable(value.item())  # numpy and torch scalars
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value
