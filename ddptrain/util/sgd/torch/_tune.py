"""``TorchTrainer.as_trainable`` and ``BaseTorchTrainable``: a RaySGD trainer as a
``ddptrain.tune`` trial, as Ray 1.x had it.

``as_trainable(...)`` returns a subclass of :class:`BaseTorchTrainable`, a Tune Trainable
*class*: each trial makes one instance (``setup(config)`` builds a ``TorchTrainer`` with the
trial's config merged into ``config``), calls ``step()`` once per iteration (one ``train()``,
and one ``validate()`` when the operator registered a validation loader) and reports what it
returns, and ``cleanup()`` at the end. ``save_checkpoint``/``load_checkpoint`` write and read
the trainer's state. ``ddptrain.tune`` runs such a class through
:meth:`BaseTorchTrainable._ddptrain_function_trainable` (its trial function); ``ddptrain.tune``
is imported only then.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from ddptrain.checkpoint import Checkpoint
from ddptrain.errors import ConfigError
from ddptrain.tune.trainable import merge_dicts

if TYPE_CHECKING:
    from ddptrain.util.sgd.torch.torch_trainer import TorchTrainer

__all__ = ["BaseTorchTrainable"]

_CHECKPOINT_FILE = "trainer.checkpoint"  # Ray's name, in the folder save_checkpoint is given
_ITERATION_FILE = "ddptrain_trainable.json"


class BaseTorchTrainable:
    """A Tune Trainable class around a RaySGD ``TorchTrainer`` (Ray 1.x's ``BaseTorchTrainable``).

    ``TorchTrainer.as_trainable(...)`` returns a subclass; pass it (or your own subclass of it)
    to ``ddptrain.tune.run`` or ``Tuner``. Override :meth:`step` for a custom iteration (or pass
    ``override_tune_step=fn(trainer, info)`` to ``as_trainable``), and
    :meth:`save_checkpoint`/:meth:`load_checkpoint` for state outside the trainer.

    Example:
        >>> TorchTrainable = TorchTrainer.as_trainable(training_operator_cls=MyOperator, num_workers=2)
        >>> class FiveEpochs(TorchTrainable):
        ...     def step(self):
        ...         for _ in range(4):
        ...             self.trainer.train()
        ...         return self.trainer.train()
        >>> analysis = tune.run(FiveEpochs, config={"lr": tune.grid_search([0.01, 0.1])},
        ...                     stop={"training_iteration": 2})
    """

    # Set by as_trainable: what each trial reserves, and how often it reports a checkpoint.
    _resources: ClassVar[dict[str, float]] = {"CPU": 1.0}
    _checkpoint_freq: ClassVar[int] = 0

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config: dict[str, Any] = dict(config or {})
        self._iteration = 0
        self._trainer: TorchTrainer | None = None
        self._has_validation: bool | None = None
        self.setup(self.config)

    @property
    def training_iteration(self) -> int:
        """Iterations (``step()`` calls) completed so far, restored ones included."""
        return self._iteration

    iteration = training_iteration

    @property
    def trainer(self) -> TorchTrainer:
        """The trial's ``TorchTrainer``."""
        if self._trainer is None:
            raise RuntimeError(
                "the TorchTrainer is built in setup(); a subclass overriding setup must call super().setup(config)"
            )
        return self._trainer

    def setup(self, config: dict[str, Any]) -> None:
        """Build the trainer (``self.trainer``) with :meth:`_create_trainer`."""
        self._trainer = self._create_trainer(config)

    def step(self) -> dict[str, Any]:
        """One ``train(max_retries=0, profile=True)`` and, if the operator registered a
        validation loader, one ``validate(profile=True)``; their metrics merged (validation's
        on top). A worker lost in a trial fails the trial (``max_failures`` restarts it)."""
        stats = self.trainer.train(max_retries=0, profile=True)
        if self._has_validation is None:
            self._has_validation = bool(
                self.trainer.apply_all_operators(lambda op: op.validation_loader is not None)[0]
            )
        if self._has_validation:
            stats = merge_dicts(stats, self.trainer.validate(profile=True))
        return stats

    def save_checkpoint(self, checkpoint_dir: str) -> str:
        """Write the trainer's state into ``checkpoint_dir``; returns the file's path."""
        path = os.path.join(checkpoint_dir, _CHECKPOINT_FILE)
        self.trainer.save(path)
        return path

    def load_checkpoint(self, checkpoint_path: str) -> None:
        """Load the state :meth:`save_checkpoint` wrote (its returned path)."""
        self.trainer.load(checkpoint_path)

    def cleanup(self) -> None:
        """Stop the trainer's workers."""
        if self._trainer is not None:
            self._trainer.shutdown()

    def _create_trainer(self, config: dict[str, Any]) -> TorchTrainer:
        raise NotImplementedError(f"{type(self).__name__} must implement _create_trainer(config)")

    @classmethod
    def _ddptrain_function_trainable(cls) -> Any:
        """This class as a ``ddptrain.tune`` function trainable: one instance per trial, a
        ``step()`` per reported iteration, ``cleanup()`` when the trial ends or is stopped; a
        trial restarted from a checkpoint loads it and goes on from its iteration."""
        from ddptrain import tune  # here: `import ddptrain.util.sgd` must not import ddptrain.tune

        freq = cls._checkpoint_freq

        def trial(config: dict[str, Any]) -> None:
            trainable = cls(config)
            try:
                checkpoint = tune.get_checkpoint()
                if checkpoint is not None:
                    with checkpoint.as_directory() as folder:
                        with open(os.path.join(folder, _ITERATION_FILE)) as f:
                            saved = json.load(f)
                        trainable.load_checkpoint(os.path.join(folder, saved["path"]))
                        trainable._iteration = int(saved["iteration"])
                while True:
                    metrics = trainable.step()
                    trainable._iteration += 1
                    if freq and trainable._iteration % freq == 0:
                        with tempfile.TemporaryDirectory() as folder:
                            path = trainable.save_checkpoint(folder)
                            with open(os.path.join(folder, _ITERATION_FILE), "w") as f:
                                json.dump({"iteration": trainable._iteration, "path": os.path.relpath(path, folder)}, f)
                            tune.report(metrics, checkpoint=Checkpoint.from_directory(folder))
                    else:
                        tune.report(metrics)
            finally:
                trainable.cleanup()

        trial.__name__ = trial.__qualname__ = cls.__name__
        return tune.with_resources(trial, dict(cls._resources))


def as_trainable(
    trainer_cls: type[TorchTrainer],
    *args: Any,
    override_tune_step: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None,
    checkpoint_freq: int = 0,
    **kwargs: Any,
) -> type[BaseTorchTrainable]:
    """A :class:`BaseTorchTrainable` subclass whose trials build ``trainer_cls(**kwargs)`` with
    the trial's config merged into ``config``."""
    if args:
        raise TypeError("TorchTrainer.as_trainable takes keyword arguments only, as TorchTrainer does.")
    if override_tune_step is not None and len(inspect.signature(override_tune_step).parameters) != 2:
        raise ConfigError(
            "`override_tune_step` must take exactly 2 arguments (the trainer and an info dict), "
            f"got {override_tune_step!r}."
        )
    if isinstance(checkpoint_freq, bool) or not isinstance(checkpoint_freq, int) or checkpoint_freq < 0:
        raise ConfigError(f"`checkpoint_freq` must be an integer >= 0, got {checkpoint_freq!r}.")
    base_config = dict(kwargs.pop("config", None) or {})
    workers = int(kwargs.get("num_workers", 1))
    cpus = float(kwargs.get("num_cpus_per_worker", 1))
    gpus = workers if kwargs.get("use_gpu") is True else 0

    class TorchTrainable(BaseTorchTrainable):
        _resources: ClassVar[dict[str, float]] = {"CPU": workers * cpus, "GPU": float(gpus)}
        _checkpoint_freq: ClassVar[int] = checkpoint_freq

        def step(self) -> dict[str, Any]:
            if override_tune_step is not None:
                return override_tune_step(self.trainer, {"iteration": self.training_iteration})
            return super().step()

        def _create_trainer(self, config: dict[str, Any]) -> TorchTrainer:
            return trainer_cls(config={**base_config, **config}, **kwargs)

    operator = kwargs.get("training_operator_cls", trainer_cls)
    TorchTrainable.__name__ = TorchTrainable.__qualname__ = f"{getattr(operator, '__name__', 'Torch')}Trainable"
    return TorchTrainable
