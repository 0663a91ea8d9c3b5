"""``setup_mlflow``: MLflow tracking from inside a training function, on rank 0 only.

Ray's ``ray.air.integrations.mlflow.setup_mlflow`` under ddptrain (``pip install
ddptrain[mlflow]``; ``mlflow-skinny`` is enough for a ``sqlite:`` or server tracking URI).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from ddptrain import context
from ddptrain.errors import ConfigError
from ddptrain.integrations import _tracking

__all__ = ["setup_mlflow"]

_logger = logging.getLogger(__name__)


def _import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError as exc:
        raise _tracking.missing("mlflow", "mlflow") from exc
    return mlflow


def setup_mlflow(
    config: Mapping[str, Any] | None = None,
    tracking_uri: str | None = None,
    registry_uri: str | None = None,
    experiment_id: str | None = None,
    experiment_name: str | None = None,
    tracking_token: str | None = None,
    artifact_location: str | None = None,
    run_name: str | None = None,
    create_experiment_if_not_exists: bool = False,
    tags: Mapping[str, Any] | None = None,
    rank_zero_only: bool = True,
) -> Any:
    """Start (or resume) an MLflow run and return the ``mlflow`` module to log with.

    Call it inside the training function. On rank 0 (on every rank with
    ``rank_zero_only=False``) it sets the tracking URI, picks the experiment, starts a run,
    logs ``config`` as the run's parameters (nested keys joined with ``/``) and returns the
    ``mlflow`` module with that run active. Other ranks get a no-op object (mlflow is not
    imported there, only looked up, so a missing install fails on every rank): its methods accept
    anything and do nothing, so the same code runs on every rank and logs once.

    Settings come from the arguments, else from MLflow's own environment variables
    (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_ID``, ``MLFLOW_EXPERIMENT_NAME``, ...). The
    experiment is ``experiment_id`` if it exists, else ``experiment_name``; without either, it
    is the ddptrain run's name (``RunConfig.name``), created if needed. A named experiment that
    does not exist is created only with ``create_experiment_if_not_exists=True``, as in Ray.
    The run name defaults to the ddptrain run's name.

    Unlike Ray, a ddptrain run that restarts after a failure (``FailureConfig``) or is resumed
    logs on into the same MLflow run: its id is kept in ``<run dir>/tracking/``.

    Call ``mlflow.end_run()`` at the end of the training function to mark the run finished
    (a worker process leaves without Python's exit handlers, so it is not ended for you).

    Args:
        config: Logged as the run's parameters.
        tracking_uri: Where runs are stored (``sqlite:///…/mlflow.db``, ``http://server``).
            Every host of a multi-host run must reach it.
        registry_uri: The model registry's URI.
        experiment_id: An existing experiment's id (wins over ``experiment_name``).
        experiment_name: The experiment's name.
        tracking_token: Sets ``MLFLOW_TRACKING_TOKEN`` for a server that needs one.
        artifact_location: Where a newly created experiment keeps its artifacts.
        run_name: The MLflow run's name.
        create_experiment_if_not_exists: Create ``experiment_name`` if it does not exist.
        tags: Tags set on a new run.
        rank_zero_only: ``False``: every rank starts its own run.

    Returns:
        The ``mlflow`` module, or the no-op object on ranks that do not log.

    Raises:
        ImportError: MLflow is not installed (on every rank).
        ValueError: No experiment could be found or created from the arguments.

    Example::

        from ddptrain.integrations.mlflow import setup_mlflow

        def train_func(config):
            mlflow = setup_mlflow(config, tracking_uri="sqlite:////tmp/mlflow.db")
            for epoch in range(config["epochs"]):
                mlflow.log_metric("loss", train_one_epoch(), step=epoch)
            mlflow.end_run()
    """
    where = _tracking.caller()
    if rank_zero_only and where.rank not in (None, 0):
        return _tracking.noop_if_installed("mlflow", "mlflow")
    mlflow = _import_mlflow()
    if tracking_token:
        os.environ["MLFLOW_TRACKING_TOKEN"] = tracking_token
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    if registry_uri:
        mlflow.set_registry_uri(registry_uri)
    experiment = _experiment(
        mlflow, experiment_id, experiment_name, where.run_name, artifact_location, create_experiment_if_not_exists
    )
    run, resumed = _start_run(mlflow, experiment, run_name or where.run_name or experiment_name, tags, where)
    params = {key: value for key, value in _tracking.flatten(config).items() if key not in resumed}
    if params:
        mlflow.log_params(params)
    run_id = run.info.run_id

    def end_run(failed: bool) -> None:  # worker processes skip mlflow's atexit handler
        active = mlflow.active_run()
        if active is not None and active.info.run_id == run_id:
            mlflow.end_run(status="FAILED" if failed else "FINISHED")

    context.on_training_end(end_run)
    return mlflow


def _experiment(
    mlflow: Any,
    experiment_id: str | None,
    experiment_name: str | None,
    run_name: str | None,
    artifact_location: str | None,
    create: bool,
) -> str:
    """The id of the experiment to log to (Ray's order: id, then name, then create)."""
    from mlflow.exceptions import MlflowException

    experiment_id = experiment_id if experiment_id is not None else os.environ.get("MLFLOW_EXPERIMENT_ID")
    if experiment_id is not None:
        try:
            return str(mlflow.get_experiment(experiment_id).experiment_id)
        except MlflowException:
            pass  # as in Ray: fall back to the name
    name = experiment_name if experiment_name is not None else os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if name is None and run_name is not None:
        name, create = run_name, True  # the run's own experiment: nobody could have made it
    if name:
        found = mlflow.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        if create:
            return str(mlflow.create_experiment(name=name, artifact_location=artifact_location))
    raise ConfigError(
        f"setup_mlflow found no MLflow experiment with experiment_id={experiment_id!r} or "
        f"experiment_name={name!r} at {mlflow.get_tracking_uri()!r}: pass the id or name of an "
        "existing experiment, or `create_experiment_if_not_exists=True` with an `experiment_name`."
    )


def _start_run(
    mlflow: Any, experiment_id: str, run_name: str | None, tags: Mapping[str, Any] | None, where: _tracking.Caller
) -> tuple[Any, dict[str, str]]:
    """The active run (an earlier attempt's, resumed, when this ddptrain run had one) and the
    parameters it has already."""
    from mlflow.exceptions import MlflowException

    active = mlflow.active_run()
    if active is not None:  # as in Ray: a run the caller started already is the one
        return active, dict(mlflow.get_run(active.info.run_id).data.params)
    uri = mlflow.get_tracking_uri()
    saved = _tracking.load_id(where, "mlflow")
    if saved and saved.get("tracking_uri") == uri and saved.get("experiment_id") == experiment_id:
        try:
            previous = mlflow.get_run(saved["run_id"])
        except MlflowException:
            previous = None
        if previous is not None and previous.info.lifecycle_stage == "active":
            _logger.info("ddptrain: logging on into MLflow run %s", previous.info.run_id)
            return mlflow.start_run(run_id=previous.info.run_id), dict(previous.data.params)
    run = mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=dict(tags or {}))
    _tracking.save_id(where, "mlflow", {"tracking_uri": uri, "experiment_id": experiment_id, "run_id": run.info.run_id})
    return run, {}
