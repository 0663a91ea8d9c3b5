"""Legacy ``tune.run(...)`` and the ``ExperimentAnalysis`` it returns (Ray's older API)."""

from __future__ import annotations

import os
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.config import CheckpointConfig, FailureConfig
from ddptrain.tune.result_grid import ResultGrid, TuneError, best_trial
from ddptrain.tune.schedulers import TrialScheduler
from ddptrain.tune.search.searcher import Searcher
from ddptrain.tune.trainable import with_resources
from ddptrain.tune.trial import Trial
from ddptrain.tune.tuner import RunConfig, TuneConfig, Tuner

__all__ = ["run", "ExperimentAnalysis"]


class ExperimentAnalysis:
    """What ``tune.run`` returns: the trials and the best of them.

    Args:
        trials: The sweep's trials.
        path: The sweep's folder.
        default_metric: ``tune.run(metric=...)``, used when a method gets no metric.
        default_mode: ``tune.run(mode=...)``.
    """

    def __init__(
        self, trials: list[Trial], path: str, default_metric: str | None = None, default_mode: str | None = None
    ) -> None:
        self.trials = list(trials)
        self.experiment_path = path
        self.default_metric = default_metric
        self.default_mode = default_mode

    def _metric_mode(self, metric: str | None, mode: str | None) -> tuple[str, str]:
        metric, mode = metric or self.default_metric, mode or self.default_mode
        if metric is None or mode is None:
            raise ValueError(
                "No metric/mode: pass `metric=` and `mode=` here or to `tune.run(..., metric=..., mode=...)`."
            )
        return metric, mode

    def get_best_trial(self, metric: str | None = None, mode: str | None = None, scope: str = "last") -> Trial | None:
        """The trial with the best ``metric`` (``scope``: ``"last"``, ``"all"``, ``"avg"``...)."""
        metric, mode = self._metric_mode(metric, mode)
        return best_trial(self.trials, metric, mode, scope)

    def get_best_config(self, metric: str | None = None, mode: str | None = None, scope: str = "last") -> Any:
        """The config of the best trial, or ``None`` if no trial reported ``metric``."""
        trial = self.get_best_trial(metric, mode, scope)
        return trial.config if trial is not None else None

    def get_best_checkpoint(
        self, trial: Trial, metric: str | None = None, mode: str | None = None
    ) -> Checkpoint | None:
        """The latest checkpoint of ``trial``."""
        return trial.checkpoint

    @property
    def best_trial(self) -> Trial | None:
        return self.get_best_trial()

    @property
    def best_config(self) -> Any:
        return self.get_best_config()

    @property
    def best_result(self) -> dict[str, Any] | None:
        """The last report of the best trial."""
        trial = self.get_best_trial()
        return dict(trial.last_result) if trial is not None else None

    @property
    def best_checkpoint(self) -> Checkpoint | None:
        trial = self.get_best_trial()
        return trial.checkpoint if trial is not None else None

    @property
    def best_logdir(self) -> str | None:
        trial = self.get_best_trial()
        return trial.path if trial is not None else None

    @property
    def results(self) -> dict[str, dict[str, Any]]:
        """Each trial's last report, by trial id."""
        return {t.trial_id: dict(t.last_result) for t in self.trials}

    @property
    def results_df(self) -> Any:
        """One row per trial (its last report and config), indexed by trial id (needs pandas)."""
        frame = ResultGrid(self.trials, self.experiment_path).get_dataframe()
        return frame.set_index("trial_id", drop=False)

    def dataframe(self, metric: str | None = None, mode: str | None = None) -> Any:
        """One row per trial: its last report, or its best one by ``metric``/``mode``."""
        return ResultGrid(self.trials, self.experiment_path).get_dataframe(metric, mode)

    @property
    def trial_dataframes(self) -> dict[str, Any]:
        """Every report of each trial, as a DataFrame per trial id (needs pandas)."""
        import pandas as pd

        return {t.trial_id: pd.DataFrame(t.read_results()) for t in self.trials}


def run(
    run_or_experiment: Any,
    *,
    name: str | None = None,
    metric: str | None = None,
    mode: str | None = None,
    stop: Any = None,
    time_budget_s: float | None = None,
    config: dict[str, Any] | None = None,
    resources_per_trial: dict[str, float] | None = None,
    num_samples: int = 1,
    storage_path: str | os.PathLike[str] | None = None,
    local_dir: str | os.PathLike[str] | None = None,
    search_alg: Searcher | None = None,
    scheduler: TrialScheduler | None = None,
    checkpoint_config: CheckpointConfig | None = None,
    verbose: int = 1,
    max_failures: int = 0,
    max_concurrent_trials: int | None = None,
    raise_on_failed_trial: bool = True,
    resume: bool | str = False,
    callbacks: list[Any] | None = None,
    **unsupported: Any,
) -> ExperimentAnalysis:
    """Run a sweep, the legacy way (Ray's ``tune.run``); prefer :class:`Tuner`.

    Args:
        run_or_experiment: A trainer, ``as_trainable(trainer)`` or a function ``f(config)``.
        config: The search space (``param_space``).
        stop: Dict (``{"training_iteration": 2}``), function ``(trial_id, result) -> bool`` or Stopper.
        storage_path: Where the sweep's folder goes (``local_dir`` is the older name).
        name: The sweep's folder name.
        resources_per_trial: ``{"cpu": n, "gpu": m}`` for a function trainable.
        max_failures: Restarts of a failing trial (its ``FailureConfig``).
        raise_on_failed_trial: Raise a :class:`TuneError` if any trial failed.
        resume: Continue the sweep ``<storage_path>/<name>`` if it exists.

    Example:
        >>> analysis = tune.run(train_fn, config={"lr": tune.grid_search([1e-4, 1e-3])},
        ...                     stop={"training_iteration": 2})
        >>> analysis.get_best_config(metric="val_loss", mode="min")
    """
    if unsupported:
        raise TypeError(f"tune.run() got arguments ddptrain does not support: {sorted(unsupported)}.")
    trainable = run_or_experiment
    if resources_per_trial is not None:
        trainable = with_resources(trainable, resources_per_trial)
    run_config = RunConfig(
        name=name,
        storage_path=storage_path if storage_path is not None else local_dir,
        stop=stop,
        verbose=verbose,
        failure_config=FailureConfig(max_failures=max_failures),
        checkpoint_config=checkpoint_config,
        callbacks=callbacks,
    )
    tune_config = TuneConfig(
        metric=metric,
        mode=mode,
        search_alg=search_alg,
        scheduler=scheduler,
        num_samples=num_samples,
        max_concurrent_trials=max_concurrent_trials,
        time_budget_s=time_budget_s,
    )
    tuner = Tuner(trainable, param_space=config, tune_config=tune_config, run_config=run_config)
    if resume and name is not None and Tuner.can_restore(tuner._path):
        tuner = Tuner.restore(tuner._path, trainable, resume_errored=resume == "ERRORED_ONLY")
    tuner.fit()
    trials = tuner._trials or []
    analysis = ExperimentAnalysis(trials, tuner._path, metric, mode)
    failed = [t for t in trials if t.status == "ERROR"]
    if failed and raise_on_failed_trial:
        names = ", ".join(t.trial_name for t in failed)
        raise TuneError(f"Trials did not complete: {names}. First error: {failed[0].error_msg}") from failed[0].error
    return analysis
