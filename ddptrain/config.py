"""User-facing configuration dataclasses, validated on construction (driver side).

``ScalingConfig`` lives in :mod:`ddptrain.scaling_config` and is imported from here too."""

from __future__ import annotations

import logging
import os
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ddptrain import _env
from ddptrain._checks import DEPRECATED, check_int, refuse_deprecated
from ddptrain.callbacks import UserCallback
from ddptrain.errors import ConfigError, ConfigTypeError
from ddptrain.scaling_config import ScalingConfig
from ddptrain.storage import remote

__all__ = [
    "ScalingConfig",
    "RunConfig",
    "CheckpointConfig",
    "FailureConfig",
    "DataConfig",
    "LoggingConfig",
    "ValidationConfig",
    "ValidationTaskConfig",
]


@dataclass
class CheckpointConfig:
    """Which checkpoints to keep.

    Args:
        num_to_keep: Keep this many best checkpoints by ``checkpoint_score_attribute`` (the
            newest without one) plus the latest, as Ray Train does: up to ``num_to_keep + 1``
            may be on disk, and ``Result.best_checkpoints`` lists only the best
            ``num_to_keep``. ``None`` keeps all.
        checkpoint_score_attribute: Metric used to rank checkpoints; ``None`` ranks by age.
            A nested metric is named by its path, as in Ray: ``"val/loss"``.
        checkpoint_score_order: ``"max"`` or ``"min"``: which end of the score is best.
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: Literal["max", "min"] = "max"
    checkpoint_frequency: Any = DEPRECATED
    checkpoint_at_end: Any = DEPRECATED

    def __post_init__(self) -> None:
        if self.num_to_keep is not None:
            check_int("num_to_keep", self.num_to_keep, 1)
        if self.checkpoint_score_order not in ("max", "min"):
            raise ConfigError(f"`checkpoint_score_order` must be 'max' or 'min', got {self.checkpoint_score_order!r}.")
        attribute = self.checkpoint_score_attribute
        if attribute is not None and (not isinstance(attribute, str) or not attribute.strip()):
            raise ConfigError(
                f"`checkpoint_score_attribute` must be a metric name (str), got {self.checkpoint_score_attribute!r}."
            )
        hint = "Call `ddptrain.report(..., checkpoint=...)` whenever you want a checkpoint."
        refuse_deprecated("CheckpointConfig", "checkpoint_frequency", self.checkpoint_frequency, hint)
        refuse_deprecated("CheckpointConfig", "checkpoint_at_end", self.checkpoint_at_end, hint)


def _check_fn_kwargs(owner: str, fn_kwargs: Any) -> None:
    if fn_kwargs is not None and (
        not isinstance(fn_kwargs, dict) or not all(isinstance(key, str) for key in fn_kwargs)
    ):
        raise ConfigError(
            f"`{owner}(fn_kwargs=...)` must be a dict of keyword arguments (str keys), got {fn_kwargs!r}."
        )


@dataclass
class ValidationTaskConfig:
    """The keyword arguments of one validation (Ray's name), passed to ``report(validation=...)``:
    ``fn(checkpoint, **fn_kwargs)``. They replace those of the trainer's ``ValidationConfig``.

    Args:
        fn_kwargs: Picklable keyword arguments of the validation function.
    """

    fn_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_fn_kwargs("ValidationTaskConfig", self.fn_kwargs)


@dataclass
class ValidationConfig:
    """Asynchronous validation of reported checkpoints (Ray's name), passed to the trainer.

    ``report(metrics, checkpoint=..., validation=True)`` (or a :class:`ValidationTaskConfig`)
    asks for ``fn(checkpoint, **fn_kwargs) -> dict`` to run on that checkpoint once it is
    committed, in a process of its own (not a training worker) on the driver's host or on
    ``host``, while training goes on. One validation runs at a time, in report order; its
    metrics are merged into the checkpoint's (same keys overwrite) and can rank it
    (``CheckpointConfig.checkpoint_score_attribute``). See the checkpoints guide.

    Args:
        fn: ``fn(checkpoint, **fn_kwargs) -> dict`` of metrics. It runs on CPU (no GPU is
            visible to it) unless ``ray_remote_kwargs`` asks for one.
        task_config: The default ``fn_kwargs``; a ``ValidationTaskConfig`` given to
            ``report()`` replaces them.
        ray_remote_kwargs: Ray's resource request; ddptrain reads ``num_gpus`` only (> 0: the
            GPUs of the host it runs on stay visible to ``fn``).
        host: ddptrain's own, keyword only: the name of one of the run's hosts
            (``ScalingConfig(hosts=...)``, as the host list writes it) to run the validations
            on, over SSH with that host's settings; ``None`` (default): the driver's host. ``fn``
            is imported there as the workers import the training function, and a checkpoint
            on the driver's disk is copied to the host first unless the host sees the run
            directory; ddptrain must be installed there, as for workers.

    Example:
        >>> def validate(checkpoint, data_path):
        ...     return {"accuracy": evaluate(checkpoint, data_path)}
        >>> TorchTrainer(train_func, validation_config=ValidationConfig(
        ...     validate, task_config=ValidationTaskConfig(fn_kwargs={"data_path": "/data/val"})))
    """

    fn: Any
    task_config: ValidationTaskConfig | None = None
    ray_remote_kwargs: dict[str, Any] | None = None
    host: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.host is not None and (not isinstance(self.host, str) or not self.host.strip()):
            raise ConfigError(
                f"`ValidationConfig(host=...)` must be the name of one of the run's hosts, or None (this "
                f"machine), got {self.host!r}."
            )
        if not callable(self.fn):
            raise ConfigError(
                f"`ValidationConfig(fn=...)` must be a function (checkpoint, **fn_kwargs) -> dict, got {self.fn!r}."
            )
        if self.task_config is not None and not hasattr(self.task_config, "fn_kwargs"):
            raise ConfigError(
                f"`ValidationConfig(task_config=...)` must be a ValidationTaskConfig, got {self.task_config!r}."
            )
        if self.task_config is not None:
            _check_fn_kwargs("ValidationTaskConfig", self.task_config.fn_kwargs)
        if self.ray_remote_kwargs is not None and not isinstance(self.ray_remote_kwargs, dict):
            raise ConfigError(
                f"`ValidationConfig(ray_remote_kwargs=...)` must be a dict, got {self.ray_remote_kwargs!r}."
            )

    @property
    def uses_gpu(self) -> bool:
        """Whether ``fn`` may see the driver's GPUs (``ray_remote_kwargs={"num_gpus": ...}``)."""
        return bool((self.ray_remote_kwargs or {}).get("num_gpus"))


@dataclass
class FailureConfig:
    """How many worker-group failures to survive.

    Args:
        max_failures: Restarts allowed after a failure; ``-1`` means unlimited, ``0`` fails at once.
    """

    max_failures: int = 0
    controller_failure_limit: int = -1
    fail_fast: Any = DEPRECATED

    def __post_init__(self) -> None:
        check_int("max_failures", self.max_failures, -1)
        check_int("controller_failure_limit", self.controller_failure_limit, -1)
        refuse_deprecated("FailureConfig", "fail_fast", self.fail_fast, "Use `max_failures=0`.")


@dataclass
class LoggingConfig:
    """Log level of the ``ddptrain`` logger in worker processes.

    Args:
        log_level: A :mod:`logging` level name such as ``"INFO"`` or ``"DEBUG"``.
    """

    log_level: str = "INFO"

    def __post_init__(self) -> None:
        level = str(self.log_level).upper()
        if not isinstance(logging.getLevelName(level), int):
            raise ConfigError(f"`log_level` must be a logging level name, got {self.log_level!r}.")
        self.log_level = level


@dataclass
class DataConfig:
    """Which trainer datasets are split across workers.

    Args:
        datasets_to_split: ``"all"`` (the default) or a list of dataset names. A split dataset
            gives each worker an equal, contiguous range of ``count() // num_workers`` rows, so
            every rank runs the same number of batches; the last ``count() % num_workers``
            rows are left out (as Ray's ``equal=True``). Datasets not split are given whole to
            every worker.
        execution_options: Accepted for compatibility with Ray; ignored.
        enable_shard_locality: Accepted for compatibility with Ray; ignored.
    """

    datasets_to_split: str | list[str] = "all"
    execution_options: Any = None
    enable_shard_locality: bool = True

    def __post_init__(self) -> None:
        split = self.datasets_to_split
        if split != "all" and (not isinstance(split, (list, tuple)) or not all(isinstance(n, str) for n in split)):
            raise ConfigTypeError(
                f"`datasets_to_split` must be 'all' or a list of dataset names, got {type(split).__name__} "
                f'{split!r}. Pass e.g. `datasets_to_split=["train"]`.'
            )


@dataclass
class RunConfig:
    """Where a run's results go and how it behaves.

    Args:
        name: Run name, the folder under ``storage_path``. Default: ``DDPTRAIN_RUN_NAME`` if set,
            else ``ddptrain_run-<timestamp>``.
        storage_path: Folder for runs (``~`` expanded, ``Path`` accepted), or a URI such as
            ``s3://bucket/prefix`` (any scheme fsspec resolves; needs e.g. ``ddptrain[s3]``).
            Default: ``~/ddptrain_results`` (or ``$DDPTRAIN_STORAGE_PATH``).
        storage_filesystem: An fsspec or ``pyarrow.fs`` file system; ``storage_path`` is then a
            path on it (``bucket/prefix``, no scheme; default: the default storage path), and so
            are the paths ddptrain returns. It is never saved with the run (it may hold
            credentials): ``restore()`` takes it again.
        failure_config: Restart policy, see :class:`FailureConfig`.
        checkpoint_config: Retention policy, see :class:`CheckpointConfig`.
        callbacks: :class:`~ddptrain.UserCallback` objects run in the driver.
        worker_runtime_env: ``{"env_vars": {...}}`` sets environment variables in every worker;
            ``{"py_modules": [module, ...]}`` ships those modules' code with the training function
            (pickled by value), for hosts that do not have them.
        logging_config: Log level of the ``ddptrain`` logger in workers.
    """

    name: str | None = None
    storage_path: str | os.PathLike[str] | None = None
    storage_filesystem: Any = None
    failure_config: FailureConfig | None = None
    checkpoint_config: CheckpointConfig | None = None
    callbacks: list[UserCallback] | None = None
    worker_runtime_env: dict[str, Any] | None = None
    logging_config: LoggingConfig | None = None
    sync_config: Any = DEPRECATED
    verbose: Any = DEPRECATED
    stop: Any = DEPRECATED
    progress_reporter: Any = DEPRECATED
    log_to_file: Any = DEPRECATED

    def __post_init__(self) -> None:
        for name in ("sync_config", "verbose", "stop", "progress_reporter", "log_to_file"):
            refuse_deprecated("RunConfig", name, getattr(self, name), "Remove it.")
        if self.name is not None:
            if not isinstance(self.name, str) or not self.name.strip():
                raise ConfigError(f"`name` must be a non-empty string, got {self.name!r}.")
            if "/" in self.name or self.name in (".", ".."):
                raise ConfigError(
                    f"`name` must be a plain folder name without '/', got {self.name!r}. "
                    "Put the parent folders in `storage_path`."
                )
            if any(ord(c) < 32 or ord(c) == 127 for c in self.name):
                raise ConfigError(
                    f"`name` must not hold control characters (a newline, a tab, NUL), got {self.name!r}."
                )
            if len(os.fsencode(self.name)) > 255:
                raise ConfigError(
                    f"`name` is {len(os.fsencode(self.name))} bytes long, but a folder name holds at most 255: "
                    f"shorten {self.name[:40]!r}..."
                )
        if self.storage_path is not None and not isinstance(self.storage_path, (str, os.PathLike)):
            raise ConfigError(f"`storage_path` must be a path or a URI, got {self.storage_path!r}.")
        if self.storage_filesystem is not None:
            remote.to_fsspec(self.storage_filesystem)  # not a file system: an error now, not at fit()
        self.failure_config = self.failure_config or FailureConfig()
        self.checkpoint_config = self.checkpoint_config or CheckpointConfig()
        self.logging_config = self.logging_config or LoggingConfig()
        _check_containers(self)
        self.callbacks = list(self.callbacks or [])
        self.worker_runtime_env = dict(self.worker_runtime_env or {})
        _check_types(self)

    def _remote(self) -> Any:
        """The run's :class:`~ddptrain.remote.RemoteRoot`, or ``None`` for local storage.

        Raises:
            ConfigError: The URI's file system is not installed or cannot hold a run.
        """
        raw = os.fspath(self.storage_path) if self.storage_path is not None else None
        return remote.resolve(raw, self.storage_filesystem)

    def _storage_root(self) -> Path:

        raw = os.fspath(self.storage_path) if self.storage_path is not None else None
        if raw is not None and raw.startswith("file://"):
            raw = raw[len("file://") :]
        return Path(os.path.expanduser(raw or _env.default_storage_path())).absolute()

    def _check_storage(self) -> None:
        """Raise ConfigError, naming the path, if the run's folder cannot be created or written
        (called by ``fit()`` before any process starts). Remote storage is probed with a small
        object (a missing bucket fails here)."""
        remote_root = self._remote()
        if remote_root is not None:
            remote_root.check_writable()
            return
        root = self._storage_root()
        existing = root / self.name if self.name else root
        while not os.path.lexists(existing) and existing.parent != existing:
            existing = existing.parent
        hint = "Set `RunConfig(storage_path=...)` (or DDPTRAIN_STORAGE_PATH) to a folder you can write to."
        if not existing.is_dir():
            raise ConfigError(f"`storage_path` {root} cannot hold the run: {existing} is not a folder. {hint}")
        try:
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as exc:
            raise ConfigError(
                f"`storage_path` {root} cannot hold the run: cannot write in {existing} ({exc.strerror or exc}). {hint}"
            ) from exc

    def _env_vars(self) -> dict[str, str]:
        env = (self.worker_runtime_env or {}).get("env_vars") or {}
        return {str(k): str(v) for k, v in env.items()}


def _check_containers(run_config: RunConfig) -> None:
    """``callbacks`` must be a list and ``worker_runtime_env`` a dict: a single callback, or a
    list of env vars, failed with Python's "object is not iterable" or "dictionary update
    sequence" errors."""
    callbacks = run_config.callbacks
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        hint = " Pass a list: `callbacks=[callback]`." if isinstance(callbacks, UserCallback) else ""
        raise ConfigError(f"`callbacks` must be a list of ddptrain.UserCallback objects, got {callbacks!r}.{hint}")
    runtime_env = run_config.worker_runtime_env
    if runtime_env is not None and not isinstance(runtime_env, dict):
        raise ConfigError(
            f"`worker_runtime_env` must be a dict such as `{{'env_vars': {{'NAME': 'value'}}}}`, got {runtime_env!r}."
        )


def _check_types(run_config: RunConfig) -> None:

    expected = (
        ("failure_config", FailureConfig),
        ("checkpoint_config", CheckpointConfig),
        ("logging_config", LoggingConfig),
    )
    for name, cls in expected:
        value = getattr(run_config, name)
        if not isinstance(value, cls):
            raise ConfigError(f"`{name}` must be a ddptrain.{cls.__name__}, got {value!r}.")
    for callback in run_config.callbacks or []:
        if not isinstance(callback, UserCallback):
            raise ConfigError(f"`callbacks` must hold ddptrain.UserCallback objects, got {callback!r}.")
    runtime_env = run_config.worker_runtime_env or {}
    unknown = set(runtime_env) - {"env_vars", "py_modules"}
    if unknown:
        raise ConfigError(
            f"`worker_runtime_env` supports only 'env_vars' and 'py_modules', got {sorted(unknown)}. "
            "Install packages on the hosts yourself."
        )
    for module in runtime_env.get("py_modules", []):
        if not isinstance(module, types.ModuleType):
            raise ConfigError(
                f"`worker_runtime_env['py_modules']` must list imported modules, got {module!r}. "
                "Import the module and pass it: `py_modules=[my_module]`."
            )
    env_vars = runtime_env.get("env_vars", {})
    if not isinstance(env_vars, dict):
        raise ConfigError(f"`worker_runtime_env['env_vars']` must be a dict, got {env_vars!r}.")
