"""RaySGD's ``TorchTrainer`` and ``TrainingOperator`` (``ray.util.sgd`` → ``ddptrain.util.sgd``).

A ``TrainingOperator`` subclass registers models, optimizers, loss, schedulers and data loaders
in ``setup(config)``; a ``TorchTrainer`` starts its workers once, and the program calls
``train()`` / ``validate()`` on them as often as it likes. See ``docs/raysgd.md``.

Example:
    >>> from ddptrain.util.sgd import TorchTrainer
    >>> trainer = TorchTrainer(training_operator_cls=MyOperator, num_workers=2)  # doctest: +SKIP
    >>> for _ in range(3):
    ...     print(trainer.train(), trainer.validate())
    >>> trainer.shutdown()
"""

from ddptrain.util.sgd.torch import TorchTrainer, TrainingOperator

__all__ = ["TorchTrainer", "TrainingOperator"]
