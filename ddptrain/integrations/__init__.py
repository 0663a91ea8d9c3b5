"""Experiment-tracking helpers under Ray's names (``ray.air.integrations`` → ``ddptrain.integrations``).

* :func:`ddptrain.integrations.mlflow.setup_mlflow` (``pip install ddptrain[mlflow]``)
* :func:`ddptrain.integrations.wandb.setup_wandb` (``pip install ddptrain[wandb]``)

Nothing is imported here: ``import ddptrain`` (or this package) never imports MLflow or W&B.
"""

__all__: list[str] = []
