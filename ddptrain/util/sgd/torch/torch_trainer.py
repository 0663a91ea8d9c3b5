"""RaySGD's ``TorchTrainer`` (driver side): workers started once, ``train()``/``validate()``
called on them as often as the program likes, and restarted from the last state when one dies.

Each worker holds one :class:`TrainingOperator` (``_runner``); the trainer runs functions on
them through a :class:`~ddptrain.worker_group.WorkerGroup`, which ``_workers`` holds and
replaces. After every successful ``train()`` rank 0's state (models, optimizers, schedulers,
scaler, operator state) comes back with the metrics and stays on the driver: that is what a
restarted group resumes from. This module decides when to retry and when to grow back.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch

from ddptrain import _env
from ddptrain.config import ScalingConfig
from ddptrain.errors import ConfigError, LaunchError, WorkerGroupError
from ddptrain.launch.hosts import HostSpec, parse_hosts
from ddptrain.torch.config import TorchConfig
from ddptrain.util.sgd.torch import _local, _runner, _tune
from ddptrain.util.sgd.torch._arguments import check_arguments
from ddptrain.util.sgd.torch._recovery import discard, first_line, lost_worker
from ddptrain.util.sgd.torch._tune import BaseTorchTrainable
from ddptrain.util.sgd.torch._workers import State, Workers
from ddptrain.util.sgd.torch.training_operator import TrainingOperator
from ddptrain.util.sgd.utils import BATCH_SIZE, reduce_worker_stats
from ddptrain.worker_group import WorkerGroup

__all__ = ["BaseTorchTrainable", "TorchTrainer", "process_group_timeout_s"]

_logger = logging.getLogger(__name__)
_GROW_INTERVAL_S = 60.0  # a shrunken group tries to get back to num_workers at most this often


def process_group_timeout_s(backend: str, use_gpu: bool, timeout_s: int) -> int:
    """The process group's timeout: ``NCCL_TIMEOUT_S`` (RaySGD's variable) when it is set and
    the group is nccl's (``backend="nccl"``, or ``"auto"`` with GPUs), else ``timeout_s``."""
    nccl = backend == "nccl" or (backend == "auto" and use_gpu)
    from_env = _env.nccl_timeout_s() if nccl else None
    return int(from_env) if from_env is not None else timeout_s


class TorchTrainer:
    """Train a :class:`TrainingOperator` on ``num_workers`` worker processes, epoch by epoch.

    The workers start in the constructor (each runs ``initialization_hook``, then builds the
    operator, whose ``setup(config)`` runs there) and live until :meth:`shutdown` or the end
    of a ``with`` block. ``config[BATCH_SIZE]`` (the key ``"*batch_size"``) is a global batch
    size: each worker gets ``config[BATCH_SIZE] // num_workers`` (rounded down, with a warning
    when it does not divide evenly); any other key, ``"batch_size"`` included, reaches every
    worker unchanged.

    Args:
        training_operator_cls: Your :class:`TrainingOperator` subclass.
        initialization_hook: Run on each worker before the operator is built (environment
            variables, logging).
        config: Passed to ``setup(config)`` on every worker.
        num_workers: Worker processes (ranks).
        num_cpus_per_worker: CPUs per worker (sets ``OMP_NUM_THREADS``).
        use_gpu: One CUDA device per worker; ``"auto"``: if this machine has CUDA.
        backend: ``"gloo"``, ``"nccl"``, or ``"auto"`` (nccl with GPUs, else gloo).
        wrap_ddp: Wrap registered models in ``DistributedDataParallel`` (2+ workers).
        timeout_s: Timeout of the process group's collectives. On nccl the environment variable
            ``NCCL_TIMEOUT_S`` (RaySGD's), when set, replaces it.
        use_fp16: Mixed precision with ``torch.amp`` (autocast and a ``GradScaler``; bfloat16
            autocast on CPU). ``"apex"`` is accepted and means the same (Apex is not used).
        use_tqdm: A progress bar on rank 0 (plain status lines without tqdm).
        apex_args: Accepted for compatibility and ignored, with a warning.
        add_dist_sampler: Give registered ``DataLoader``s a ``DistributedSampler``.
        scheduler_step_freq: ``"batch"``, ``"epoch"``, ``"manual"`` (:meth:`update_scheduler`),
            or ``None`` (no schedulers may be registered).
        use_local: Rank 0 runs in this (the driver's) process, in the thread that calls
            ``train()``/``validate()``..., so that ``pdb``/``ipdb`` in your operator reads this
            terminal; the other ranks in worker processes, all in one gloo group. CPU only, on
            this machine (``use_gpu="auto"`` means no GPU; not with ``use_gpu=True`` or ``hosts``); one
            such trainer per process at a time.
        serialize_data_creation: ``True``: each worker's ``setup``, up to its ``register`` call
            (where models are wrapped in DDP, which needs every worker), runs under a
            machine-wide file lock, one worker of a host at a time: create your data before
            ``register``. ``TrainingOperator.from_creators(serialize_data_creation=True)`` locks
            its ``data_creator`` the same way. ``None`` (default) or ``False``: all at once.
        hosts: ddptrain's own: an SSH host list (as ``ScalingConfig(hosts=...)`` takes it).
        log_dir: ddptrain's own: a folder for one log file per rank.

    Example:
        >>> with TorchTrainer(training_operator_cls=MyOperator, num_workers=2,
        ...                   config={"lr": 0.01, BATCH_SIZE: 64}) as trainer:   # doctest: +SKIP
        ...     for _ in range(5):
        ...         print(trainer.train(), trainer.validate())
        ...     model = trainer.get_model()
    """

    def __init__(
        self,
        *,
        training_operator_cls: type[TrainingOperator],
        initialization_hook: Callable[[], Any] | None = None,
        config: dict[str, Any] | None = None,
        num_workers: int = 1,
        num_cpus_per_worker: float = 1,
        use_gpu: bool | str = "auto",
        backend: str = "auto",
        wrap_ddp: bool = True,
        timeout_s: int = 1800,
        use_fp16: bool | str = False,
        use_tqdm: bool = False,
        apex_args: dict[str, Any] | None = None,
        add_dist_sampler: bool = True,
        scheduler_step_freq: str | None = None,
        use_local: bool = False,
        serialize_data_creation: bool | None = None,
        hosts: str | os.PathLike[str] | list[Any] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if use_local and use_gpu == "auto":
            use_gpu = False  # rank 0 in this process runs on the CPU
        use_gpu = check_arguments(
            training_operator_cls=training_operator_cls,
            num_workers=num_workers,
            scheduler_step_freq=scheduler_step_freq,
            use_gpu=use_gpu,
            use_fp16=use_fp16,
            apex_args=apex_args,
            config=config,
        )
        self.training_operator_cls = training_operator_cls
        self.initialization_hook = initialization_hook
        self.config: dict[str, Any] = dict(config or {})
        self.num_workers = num_workers
        self.use_gpu = use_gpu
        if use_local and (use_gpu or hosts is not None):
            raise ConfigError(
                "`use_local=True` runs rank 0 in this process on the CPU, with the other ranks on this machine: "
                f"it cannot be combined with use_gpu=True or hosts (got use_gpu={use_gpu!r}, hosts={hosts!r})."
            )
        self.use_local = use_local
        self._num_cpus_per_worker = num_cpus_per_worker
        self._backend_config = TorchConfig(
            backend=None if backend == "auto" else backend,
            timeout_s=process_group_timeout_s(backend, use_gpu, timeout_s),
        )
        self._options = {
            "use_fp16": bool(use_fp16),
            "use_tqdm": use_tqdm,
            "wrap_ddp": wrap_ddp,
            "add_dist_sampler": add_dist_sampler,
            "scheduler_step_freq": scheduler_step_freq,
            "serialize_data_creation": bool(serialize_data_creation),
        }
        self._hosts: list[HostSpec] | None = parse_hosts(hosts) if hosts is not None else None
        self._log_dir = log_dir
        # A local operator (get_local_operator), and the worker group generation it was built for.
        self._local: tuple[int, _runner.Runner] | None = None
        self._workers = Workers(self._start, num_workers, self._hosts)

    # ----------------------------------------------------------------- workers
    @property
    def worker_count(self) -> int:
        """Workers running now (fewer than ``num_workers`` after a failure that shrank the group)."""
        return self._workers.count

    def _worker_config(self, workers: int) -> dict[str, Any]:
        config = dict(self.config)
        if BATCH_SIZE in config:
            total = config[BATCH_SIZE]
            if total % workers:
                _logger.warning(
                    "ddptrain: changing the global batch size from %d to %d to divide it evenly among %d workers",
                    total,
                    total // workers * workers,
                    workers,
                )
            config[BATCH_SIZE] = max(1, total // workers)
        return config

    def _start(self, workers: int, hosts: list[HostSpec] | None, state: State) -> WorkerGroup:
        if self.use_local:  # rank 0 here, joined to the others' process group
            group = _local.launch(workers, self._num_cpus_per_worker, self._log_dir, self._backend_config.timeout_s)
        else:
            scaling = ScalingConfig(
                num_workers=workers,
                use_gpu=self.use_gpu,
                resources_per_worker={"CPU": self._num_cpus_per_worker},
                hosts=list(hosts) if hosts is not None else None,
            )
            group = WorkerGroup.launch(scaling, backend_config=self._backend_config, log_dir=self._log_dir)
        try:
            group.execute(
                _runner.setup,
                self.training_operator_cls,
                self._worker_config(workers),
                self._options,
                self.initialization_hook,
                state,
            )
        except BaseException:
            discard(group)
            raise
        return group

    def _maybe_grow(self) -> None:
        """Back to ``num_workers`` when they can start again (tried at most every ``_GROW_INTERVAL_S``:
        each try starts a whole group)."""
        workers = self._workers
        if workers.group is None or workers.count >= self.num_workers:
            return
        if time.monotonic() - workers.last_resize < _GROW_INTERVAL_S:
            return
        workers.last_resize = time.monotonic()
        try:
            state = self.state_dict()
            group = self._start(self.num_workers, self._hosts, state)
        except (LaunchError, WorkerGroupError) as exc:
            _logger.info("ddptrain: still fewer workers than num_workers: %s", exc)
            return
        _logger.warning("ddptrain: back to %d workers", self.num_workers)
        workers.replace(group, state)

    # ----------------------------------------------------------------- training
    def train(
        self,
        num_steps: int | None = None,
        profile: bool = False,
        reduce_results: bool = True,
        max_retries: int = 3,
        info: dict[str, Any] | None = None,
    ) -> Any:
        """One epoch (or ``num_steps`` batches) of ``train_epoch`` on every worker.

        If a worker dies meanwhile, the group is replaced (as many workers as will start,
        up to ``num_workers``), restored from the state after the last successful call, and
        the epoch runs again, up to ``max_retries`` times. An exception raised by your
        operator is not retried.

        Returns:
            With ``reduce_results``: ``num_samples`` summed over workers, ``epoch``,
            ``batch_count``, ``train_loss``, ``last_train_loss`` and any other number your
            ``train_batch``/``train_epoch`` returns averaged over workers (weighted by their
            ``num_samples``), anything else from worker 0; ``profile=True`` adds a
            ``profile`` dict (``mean_fwd_s``, ``mean_grad_s``, ``mean_apply_s``,
            ``mean_train_epoch_s``). Without ``reduce_results``: one dict per worker.

        Raises:
            WorkerGroupError: Your operator raised (the worker's traceback is in it), or the
                workers kept dying after ``max_retries`` restarts.
        """
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ConfigError(f"`max_retries` must be an integer >= 0, got {max_retries!r}.")
        try:
            self._workers.settle()
        except WorkerGroupError as exc:  # a load_state_dict(blocking=False) failed
            if not lost_worker(exc):
                raise  # else a worker was lost meanwhile: restarted below
        self._workers.ready()
        self._maybe_grow()
        for attempt in range(max_retries + 1):
            group = self._workers.live()
            try:
                results = group.execute(_runner.train, num_steps, profile, info, True)
                break
            except WorkerGroupError as exc:
                lost = lost_worker(exc, group)
                discard(group)
                if not lost or attempt == max_retries:
                    raise
                _logger.warning(
                    "ddptrain: a worker was lost during train() (%s); restarting the workers from the last "
                    "state (retry %d of %d)",
                    first_line(exc),
                    attempt + 1,
                    max_retries,
                )
                self._workers.restart()
        stats = [worker_stats for worker_stats, _ in results]
        self._workers.state = results[0][1]
        return reduce_worker_stats(stats) if reduce_results else stats

    def validate(
        self,
        num_steps: int | None = None,
        profile: bool = False,
        reduce_results: bool = True,
        info: dict[str, Any] | None = None,
    ) -> Any:
        """``validate`` on every worker: ``num_samples``, ``batch_count``, ``val_loss``,
        ``last_val_loss``, ``val_accuracy``, ``last_val_accuracy`` (reduced as in :meth:`train`).

        Not retried: if a worker dies, this raises ``WorkerGroupError`` (never hangs), and the
        next call on this trainer first restarts the workers from the last state.
        """
        stats = self._workers.call(_runner.validate, num_steps, profile, info)
        return reduce_worker_stats(stats) if reduce_results else stats

    def update_scheduler(self, metric: Any) -> None:
        """``scheduler.step(metric)`` for every registered scheduler on every worker (for
        ``scheduler_step_freq="manual"``, e.g. ``ReduceLROnPlateau``)."""
        self._workers.call(_runner.update_scheduler, metric)
        self._workers.state = self.state_dict()

    def apply_all_workers(self, fn: Callable[[], Any]) -> list[Any]:
        """Run ``fn()`` on every worker; results in rank order."""
        return self._workers.call(fn)

    def apply_all_operators(self, fn: Callable[[TrainingOperator], Any]) -> list[Any]:
        """Run ``fn(operator)`` on every worker's operator; results in rank order. Changes it
        makes are not in the driver's saved state until the next ``train()``."""
        return self._workers.call(_runner.apply_operator, fn)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Rank 0's state: ``epoch``, ``models``, ``optimizers``, ``schedulers``, ``amp``,
        ``operator`` (your ``TrainingOperator.state_dict()``), tensors on the CPU."""
        return self._workers.call(_runner.state_dict, rank=0)

    def load_state_dict(self, state_dict: dict[str, Any], blocking: bool = False) -> None:
        """Load ``state_dict`` (from :meth:`state_dict` or :meth:`save`) into every worker.

        As in Ray, ``blocking=False`` returns once the state is serialized and on its way,
        before the workers have loaded it (changing ``state_dict`` afterwards changes nothing);
        the next call on this trainer waits for them, and raises ``WorkerGroupError`` if
        loading failed. ``blocking=True`` returns when every worker has loaded it.
        """
        data = cloudpickle.dumps(state_dict)
        self._local = None
        self._workers.load(data, blocking)

    def save(self, checkpoint: str | os.PathLike[str]) -> str:
        """Write :meth:`state_dict` to the file ``checkpoint`` with ``torch.save``; returns its path."""
        torch.save(self.state_dict(), checkpoint)
        return os.fspath(checkpoint)

    def load(self, checkpoint: str | os.PathLike[str]) -> None:
        """Load a file written by :meth:`save` (trusted: it is unpickled in full)."""
        self.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=False))

    def get_model(self, to_cpu: bool = False) -> Any:
        """The trained model(s) of rank 0, unwrapped (no DDP), in this process: the model, or
        a list when several were registered."""
        models = self._workers.call(_runner.get_models, to_cpu, rank=0)
        return models[0] if len(models) == 1 else models

    def get_local_operator(self) -> TrainingOperator:
        """A ``TrainingOperator`` in this process (not distributed, built by your ``setup``)
        holding rank 0's current state. Each call refreshes it; changing it does not change
        the workers."""
        state = self.state_dict()
        if self._local is None or self._local[0] != self._workers.generation:
            device = torch.device("cuda", torch.cuda.current_device()) if self.use_gpu else torch.device("cpu")
            options = {**self._options, "wrap_ddp": False, "add_dist_sampler": False, "use_tqdm": False}
            runner = _runner.Runner(
                self.training_operator_cls, self._worker_config(self.worker_count), options, 0, 0, 1, device
            )
            self._local = (self._workers.generation, runner)
        runner = self._local[1]
        runner.load_state_dict(state)
        return runner.operator

    # ----------------------------------------------------------------- shutdown
    def shutdown(self, force: bool = False) -> None:
        """Stop every worker (``force``: without letting operators clean up). A
        ``load_state_dict(blocking=False)`` under way is waited for first. Safe to call twice."""
        self._local = None
        self._workers.shutdown(force)

    def __enter__(self) -> TorchTrainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @classmethod
    def as_trainable(cls, *args: Any, **kwargs: Any) -> type[BaseTorchTrainable]:
        """A Tune Trainable class (a :class:`BaseTorchTrainable` subclass) for ``ddptrain.tune``
        whose trials build this trainer from the given arguments, the trial's config merged
        into ``config``. ``override_tune_step=fn(trainer, info)`` replaces ``step()`` (Ray 1.x);
        ``checkpoint_freq=N`` (ours) reports a checkpoint every N iterations."""
        return _tune.as_trainable(cls, *args, **kwargs)
