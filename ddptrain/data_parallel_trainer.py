"""``DataParallelTrainer``: validate the user's function and configs, then run ``fit()``."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import os
import posixpath
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import cloudpickle

from ddptrain import _env
from ddptrain.backend import BackendConfig
from ddptrain.base_trainer import PREPROCESSOR_DEPRECATION_MESSAGE, BaseTrainer
from ddptrain.checkpoint import Checkpoint
from ddptrain.config import DataConfig, RunConfig, ScalingConfig, ValidationConfig
from ddptrain.data.ingest import DatasetIngest, check_datasets
from ddptrain.errors import ConfigError
from ddptrain.result import Result
from ddptrain.storage import remote
from ddptrain.storage.checkpoint_manager import RunDirectoryError
from ddptrain.storage.layout import RunLayout
from ddptrain.storage.ownership import check_own_folder

if TYPE_CHECKING:
    from ddptrain.driver.run import Run

__all__ = ["DataParallelTrainer"]

_logger = logging.getLogger(__name__)


def _takes_config(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes the config argument; raises ConfigError for 2+ required arguments,
    and for a generator or ``async`` function (calling one runs none of its body)."""
    name = getattr(fn, "__name__", fn)
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise ConfigError(
            f"The training function `{name}` is a generator function (it uses `yield`): calling it runs none of "
            "its body. Report progress with `ddptrain.report(...)` instead of `yield`."
        )
    if inspect.iscoroutinefunction(fn):
        raise ConfigError(
            f"The training function `{name}` is an `async def` function: calling it runs none of its body. "
            f"Pass a plain function that runs it, e.g. `def train_func(config): asyncio.run({name}(config))`."
        )
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(required) > 1:
        names = ", ".join(p.name for p in required)
        raise ConfigError(
            f"The training function must take 0 or 1 arguments (the `train_loop_config` dict), "
            f"but `{name}` requires {len(required)}: {names}."
        )
    return bool(positional) or any(p.kind == p.VAR_POSITIONAL for p in params)


class DataParallelTrainer(BaseTrainer):
    """Runs ``train_loop_per_worker`` on every worker: SPMD data-parallel training.

    Args:
        train_loop_per_worker: The training function, taking no argument or the
            ``train_loop_config`` dict. Rank 0's return value becomes ``Result.return_value``.
        train_loop_config: Passed to the training function when it takes an argument.
        backend_config: Sets up the workers (e.g. a torch process group); ``None`` sets up nothing.
        scaling_config: Number of workers and devices (default: one CPU worker).
        run_config: Name, storage and policies of the run.
        datasets: Named datasets (a ``ddptrain.data.Dataset``, or a function without arguments
            that builds one, called again at every start of the worker group); each worker
            reads its shard with ``get_dataset_shard(name)``.
        dataset_config: Which datasets are split across workers (default: all).
        resume_from_checkpoint: A checkpoint the run starts from (``get_checkpoint()``).
        validation_config: Validates the checkpoints reported with ``report(...,
            validation=True)`` in a process of their own while training goes on
            (:class:`~ddptrain.ValidationConfig`; see the checkpoints guide).
        preprocessor: Deprecated in Ray 2.7: raises ``DeprecationWarning`` with Ray's text
            (preprocess the dataset before passing it).

    Example:
        >>> def train_loop():
        ...     ddptrain.report({"rank": ddptrain.get_context().get_world_rank()})
        >>> result = DataParallelTrainer(train_loop, scaling_config=ScalingConfig(num_workers=2)).fit()
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        backend_config: BackendConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        metadata: dict[str, Any] | None = None,
        validation_config: Any = None,
        preprocessor: Any = None,
    ) -> None:
        if preprocessor is not None:
            raise DeprecationWarning(PREPROCESSOR_DEPRECATION_MESSAGE)
        if not callable(train_loop_per_worker):
            raise ConfigError(
                f"`train_loop_per_worker` must be a function, got {train_loop_per_worker!r}. "
                "Pass the function itself (`train_func`), not its result (`train_func()`)."
            )
        if metadata is not None:
            raise DeprecationWarning("`metadata` is not supported (as in Ray Train V2).")
        if validation_config is not None and not isinstance(validation_config, ValidationConfig):
            raise ConfigError(
                "`validation_config` must be a ddptrain.ValidationConfig(fn, task_config=...), "
                f"got {validation_config!r}."
            )
        self.validation_config = validation_config
        self.train_loop_per_worker = train_loop_per_worker
        self._takes_config = _takes_config(train_loop_per_worker)
        self.train_loop_config = train_loop_config
        self.backend_config = backend_config if backend_config is not None else BackendConfig()
        self.scaling_config = scaling_config if scaling_config is not None else ScalingConfig()
        self.run_config = run_config if run_config is not None else RunConfig()
        if datasets is not None and not isinstance(datasets, Mapping):
            raise ConfigError(
                f"`datasets` must be a dict of named datasets, e.g. `datasets={{'train': ds}}`, got "
                f"{type(datasets).__name__}."
            )
        self.datasets = dict(datasets or {})
        self.dataset_config = dataset_config if dataset_config is not None else DataConfig()
        self.resume_from_checkpoint = resume_from_checkpoint
        self._dataset_names: list[str] = []
        self._validate()

    def _validate(self) -> None:
        checks = (
            ("scaling_config", self.scaling_config, ScalingConfig),
            ("run_config", self.run_config, RunConfig),
            ("backend_config", self.backend_config, BackendConfig),
            ("dataset_config", self.dataset_config, DataConfig),
        )
        for name, value, cls in checks:
            if not isinstance(value, cls):
                raise ConfigError(f"`{name}` must be a ddptrain.{cls.__name__}, got {value!r}.")
        # Configs are plain dataclasses; check again in case fields were changed after creation.
        self.scaling_config.__post_init__()
        self.run_config.__post_init__()
        if self.train_loop_config is not None and not isinstance(self.train_loop_config, dict):
            raise ConfigError(f"`train_loop_config` must be a dict, got {type(self.train_loop_config).__name__}.")
        if self.resume_from_checkpoint is not None and not isinstance(self.resume_from_checkpoint, Checkpoint):
            raise ConfigError(
                f"`resume_from_checkpoint` must be a ddptrain.Checkpoint, got {self.resume_from_checkpoint!r}."
            )
        check_datasets(self.datasets, self.dataset_config)

    def _payload(self) -> bytes:
        # Datasets are not in it: each start of the group sends its workers shard specs.
        user = {
            "train_fn": self.train_loop_per_worker,
            "train_loop_config": self.train_loop_config or {},
            "takes_config": self._takes_config,
            "backend_config": self.backend_config,
        }
        shipped = list((self.run_config.worker_runtime_env or {}).get("py_modules", []))
        for module in shipped:
            cloudpickle.register_pickle_by_value(module)
        try:
            payload: bytes = cloudpickle.dumps(user)
        except Exception as exc:
            name = getattr(self.train_loop_per_worker, "__name__", repr(self.train_loop_per_worker))
            raise ConfigError(
                f"Could not pickle the training function `{name}`, its `train_loop_config` or the "
                f"backend config: {exc!r}. Everything the function uses from "
                "outside must be picklable: create locks, open files, sockets and clients inside "
                "the function instead."
            ) from exc
        finally:
            for module in shipped:
                cloudpickle.unregister_pickle_by_value(module)
        return payload

    def _trainer_bytes(self) -> bytes | None:
        # Datasets are left out (they are in the payload already); restore() asks for them again.
        saved = copy.copy(self)
        saved.datasets = {}
        saved._dataset_names = sorted(self.datasets)
        # File systems are left out too: they may hold credentials, and trainer.pkl is as readable
        # as the bucket. restore() takes the run's file system from its caller again (or builds it
        # from the run's URI and the environment); a remote start checkpoint keeps only its path.
        saved.run_config = copy.copy(self.run_config)
        saved.run_config.storage_filesystem = None
        start = self.resume_from_checkpoint
        if start is not None and start.is_remote:
            saved.resume_from_checkpoint = None
            saved.__dict__["_resume_from_path"] = start.path
        try:
            data: bytes = cloudpickle.dumps(saved)
        except Exception as exc:
            _logger.warning("ddptrain: the trainer cannot be pickled, so `restore()` will not work: %r", exc)
            return None
        return data

    def get_dataset_config(self) -> DataConfig:
        """A copy of this trainer's dataset config (the ``dataset_config`` given, or the default)."""
        return copy.copy(self.dataset_config)

    def setup(self) -> None:
        """Called by :meth:`fit` (in the driver, before any worker starts) to set up the trainer.

        Override it in a subclass for setup that should run at ``fit()`` rather than in
        ``__init__``; it runs once per ``fit()`` call, and an error in it fails ``fit()`` at once.
        The default does nothing.
        """

    def fit(self) -> Result:
        """Run training on the workers and return the :class:`~ddptrain.Result`.

        Raises:
            TrainingFailedError: A worker failed and no restarts are left.
            ConfigError: The configs or the function cannot work.
        """
        if _env.loading_training_function():
            raise ConfigError(
                "`fit()` was called while a ddptrain worker was loading the training function: the "
                "module that defines it starts training when it is imported. Put the code that "
                'builds the trainer and calls `fit()` under `if __name__ == "__main__":`.'
            )
        self.setup()
        self._validate()
        if self.scaling_config.num_workers == 0:
            return self._fit_local()
        self._check_before_start()
        datasets = DatasetIngest(self.datasets, self.dataset_config, self.scaling_config.max_workers)
        from ddptrain.driver.controller import Controller  # imports torch, as `Run` below

        return Controller(self._new_run(self._payload(), datasets)).fit()

    def _new_run(self, payload: bytes, datasets: DatasetIngest | None) -> Run:
        """The driver's state of one ``fit()`` (``payload``: the pickled function, for workers)."""
        from ddptrain.driver.run import Run  # imports torch (seconds): `import ddptrain` stays light until fit()

        run = Run(
            payload=payload,
            trainer_bytes=self._trainer_bytes(),
            train_loop_config=self.train_loop_config,
            scaling_config=self.scaling_config,
            run_config=self.run_config,
            backend_config=self.backend_config,
            dataset_config=self.dataset_config,
            datasets=datasets,
            validation_config=getattr(self, "validation_config", None),  # a trainer saved before it existed
        )
        run.start_checkpoint = self.resume_from_checkpoint
        return run

    def _check_before_start(self) -> None:
        """Fail at once, before torch is imported or any process starts, on what cannot work:
        a storage path that cannot hold the run, or a bad ``DDPTRAIN_CONSOLE_RANKS`` or
        ``DDPTRAIN_VALIDATION_*``."""
        self.run_config._check_storage()
        try:
            ranks = _env.console_ranks()
            _env.validation_timeout_s(), _env.validation_wait_s(), _env.validation_cpus()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        unknown = sorted(r for r in ranks or () if r >= self.scaling_config.max_workers)
        if unknown:
            _logger.warning(
                "ddptrain: DDPTRAIN_CONSOLE_RANKS names rank(s) %s, but the run has %d worker(s)",
                unknown,
                self.scaling_config.max_workers,
            )

    def _fit_local(self) -> Result:
        """Local mode: run the function in this process, as rank 0 of 1, with the run's
        storage (metrics, checkpoints, retention, resume) as for a worker group."""
        from ddptrain.driver.local_run import fit_local  # imports torch, as above

        self._check_before_start()
        run = self._new_run(b"", None)  # the function runs here: nothing to pickle
        datasets = DatasetIngest(self.datasets, self.dataset_config, 1)

        def call() -> Any:
            with self.backend_config.train_func_context():
                fn = self.train_loop_per_worker
                return fn(self.train_loop_config or {}) if self._takes_config else fn()

        try:
            return fit_local(run, call, datasets.local_iterators(), self.run_config.name or run.name)
        finally:
            datasets.release()

    def as_trainable(self) -> Any:
        """This trainer as a trainable for ``ddptrain.tune`` (``tune.run(trainer.as_trainable(), ...)``);
        a sweep's ``config`` overrides the trainer's constructor arguments, as with ``Tuner``."""
        from ddptrain.tune.trainable import as_trainable  # the sweep layer is imported only when used

        return as_trainable(self)

    @classmethod
    def can_restore(cls, path: str | os.PathLike[str], storage_filesystem: Any = None) -> bool:
        """Whether ``path`` is a run directory that :meth:`restore` can continue (a local path,
        a URI, or a path on ``storage_filesystem``)."""
        root = remote.resolve(os.fspath(path), storage_filesystem)
        if root is not None:
            return root.exists(root.path(RunLayout.TRAINER))
        return RunLayout(os.path.expanduser(os.fspath(path).removeprefix("file://"))).trainer.exists()

    @classmethod
    def _read_saved(cls, path: str, storage_filesystem: Any) -> tuple[bytes, str, str, str]:
        """The bytes of ``trainer.pkl`` of the run at ``path``, where the run is as users see it,
        its name and its storage path.

        Raises:
            RunDirectoryError: There is no ``trainer.pkl`` there.
        """
        root = remote.resolve(path, storage_filesystem)
        if root is None:
            run_dir = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
            try:
                check_own_folder(run_dir)  # what it unpickles must be the user's own
                data = RunLayout(run_dir).trainer.read_bytes()
            except FileNotFoundError:
                data = None
            shown, name, parent = run_dir, os.path.basename(run_dir), os.path.dirname(run_dir)
        else:
            data = root.read_bytes(root.path(RunLayout.TRAINER))
            shown, name = root.display(), posixpath.basename(root.root)
            base, _, query = path.partition("?")  # a URI's options stay with its storage path
            parent = base.rstrip("/").rpartition("/")[0] + (f"?{query}" if query else "")
            if storage_filesystem is not None:
                parent = posixpath.dirname(root.root)
        if data is None:
            hint = (
                ""
                if storage_filesystem is not None or root is not None
                else (" A run on a `storage_filesystem` needs it again: `restore(path, storage_filesystem=fs)`.")
            )
            raise RunDirectoryError(f"{shown} cannot be restored: it has no {RunLayout.TRAINER}.{hint}")
        return data, shown, name, parent

    @classmethod
    def restore(
        cls,
        path: str | os.PathLike[str],
        train_loop_per_worker: Callable[..., Any] | None = None,
        train_loop_config: dict[str, Any] | None = None,
        storage_filesystem: Any = None,
        **kwargs: Any,
    ) -> DataParallelTrainer:
        """The trainer of an interrupted run, set to resume it from its latest checkpoint.

        Args:
            path: The run directory (``<storage_path>/<name>``): a local path, a URI
                (``s3://bucket/prefix/name``: its file system is built from the environment, as
                at the start), or a path on ``storage_filesystem``.
            train_loop_per_worker: Replaces the saved training function.
            train_loop_config: Replaces the saved config.
            storage_filesystem: The file system the run is on, when it was given one: ddptrain
                never saves file systems (they may hold credentials), so pass it again (as Ray's
                ``restore(path, storage_filesystem=...)``).
            **kwargs: Other constructor arguments to replace (``datasets``, ``scaling_config``...).

        Raises:
            RunDirectoryError: ``path`` holds no restorable run.
        """
        data, shown, name, parent = cls._read_saved(os.fspath(path), storage_filesystem)
        try:
            trainer = cloudpickle.loads(data)
        except Exception as exc:
            raise RunDirectoryError(f"{shown}/{RunLayout.TRAINER} cannot be loaded: {exc!r}.") from exc
        if not isinstance(trainer, cls):
            raise RunDirectoryError(
                f"{shown}/{RunLayout.TRAINER} holds a {type(trainer).__name__}, not a {cls.__name__}."
            )
        if train_loop_per_worker is not None:
            trainer.train_loop_per_worker = train_loop_per_worker
            trainer._takes_config = _takes_config(train_loop_per_worker)
        if train_loop_config is not None:
            trainer.train_loop_config = train_loop_config
        needed = getattr(trainer, "_dataset_names", [])
        if needed and "datasets" not in kwargs:
            raise ConfigError(
                f"The run in {shown} used the datasets {needed}; pass them again: `restore(path, datasets={{...}})`."
            )
        # A remote start checkpoint was saved without its file system.
        start = trainer.__dict__.pop("_resume_from_path", None)
        if start is not None and "resume_from_checkpoint" not in kwargs:
            if remote.is_uri(start):
                trainer.resume_from_checkpoint = Checkpoint(start)
            elif storage_filesystem is not None:
                trainer.resume_from_checkpoint = Checkpoint(start, filesystem=storage_filesystem)
            else:
                raise ConfigError(
                    f"The run in {shown} started from the checkpoint {start!r} on a file system ddptrain does "
                    "not save; pass it again: `restore(path, storage_filesystem=fs)` or "
                    "`restore(path, resume_from_checkpoint=Checkpoint(path, filesystem=fs))`."
                )
        for key, value in kwargs.items():
            if not hasattr(trainer, key):
                raise ConfigError(f"`restore()` got an unknown argument {key!r}.")
            setattr(trainer, key, value)
        trainer.run_config = dataclasses.replace(
            trainer.run_config, name=name, storage_path=parent, storage_filesystem=storage_filesystem
        )
        trainer._validate()
        return trainer
