"""The Lightning classes, built once per Lightning package (``lightning`` or ``pytorch_lightning``).

Both packages ship the same classes under different module names, and a Trainer of one refuses
the strategies, plugins and callbacks of the other. So the classes here are defined by
:func:`build_classes` for one package at a time; ``ddptrain.lightning.lightning`` and
``ddptrain.lightning.pytorch_lightning`` each hold one set.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddptrain import context
from ddptrain.checkpoint import Checkpoint
from ddptrain.errors import ConfigError
from ddptrain.torch.train_loop_utils import get_device

__all__ = ["build_classes", "mesh_sizes", "PACKAGES", "CHECKPOINT_NAME"]

_logger = logging.getLogger(__name__)

# Our name of each package -> the module that holds its Trainer.
PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
CHECKPOINT_NAME = "checkpoint.ckpt"
_FREQUENCY_UNITS = ("epoch", "step")


def _warn_ignored_arguments(strategy_name: str, kwargs: dict[str, Any]) -> None:
    """The process group exists before Lightning starts: its backend and timeout are ours."""
    ignored = [name for name in ("process_group_backend", "timeout") if kwargs.get(name) is not None]
    if ignored:
        given = ", ".join(f"{name}={kwargs[name]!r}" for name in ignored)
        warnings.warn(
            f"{strategy_name}({given}): ddptrain creates the process group before Lightning starts, "
            "so Lightning ignores these. Set them on the trainer instead: "
            "`TorchTrainer(..., torch_config=TorchConfig(backend=..., timeout_s=...))`.",
            stacklevel=4,
        )


def _root_device() -> Any:
    return get_device()


def _context() -> context.TrainContext:
    return context.get_context()


def _metric_value(value: Any) -> Any:
    """A float (or list) for a tensor metric; metrics must not hold tensors."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.detach().cpu().tolist()
    return value


@contextlib.contextmanager
def _own_path(strategy: Any, path: Any) -> Iterator[None]:
    """Lightning's FSDP, DeepSpeed and model-parallel strategies broadcast rank 0's checkpoint
    path and have every rank write (or read) its shard there. A rank on a host that does not
    share rank 0's file systems has no such folder: its shard would be written where nobody
    collects it, and a restart could not read the checkpoint. Within this block a ddptrain
    strategy keeps each rank's own ``path`` (its temp folder when ``RayTrainReportCallback``
    saves, its copy of the checkpoint when loading); ddptrain merges the folders the ranks
    report into one checkpoint. Other strategies keep Lightning's behaviour."""
    if not hasattr(strategy, "_ddptrain_own_path") or path is None:
        yield
        return
    previous = strategy._ddptrain_own_path
    strategy._ddptrain_own_path = os.fspath(path)
    try:
        yield
    finally:
        strategy._ddptrain_own_path = previous


def mesh_sizes(data_parallel: int | str, tensor_parallel: int | str, world: int, local: int) -> tuple[int, int]:
    """The model-parallel strategy's mesh sizes for ``world`` workers, ``local`` on this host.

    ``"auto"`` means tensor parallelism within a host and data parallelism across hosts
    (Lightning's meaning, which takes the host count from ``Trainer(num_nodes=...)``).

    Raises:
        ConfigError: ``"auto"`` cannot be resolved: the workers do not split evenly.
    """
    if data_parallel == "auto" and tensor_parallel == "auto":
        if world % local:
            raise ConfigError(
                f"RayModelParallelStrategy: {world} workers do not split into hosts of {local}; pass "
                "`data_parallel_size` and `tensor_parallel_size` (their product is the number of workers)."
            )
        return world // local, local
    if data_parallel == "auto" or tensor_parallel == "auto":
        name, given = (
            ("tensor_parallel_size", tensor_parallel)
            if data_parallel == "auto"
            else ("data_parallel_size", data_parallel)
        )
        if not isinstance(given, int) or given < 1 or world % given:
            raise ConfigError(f"RayModelParallelStrategy: {world} workers are not a multiple of {name}={given!r}.")
        return (world // given, given) if data_parallel == "auto" else (given, world // given)
    return data_parallel, tensor_parallel  # type: ignore[return-value]  # Lightning checks the product


def build_classes(package: str, module_name: str) -> dict[str, Any]:
    """Define the Ray Train Lightning classes on top of ``package``'s Lightning classes.

    Args:
        package: ``"lightning"`` or ``"pytorch_lightning"``.
        module_name: The module the classes are published in (for pickling and reprs).

    Returns:
        The classes by name.
    """
    pl: Any = importlib.import_module(PACKAGES[package])
    strategies: Any = importlib.import_module(f"{PACKAGES[package]}.strategies")
    environments: Any = importlib.import_module(f"{PACKAGES[package]}.plugins.environments")

    class RayLightningEnvironment(environments.LightningEnvironment):
        """Lightning's view of the ddptrain worker group: ranks and sizes come from
        :func:`ddptrain.get_context`, and the process group ddptrain set up is kept as is."""

        @property
        def creates_processes_externally(self) -> bool:
            return True

        def world_size(self) -> int:
            return _context().get_world_size()

        def global_rank(self) -> int:
            return _context().get_world_rank()

        def local_rank(self) -> int:
            return _context().get_local_rank()

        def node_rank(self) -> int:
            return _context().get_node_rank()

        def set_world_size(self, size: int) -> None:
            pass  # fixed by ddptrain

        def set_global_rank(self, rank: int) -> None:
            pass  # fixed by ddptrain

        def teardown(self) -> None:
            pass  # the process group belongs to ddptrain

    def _strategy(base: Any, name: str, sampler: bool = True) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            _warn_ignored_arguments(name, kwargs)
            base.__init__(self, *args, **kwargs)
            self._ddptrain_own_path = None

        def root_device(self: Any) -> Any:
            return _root_device()

        def distributed_sampler_kwargs(self: Any) -> dict[str, Any]:
            return {"num_replicas": self.world_size, "rank": self.global_rank}

        def broadcast(self: Any, obj: Any, src: int = 0) -> Any:
            result = base.broadcast(self, obj, src)
            own = self._ddptrain_own_path
            if own is not None and isinstance(obj, (str, os.PathLike)) and os.fspath(obj) == own:
                return obj  # the collective ran; this rank keeps its own folder (see _own_path)
            return result

        def load_checkpoint(self: Any, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            with _own_path(self, checkpoint_path if os.path.exists(checkpoint_path) else None):
                return base.load_checkpoint(self, checkpoint_path, *args, **kwargs)

        doc = (
            f"Lightning's ``{base.__name__}`` for a ddptrain worker: the root device is "
            "``ddptrain.torch.get_device()`` (so ``devices='auto'`` works on CPU and GPU)"
            + (
                " and the distributed sampler takes the worker's rank and the world size from the context."
                if sampler
                else "."
            )
            + " Checkpoints are written to and read from each rank's own folder, also on hosts that do not "
            "share the first rank's file systems."
        )
        namespace: dict[str, Any] = {
            "__init__": __init__,
            "root_device": property(root_device),
            "broadcast": broadcast,
            "load_checkpoint": load_checkpoint,
            "__doc__": doc,
        }
        if sampler:
            namespace["distributed_sampler_kwargs"] = property(distributed_sampler_kwargs)
        return type(name, (base,), namespace)

    RayDDPStrategy = _strategy(strategies.DDPStrategy, "RayDDPStrategy")
    RayFSDPStrategy = _strategy(strategies.FSDPStrategy, "RayFSDPStrategy")
    RayDeepSpeedStrategy = _strategy(strategies.DeepSpeedStrategy, "RayDeepSpeedStrategy")
    # Not in Ray: FSDP2 and tensor parallelism (Lightning >= 2.4). Its sampler follows the
    # data-parallel dimension of the device mesh, as Lightning's does.
    model_parallel = getattr(strategies, "ModelParallelStrategy", None)
    RayModelParallelStrategy = None
    if model_parallel is not None:
        RayModelParallelStrategy = _strategy(model_parallel, "RayModelParallelStrategy", sampler=False)

        def setup_environment(self: Any) -> None:
            sizes = (self._data_parallel_size, self._tensor_parallel_size)
            world, local = _context().get_world_size(), _context().get_local_world_size()
            self._data_parallel_size, self._tensor_parallel_size = mesh_sizes(*sizes, world, local)
            model_parallel.setup_environment(self)

        RayModelParallelStrategy.setup_environment = setup_environment

    class RayTrainReportCallback(pl.callbacks.Callback):
        """Reports ``trainer.callback_metrics`` (as numbers, plus ``epoch`` and ``step``) with a
        checkpoint written by ``trainer.save_checkpoint``.

        The checkpoint folder holds one file, ``CHECKPOINT_NAME`` (``"checkpoint.ckpt"``), as in
        Ray. Every rank calls ``trainer.save_checkpoint`` (a collective for FSDP and DeepSpeed);
        the ranks that wrote files pass them to ``report``, and ddptrain merges them into one
        checkpoint: rank 0's file for DDP, every rank's shard for sharded strategies.

        Args:
            frequency: Report a checkpoint every ``frequency`` epochs (or optimizer steps, see
                ``frequency_unit``). With ``"epoch"`` the last epoch (``max_epochs``) also gets
                one, and the epochs in between report their metrics without a checkpoint.
            frequency_unit: ``"epoch"`` (at the end of a training epoch) or ``"step"`` (after
                every ``frequency``-th optimizer step).
            checkpoint_upload_mode: Passed to :func:`ddptrain.report`.

        Example:
            >>> trainer = pl.Trainer(..., callbacks=[RayTrainReportCallback(frequency=2)])
            >>> with result.checkpoint.as_directory() as d:
            ...     model = MyModule.load_from_checkpoint(
            ...         os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME))
        """

        CHECKPOINT_NAME = CHECKPOINT_NAME

        def __init__(self, frequency: int = 1, frequency_unit: str = "epoch", checkpoint_upload_mode: Any = None):
            super().__init__()
            if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
                raise ConfigError(f"`frequency` must be an int >= 1, got {frequency!r}.")
            if frequency_unit not in _FREQUENCY_UNITS:
                raise ConfigError(f"`frequency_unit` must be 'epoch' or 'step', got {frequency_unit!r}.")
            self.frequency = frequency
            self.frequency_unit = frequency_unit
            self.checkpoint_upload_mode = checkpoint_upload_mode
            self._last_step_reported = -1

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            if self.frequency_unit != "epoch":
                return
            epoch = trainer.current_epoch
            last = trainer.max_epochs is not None and trainer.max_epochs > 0 and epoch + 1 >= trainer.max_epochs
            self._report(trainer, with_checkpoint=(epoch + 1) % self.frequency == 0 or last)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = trainer.global_step
            if self.frequency_unit != "step" or step == self._last_step_reported or step % self.frequency:
                return
            self._last_step_reported = step  # with gradient accumulation a step spans batches
            self._report(trainer, with_checkpoint=True)

        def _report(self, trainer: Any, with_checkpoint: bool) -> None:
            metrics = {key: _metric_value(value) for key, value in trainer.callback_metrics.items()}
            metrics["epoch"] = trainer.current_epoch
            metrics["step"] = trainer.global_step
            if not with_checkpoint:
                context.report(metrics)
                return
            folder = tempfile.mkdtemp(prefix="ddptrain_lightning_")
            handed_over = False  # ASYNC: the upload deletes the folder once it is done
            try:
                path = str(Path(folder, CHECKPOINT_NAME))
                with _own_path(trainer.strategy, path):
                    trainer.save_checkpoint(path, weights_only=False)
                wrote = any(Path(folder).iterdir())  # DDP: rank 0 only; sharded: every rank
                checkpoint = Checkpoint.from_directory(folder) if wrote else None
                context.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=self.checkpoint_upload_mode)
                mode = getattr(self.checkpoint_upload_mode, "value", self.checkpoint_upload_mode)
                handed_over = checkpoint is not None and mode == "ASYNC"
                trainer.strategy.barrier()
            finally:
                if not handed_over:
                    shutil.rmtree(folder, ignore_errors=True)

    class _ResumeCheck(pl.callbacks.Callback):
        """Added by ``prepare_trainer``: warns when ``fit`` would not resume from the checkpoint
        ddptrain restarted the run from (ray#35613: a fixed ``ckpt_path`` restarts from the same
        old checkpoint after every failure, and training never progresses)."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            latest = context.get_checkpoint()
            if latest is None or _context().get_world_rank() != 0:
                return
            expected = str(Path(latest.path, CHECKPOINT_NAME))
            given = trainer.ckpt_path
            if given is None:
                warnings.warn(
                    f"This run resumed from the checkpoint {latest.path}, but `trainer.fit()` got no "
                    "`ckpt_path`, so Lightning starts from epoch 0. To continue where it stopped, pass "
                    f"`ckpt_path=os.path.join(ddptrain.get_checkpoint().path, "
                    f"RayTrainReportCallback.CHECKPOINT_NAME)` ({expected}).",
                    stacklevel=2,
                )
                return
            try:
                inside = Path(str(given)).resolve().is_relative_to(Path(latest.path).resolve())
            except (OSError, ValueError):
                inside = False
            if not inside:
                warnings.warn(
                    f"`trainer.fit(ckpt_path={str(given)!r})` overrides the checkpoint this run resumed "
                    f"from ({latest.path}): after every restart Lightning would start again from the "
                    "same checkpoint. Pass `ckpt_path=os.path.join(ddptrain.get_checkpoint().path, "
                    f"RayTrainReportCallback.CHECKPOINT_NAME)` ({expected}) when "
                    "`ddptrain.get_checkpoint()` is not None.",
                    stacklevel=2,
                )

    classes: dict[str, Any] = {
        "RayLightningEnvironment": RayLightningEnvironment,
        "RayDDPStrategy": RayDDPStrategy,
        "RayFSDPStrategy": RayFSDPStrategy,
        "RayDeepSpeedStrategy": RayDeepSpeedStrategy,
        "RayModelParallelStrategy": RayModelParallelStrategy,
        "RayTrainReportCallback": RayTrainReportCallback,
        "_ResumeCheck": _ResumeCheck,
        "Trainer": pl.Trainer,
        "Callback": pl.callbacks.Callback,
    }
    for name, cls in classes.items():
        if cls is not None and name not in ("Trainer", "Callback"):
            cls.__module__ = module_name
            cls.__qualname__ = name
    return classes
