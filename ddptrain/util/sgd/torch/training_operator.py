"""``TrainingOperator``: what one worker trains and validates (RaySGD's worker-side class).

A subclass sets up its models, optimizers, loss, schedulers and data loaders in
``setup(config)``, hands them to :meth:`TrainingOperator.register` and
:meth:`TrainingOperator.register_data`, and may override any of ``train_epoch``,
``train_batch``, ``validate``, ``validate_batch``, ``state_dict`` and ``load_state_dict``.
Every worker builds its own operator; ``TorchTrainer`` calls it (see ``_runner``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ddptrain.errors import ConfigError
from ddptrain.util.sgd.torch._creators import operator_from_creators, release_before_collectives
from ddptrain.util.sgd.torch._progress import EpochProgress
from ddptrain.util.sgd.torch._registration import as_given, as_list, checked_models, with_sampler, wrap_ddp
from ddptrain.util.sgd.torch.constants import NUM_STEPS as NUM_STEPS  # re-exported: it was defined here
from ddptrain.util.sgd.torch.constants import SCHEDULER_STEP_BATCH, SCHEDULER_STEP_EPOCH
from ddptrain.util.sgd.torch.constants import SCHEDULER_STEP_MANUAL as SCHEDULER_STEP_MANUAL  # re-exported
from ddptrain.util.sgd.torch.constants import VALID_SCHEDULER_STEP as VALID_SCHEDULER_STEP  # re-exported
from ddptrain.util.sgd.utils import NUM_SAMPLES, AverageMeterCollection, TimerCollection

__all__ = ["TrainingOperator"]

_NULL = contextlib.nullcontext()


class TrainingOperator:
    """Set up and run the training of one worker; subclass it and override :meth:`setup`.

    ``TorchTrainer`` constructs one per worker with these arguments (you never do): the
    worker's ``config`` (``config[BATCH_SIZE]`` already divided among the workers), its rank,
    device and the trainer's flags. ``model(s)``, ``optimizer(s)``, ``criterion`` and
    ``scheduler(s)`` are plain attributes: :meth:`register` sets them, and you may assign
    them yourself (``self.model, self.optimizer, ... = self.register(...)``).

    Example:
        >>> class MyOperator(TrainingOperator):
        ...     def setup(self, config):
        ...         model = torch.nn.Linear(1, 1)
        ...         optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
        ...         self.model, self.optimizer, self.criterion = self.register(
        ...             models=model, optimizers=optimizer, criterion=torch.nn.MSELoss())
        ...         self.register_data(train_loader=DataLoader(...), validation_loader=DataLoader(...))
    """

    def __init__(
        self,
        config: dict[str, Any],
        world_rank: int = 0,
        local_rank: int = 0,
        is_distributed: bool = False,
        device: torch.device | None = None,
        use_gpu: bool = False,
        use_fp16: bool = False,
        use_tqdm: bool = False,
        wrap_ddp: bool = False,
        add_dist_sampler: bool = False,
        scheduler_step_freq: str | None = None,
        world_size: int = 1,
    ) -> None:
        self._config = config
        self._world_rank = world_rank
        self._local_rank = local_rank
        self._world_size = world_size
        self._is_distributed = is_distributed
        self._device = device if device is not None else torch.device("cpu")
        self._use_gpu = use_gpu
        self._use_fp16 = use_fp16
        self._use_tqdm = use_tqdm
        self._wrap_ddp = wrap_ddp
        self._add_dist_sampler = add_dist_sampler
        self._scheduler_step_freq = scheduler_step_freq
        self.timers = TimerCollection()
        self.global_step = 0
        self._original_models: list[torch.nn.Module] = []
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[Any] = []
        self._criterion: Any = None
        self._amp_scaler: torch.amp.GradScaler | None = None
        self._train_loader: Iterable[Any] | None = None
        self._validation_loader: Iterable[Any] | None = None
        # Plain attributes that register() fills and users may assign.
        self.model: Any = None
        self.models: Any = []
        self.optimizer: Any = None
        self.optimizers: Any = []
        self.criterion: Any = None
        self.scheduler: Any = None
        self.schedulers: Any = []
        self.setup(config)

    # ----------------------------------------------------------------- to override
    def setup(self, config: dict[str, Any]) -> None:
        """Create and :meth:`register` the models, optimizers, loss, schedulers and data.

        Args:
            config: The trainer's ``config`` (``config[BATCH_SIZE]`` divided among the workers).
        """

    # ----------------------------------------------------------------- registration
    def register(
        self,
        *,
        models: torch.nn.Module | Iterable[torch.nn.Module],
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
        criterion: Any = None,
        schedulers: Any = None,
        ddp_args: dict[str, Any] | None = None,
        apex_args: dict[str, Any] | None = None,
    ) -> Any:
        """Hand the training components to ddptrain: models move to this worker's device
        and (with ``wrap_ddp`` and 2+ workers) are wrapped in ``DistributedDataParallel``;
        with ``use_fp16`` a ``torch.amp.GradScaler`` is made.

        Returns:
            ``(models, optimizers[, criterion][, schedulers])``, each single or a tuple as
            given; the models wrapped. A lone component comes back alone.

        Raises:
            ConfigError: ``schedulers`` given while the trainer's ``scheduler_step_freq`` is
                ``None`` (set it to ``"manual"`` to step them yourself), or a model that is
                not a ``torch.nn.Module``.
        """
        if apex_args:
            warnings.warn("`apex_args` is ignored: ddptrain uses torch.amp, not Apex.", stacklevel=2)
        model_list = checked_models(models)
        optimizer_list, scheduler_list = as_list(optimizers), as_list(schedulers)
        if scheduler_list and self._scheduler_step_freq is None:
            raise ConfigError(
                "`scheduler_step_freq` passed to TorchTrainer is None, but schedulers were registered. "
                "Set it to 'batch', 'epoch', or 'manual' (then call `trainer.update_scheduler(metric)`)."
            )
        self._original_models = [model.to(self._device) for model in model_list]
        if criterion is not None and hasattr(criterion, "to"):
            criterion = criterion.to(self._device)
        if self._use_fp16:
            self._amp_scaler = torch.amp.GradScaler(self._device.type, enabled=self._device.type == "cuda")
        distributed = self._wrap_ddp and self._is_distributed
        release_before_collectives()  # TorchTrainer(serialize_data_creation=True): DDP needs every worker
        self._models = (
            wrap_ddp(self._original_models, self._device, ddp_args) if distributed else list(self._original_models)
        )
        self._optimizers = optimizer_list
        self._criterion = criterion
        self._schedulers = scheduler_list
        # Plain attributes for the default loops; users may reassign them.
        self.models, self.optimizers, self.schedulers = self._models, optimizer_list, scheduler_list
        self.model = self._models[0] if self._models else None
        self.optimizer = optimizer_list[0] if optimizer_list else None
        self.scheduler = scheduler_list[0] if scheduler_list else None
        self.criterion = criterion
        returned: list[Any] = [as_given(self._models, models), as_given(optimizer_list, optimizers)]
        if criterion is not None:
            returned.append(criterion)
        if scheduler_list:
            returned.append(as_given(scheduler_list, schedulers))
        return tuple(returned) if len(returned) > 1 else returned[0]

    def register_data(
        self, *, train_loader: Iterable[Any] | None = None, validation_loader: Iterable[Any] | None = None
    ) -> None:
        """Hand the data loaders to ddptrain. With ``add_dist_sampler`` (the default) and 2+
        workers, a ``DataLoader`` over a map-style dataset is rebuilt with a
        ``DistributedSampler`` (shuffling if the loader shuffled), so each worker sees its own
        part; the trainer sets the sampler's epoch on every ``train()``."""
        self._train_loader = self._with_sampler(train_loader)
        self._validation_loader = self._with_sampler(validation_loader)

    def _with_sampler(self, loader: Iterable[Any] | None) -> Iterable[Any] | None:
        if not (self._add_dist_sampler and self._is_distributed):
            return loader
        return with_sampler(loader, self._world_size, self._world_rank)

    # ----------------------------------------------------------------- default loops
    def train_epoch(self, iterator: Iterable[Any], info: dict[str, Any]) -> dict[str, Any]:
        """One pass over ``iterator``: :meth:`train_batch` on each batch, the scheduler
        stepped per ``scheduler_step_freq``.

        Returns:
            ``batch_count``, ``num_samples``, and each ``train_batch`` metric averaged over
            the batches (weighted by their ``num_samples``) plus its ``last_`` value.
        """
        model = getattr(self, "model", None)
        if model is None:
            raise RuntimeError("Either register a model in setup() (self.model) or override train_epoch/train_batch.")
        scheduler = getattr(self, "scheduler", None)
        progress = EpochProgress(self.train_loader, info) if self.use_tqdm and self.world_rank == 0 else None
        meters = AverageMeterCollection()
        model.train()
        try:
            for batch_idx, batch in enumerate(iterator):
                batch_info = {"batch_idx": batch_idx, "global_step": self.global_step, **info}
                metrics = self.train_batch(batch, batch_info=batch_info)
                if progress is not None:
                    progress.update(batch_idx + 1, metrics)
                if scheduler is not None and self.scheduler_step_freq == SCHEDULER_STEP_BATCH:
                    scheduler.step()
                meters.update(metrics, n=metrics.pop(NUM_SAMPLES, 1))
                self.global_step += 1
        finally:
            if progress is not None:
                progress.close()
        if scheduler is not None and self.scheduler_step_freq == SCHEDULER_STEP_EPOCH:
            scheduler.step()
        return meters.summary()

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """Forward, backward and optimizer step on one ``(features..., target)`` batch.

        Returns:
            ``{"train_loss": float, "num_samples": int}``; yours may return any numbers
            (with ``num_samples``, the batch's weight in the epoch's averages).
        """
        *features, target = batch
        features = [f.to(self.device, non_blocking=True) for f in features]
        target = target.to(self.device, non_blocking=True)
        model, optimizer, criterion = self.model, self.optimizer, self.criterion
        with self.timers.record("fwd"), self._autocast():
            output = model(*features)
            loss = criterion(output, target)
        with self.timers.record("grad"):
            optimizer.zero_grad()
            if self._amp_scaler is not None:
                self._amp_scaler.scale(loss).backward()
            else:
                loss.backward()
        with self.timers.record("apply"):
            if self._amp_scaler is not None:
                self._amp_scaler.step(optimizer)
                self._amp_scaler.update()
            else:
                optimizer.step()
        return {"train_loss": loss.item(), NUM_SAMPLES: target.size(0)}

    def validate(self, val_iterator: Iterable[Any], info: dict[str, Any]) -> dict[str, Any]:
        """:meth:`validate_batch` on each batch, in ``eval()`` mode under ``torch.no_grad()``.

        Returns:
            ``batch_count``, ``num_samples``, and each metric's weighted mean and ``last_`` value.
        """
        model = getattr(self, "model", None)
        if model is None:
            raise RuntimeError("Either register a model in setup() (self.model) or override validate/validate_batch.")
        meters = AverageMeterCollection()
        model.eval()
        with torch.no_grad():
            for batch_idx, batch in enumerate(val_iterator):
                metrics = self.validate_batch(batch, {"batch_idx": batch_idx, **info})
                meters.update(metrics, n=metrics.pop(NUM_SAMPLES, 1))
        return meters.summary()

    def validate_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """Loss and accuracy (argmax over dimension 1) of one ``(features..., target)`` batch.

        Returns:
            ``{"val_loss": float, "val_accuracy": float, "num_samples": int}``.
        """
        *features, target = batch
        features = [f.to(self.device, non_blocking=True) for f in features]
        target = target.to(self.device, non_blocking=True)
        with self._autocast():
            output = self.model(*features)
            loss = self.criterion(output, target)
        num_samples = target.size(0)
        correct = 0.0
        if output.dim() > 1:
            correct = float((torch.max(output.data, 1)[1] == target).sum().item())
        return {"val_loss": loss.item(), "val_accuracy": correct / max(num_samples, 1), NUM_SAMPLES: num_samples}

    def state_dict(self) -> Any:
        """Extra state of your operator to save (models, optimizers, schedulers and the
        fp16 scaler are saved without it). Default: ``None``."""
        return None

    def load_state_dict(self, state_dict: Any) -> None:
        """Restore what :meth:`state_dict` returned."""

    # ----------------------------------------------------------------- helpers
    def _autocast(self) -> Any:
        if not self._use_fp16:
            return _NULL
        dtype = torch.float16 if self._device.type == "cuda" else torch.bfloat16
        return torch.autocast(device_type=self._device.type, dtype=dtype)

    def _get_original_models(self) -> list[torch.nn.Module]:
        return list(self._original_models)

    @property
    def config(self) -> dict[str, Any]:
        """The trainer's ``config`` as this worker got it."""
        return self._config

    @property
    def device(self) -> torch.device:
        """This worker's device (``cuda:<i>`` with GPUs, else ``cpu``)."""
        return self._device

    @property
    def device_ids(self) -> list[int]:
        """CUDA device indices of this worker (``[]`` on CPU)."""
        return [self._device.index or 0] if self._device.type == "cuda" else []

    @property
    def world_rank(self) -> int:
        return self._world_rank

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def use_gpu(self) -> bool:
        return self._use_gpu

    @property
    def use_fp16(self) -> bool:
        return self._use_fp16

    @property
    def use_tqdm(self) -> bool:
        return self._use_tqdm

    @property
    def scheduler_step_freq(self) -> str | None:
        return self._scheduler_step_freq

    @property
    def train_loader(self) -> Iterable[Any] | None:
        return self._train_loader

    @property
    def validation_loader(self) -> Iterable[Any] | None:
        return self._validation_loader

    # ----------------------------------------------------------------- creators
    @classmethod
    def from_creators(
        cls,
        model_creator: Callable[[dict[str, Any]], Any],
        optimizer_creator: Callable[[Any, dict[str, Any]], Any],
        data_creator: Callable[[dict[str, Any]], Any] | None = None,
        loss_creator: Any = None,
        scheduler_creator: Callable[[Any, dict[str, Any]], Any] | None = None,
        serialize_data_creation: bool = True,
    ) -> type[TrainingOperator]:
        """An operator class built from RaySGD's old creator functions.

        Args:
            model_creator: ``config -> model(s)``.
            optimizer_creator: ``(model(s), config) -> optimizer(s)``.
            data_creator: ``config -> train_loader`` or ``(train_loader, validation_loader)``.
            loss_creator: A loss class (``torch.nn.MSELoss``) or ``config -> loss``.
            scheduler_creator: ``(optimizer(s), config) -> scheduler(s)``.
            serialize_data_creation: Run ``data_creator`` under a file lock, one worker of a
                machine at a time (so that they do not download to one path at once).
        """
        return operator_from_creators(
            cls,
            model_creator,
            optimizer_creator,
            data_creator,
            loss_creator,
            scheduler_creator,
            serialize_data_creation,
        )
