"""``TorchTrainer.as_trainable``: a RaySGD trainer as a ``ddptrain.tune`` trial (Ray 1.x's
``BaseTorchTrainable``): each iteration is one ``train()`` and, when the operator registered
a validation loader, one ``validate()``; their metrics (validation's on top) are what the
trial reports. ``ddptrain.tune`` is imported only when this is used.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from ddptrain.checkpoint import Checkpoint

if TYPE_CHECKING:
    from ddptrain.util.sgd.torch.torch_trainer import TorchTrainer

__all__: list[str] = []


def as_trainable(trainer_cls: type[TorchTrainer], *args: Any, **kwargs: Any) -> Any:
    """A function trainable (with the resources of its workers) that builds
    ``trainer_cls(*args, **kwargs)`` with the trial's config merged into ``config``, then
    trains and reports until the sweep stops it. The trial's checkpoint, if any, is loaded
    first; every ``checkpoint_freq`` iterations (ddptrain's own keyword; 0, the default:
    never) a checkpoint is reported with the metrics."""
    # Here, not at the top: `import ddptrain.util.sgd` must not import ddptrain.tune (see above).
    from ddptrain import tune

    if args:
        raise TypeError("TorchTrainer.as_trainable takes keyword arguments only, as TorchTrainer does.")
    checkpoint_freq = int(kwargs.pop("checkpoint_freq", 0))
    base_config = dict(kwargs.pop("config", None) or {})
    workers = int(kwargs.get("num_workers", 1))
    cpus = float(kwargs.get("num_cpus_per_worker", 1))

    def trial(config: dict[str, Any]) -> None:
        with trainer_cls(config={**base_config, **config}, **kwargs) as trainer:
            checkpoint = tune.get_checkpoint()
            if checkpoint is not None:
                with checkpoint.as_directory() as folder:
                    trainer.load(os.path.join(folder, "trainer.pt"))
            has_validation = any(trainer.apply_all_operators(lambda op: op.validation_loader is not None)[:1])
            iteration = 0
            while True:
                iteration += 1
                metrics = trainer.train()
                if has_validation:
                    metrics.update(trainer.validate())
                if checkpoint_freq and iteration % checkpoint_freq == 0:
                    with tempfile.TemporaryDirectory() as folder:
                        trainer.save(os.path.join(folder, "trainer.pt"))
                        tune.report(metrics, checkpoint=Checkpoint.from_directory(folder))
                else:
                    tune.report(metrics)

    trial.__name__ = trial.__qualname__ = f"{kwargs.get('training_operator_cls', trainer_cls).__name__}Trainable"
    gpus = workers if kwargs.get("use_gpu") is True else 0
    return tune.with_resources(trial, {"CPU": workers * cpus, "GPU": gpus})
