"""``Tuner`` and ``TuneConfig``: run a sweep of trials and return a ``ResultGrid`` (driver side).

A sweep's folder ``<storage_path>/<name>/`` holds ``tuner.pkl`` (the param space and the
configs, for :meth:`Tuner.restore`), ``experiment_state.pkl`` (every trial's config, state
and last report, rewritten atomically as trials progress) and one folder per trial, named
``<trainable>_<trial id>``: the trial's run directory when the trainable is a trainer, with
``params.json`` and ``result.json`` (every report, with the sweep's fields) in any case.
How trials run (threads of this process, each a real ``fit()``) is explained in
``ddptrain.tune._sweep``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import cloudpickle

from ddptrain._checks import DEPRECATED, check_int
from ddptrain.config import RunConfig as TrainRunConfig
from ddptrain.errors import ConfigError
from ddptrain.storage import layout as storage
from ddptrain.storage.ownership import check_own_folder
from ddptrain.tune._sweep import STATE_FILE, Sweep
from ddptrain.tune.progress import StatusReporter
from ddptrain.tune.result_grid import ResultGrid, best_trial
from ddptrain.tune.schedulers import FIFOScheduler, TrialScheduler
from ddptrain.tune.search.basic_variant import BasicVariantGenerator
from ddptrain.tune.search.searcher import Searcher
from ddptrain.tune.stopper import as_stopper
from ddptrain.tune.trainable import TrainerTrainable, wrap_trainable
from ddptrain.tune.trial import Trial

_logger = logging.getLogger(__name__)

__all__ = ["Tuner", "TuneConfig", "RunConfig"]

TUNER_FILE = "tuner.pkl"


@dataclass
class TuneConfig:
    """How a sweep searches and schedules (Ray's ``tune.TuneConfig``).

    Args:
        metric: The metric to optimize; schedulers, searchers and ``get_best_result`` use it.
        mode: ``"min"`` or ``"max"``.
        search_alg: A :class:`~ddptrain.tune.search.Searcher` (default: grid/random search,
            ``BasicVariantGenerator``).
        scheduler: A :class:`~ddptrain.tune.schedulers.TrialScheduler` (default: FIFO, no early
            stopping), e.g. ``ASHAScheduler``.
        num_samples: Grid/random search: how many times the grid is repeated (each time with
            new random values). Other searchers: the number of trials.
        max_concurrent_trials: At most this many trials at once (default: as many as the CPUs
            and GPUs allow, or the slots of the hosts for trainers that run on a host list:
            see ``ddptrain.tune._resources``).
        time_budget_s: After this many seconds no trial starts and running ones stop at their
            next report.
        total_cpus: ddptrain's own: the CPUs trials may reserve together (default: the CPUs this
            process may use). A trial reserves ``num_workers * resources_per_worker["CPU"]``
            (1 per worker by default; fractions allowed); set it higher to oversubscribe.
        total_gpus: ddptrain's own: the GPUs trials may use (default: every visible GPU). GPUs
            are never oversubscribed: a trial waits until its devices are free.
    """

    metric: str | None = None
    mode: str | None = None
    search_alg: Searcher | None = None
    scheduler: TrialScheduler | None = None
    num_samples: int = 1
    max_concurrent_trials: int | None = None
    time_budget_s: float | None = None
    reuse_actors: bool | None = None
    trial_name_creator: Any = None
    trial_dirname_creator: Any = None
    total_cpus: float | None = None
    total_gpus: int | None = None

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in ("min", "max"):
            raise ConfigError(f"`mode` must be 'min' or 'max', got {self.mode!r}.")
        if self.metric is not None and not isinstance(self.metric, str):
            raise ConfigError(f"`metric` must be a metric name (str), got {self.metric!r}.")
        check_int("num_samples", self.num_samples, 1)
        if self.max_concurrent_trials is not None:
            check_int("max_concurrent_trials", self.max_concurrent_trials, 1)
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ConfigError(f"`time_budget_s` must be > 0, got {self.time_budget_s!r}.")
        if self.total_cpus is not None and not self.total_cpus > 0:
            raise ConfigError(f"`total_cpus` must be > 0, got {self.total_cpus!r}.")
        if self.search_alg is not None and not isinstance(self.search_alg, Searcher):
            raise ConfigError(f"`search_alg` must be a ddptrain.tune Searcher, got {self.search_alg!r}.")
        if self.scheduler is not None and not isinstance(self.scheduler, TrialScheduler):
            raise ConfigError(f"`scheduler` must be a ddptrain.tune TrialScheduler, got {self.scheduler!r}.")
        if self.trial_name_creator is not None or self.trial_dirname_creator is not None:
            raise ConfigError("`trial_name_creator` and `trial_dirname_creator` are not supported by ddptrain.tune.")


@dataclass
class RunConfig(TrainRunConfig):
    """``ddptrain.RunConfig`` plus Tune's ``stop`` and ``verbose`` (Ray's ``tune.RunConfig``).

    Args:
        stop: When a trial stops: a dict (stop once ``result[key] >= value`` for any key), a
            function ``(trial_id, result) -> bool`` or a ``Stopper``.
        verbose: 0: no status output; 1 (default): the status table and the summary.
    """

    def __post_init__(self) -> None:
        stop, verbose = self.stop, self.verbose
        self.stop = self.verbose = DEPRECATED  # ddptrain.RunConfig refuses them for a fit
        super().__post_init__()
        self.stop = None if stop == DEPRECATED else stop
        self.verbose = 1 if verbose == DEPRECATED else verbose
        as_stopper(self.stop)  # a bad `stop` is an error now


_REPLACED = ("failure_config", "checkpoint_config", "worker_runtime_env", "logging_config")


def _warn_replaced(trainers: TrainRunConfig, tuners: TrainRunConfig) -> None:
    """The Tuner's ``run_config`` replaces the trainer's for every trial, as in Ray: say which
    of the trainer's own settings are therefore not used (a ``max_failures`` given to the
    trainer, say, which its trials would otherwise silently lack)."""
    default = TrainRunConfig()
    dropped = [
        f"{name}={getattr(trainers, name)!r}"
        for name in _REPLACED
        if getattr(trainers, name) != getattr(default, name) and getattr(trainers, name) != getattr(tuners, name)
    ]
    if dropped:
        _logger.warning(
            "ddptrain.tune: the Tuner's run_config replaces the trainer's for every trial, as in Ray, so the "
            "trainer's %s is not used; give it to the Tuner's RunConfig.",
            ", ".join(dropped),
        )


def _plain(run_config: TrainRunConfig | None) -> tuple[TrainRunConfig, Any, int]:
    """(a ddptrain.RunConfig for the trials, the stop criteria, the verbosity)."""
    if run_config is None:
        return TrainRunConfig(), None, 1
    if not isinstance(run_config, TrainRunConfig):
        raise ConfigError(f"`run_config` must be a ddptrain.RunConfig, got {run_config!r}.")
    if isinstance(run_config, RunConfig):
        stop, verbose = run_config.stop, run_config.verbose
        fields = {f.name: getattr(run_config, f.name) for f in dataclasses.fields(TrainRunConfig)}
        fields.update(stop=DEPRECATED, verbose=DEPRECATED)
        return TrainRunConfig(**fields), stop, int(verbose)
    return run_config, None, 1


def _available_cpus() -> float:
    try:
        return float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return float(os.cpu_count() or 1)


class Tuner:
    """Run a trainable over a search space (Ray's ``tune.Tuner``).

    Args:
        trainable: A ddptrain trainer (each trial fits a copy with ``param_space`` applied to its
            constructor arguments: ``train_loop_config`` is merged, ``scaling_config``
            replaced), ``as_trainable(trainer)``, or a function ``f(config)`` that reports with
            ``ddptrain.tune.report`` (or fits a trainer with ``TuneReportCallback``).
        param_space: The search space: a nested dict of values, ``grid_search(...)`` and
            sampling domains (``choice``, ``uniform``, ``loguniform``, ``randint``...).
        tune_config: Search, scheduling and concurrency, see :class:`TuneConfig`.
        run_config: Name and storage of the sweep (``<storage_path>/<name>``), and for every
            trial its ``failure_config``, ``checkpoint_config``, ``callbacks``; ``stop`` and
            ``verbose`` with ``ddptrain.tune.RunConfig``. Default for a trainer: its own.

    Example:
        >>> trainer = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2))
        >>> tuner = Tuner(trainer, param_space={"train_loop_config": {"lr": tune.grid_search([1e-3, 1e-2])}},
        ...               tune_config=TuneConfig(metric="loss", mode="min", max_concurrent_trials=2))
        >>> best = tuner.fit().get_best_result()
    """

    def __init__(
        self,
        trainable: Any = None,
        *,
        param_space: dict[str, Any] | None = None,
        tune_config: TuneConfig | None = None,
        run_config: TrainRunConfig | None = None,
    ) -> None:
        if trainable is None:
            raise ConfigError("`Tuner` needs a trainable: a ddptrain trainer or a function `f(config)`.")
        self._trainable = wrap_trainable(trainable)
        if param_space is not None and not isinstance(param_space, dict):
            raise ConfigError(f"`param_space` must be a dict, got {param_space!r}.")
        self._param_space = dict(param_space or {})
        self._tune_config = tune_config if tune_config is not None else TuneConfig()
        if not isinstance(self._tune_config, TuneConfig):
            raise ConfigError(f"`tune_config` must be a ddptrain.tune.TuneConfig, got {self._tune_config!r}.")
        if isinstance(self._trainable, TrainerTrainable):
            if run_config is None:
                run_config = self._trainable.base_run_config()
            else:
                _warn_replaced(self._trainable.base_run_config(), run_config)
        self._run_config = run_config
        plain, self._stop, self._verbose = _plain(run_config)
        self._plain_run_config = plain
        if plain._remote() is not None:
            raise ConfigError(
                f"ddptrain.tune keeps sweeps on a local or shared file system; `storage_path` "
                f"{plain.storage_path!r} is remote storage. Pass a local folder (the trainers inside a "
                "sweep cannot use remote storage either, yet)."
            )
        root = plain._storage_root()
        name = plain.name or datetime.datetime.now().strftime(f"{self._trainable.name}_%Y-%m-%d_%H-%M-%S")
        self._path = str(root / name)
        self._trials: list[Trial] | None = None
        self._restored_state: dict[str, Any] | None = None
        self._exp_id = uuid.uuid4().hex[:5]
        self._results: ResultGrid | None = None

    # ----------------------------------------------------------------- run
    def fit(self) -> ResultGrid:
        """Run every trial (concurrently as resources allow) and return their results.

        A trial that fails is in ``ResultGrid.errors``; the others still run. Errors of the
        sweep itself (a bad config, an unwritable storage path) raise.
        """
        tc = self._tune_config
        metric, mode = tc.metric, tc.mode
        searcher = tc.search_alg if tc.search_alg is not None else BasicVariantGenerator()
        scheduler = tc.scheduler if tc.scheduler is not None else FIFOScheduler()
        self._plain_run_config._check_storage()
        os.makedirs(self._path, mode=0o700, exist_ok=True)
        check_own_folder(self._path, "sweep folder")
        restored = self._restored_state
        trials = [Trial.from_state(s) for s in restored["trials"]] if restored else []
        if not restored:
            self._save_tuner()  # before the searcher is set up: a restore sets up a fresh one
        searcher.set_search_properties(metric, mode, self._param_space)
        scheduler.set_search_properties(metric, mode)
        if isinstance(searcher, BasicVariantGenerator) and not restored:
            searcher.set_num_samples(tc.num_samples)
        elif restored and hasattr(searcher, "restore_trial"):
            for trial in trials:
                done = trial.status in ("TERMINATED", "ERROR")
                searcher.restore_trial(trial.trial_id, trial.config, trial.last_result, done, trial.status == "ERROR")
        reporter = StatusReporter(metric, mode, self._verbose)
        sweep = Sweep(
            trainable=self._trainable,
            path=self._path,
            trials=trials,
            searcher=searcher,
            scheduler=scheduler,
            stopper=as_stopper(self._stop),
            num_samples=tc.num_samples,
            max_concurrent=tc.max_concurrent_trials,
            time_budget_s=tc.time_budget_s,
            total_cpus=tc.total_cpus if tc.total_cpus is not None else _available_cpus(),
            total_gpus=tc.total_gpus,
            run_config=self._plain_run_config,
            reporter=reporter,
            new_trial_id=lambda index: f"{self._exp_id}_{index:05d}",
        )
        if not restored:
            sweep.add_all_variants()
        elif isinstance(searcher, BasicVariantGenerator) or restored.get("searcher_done"):
            sweep._searcher_done = True
        started = time.monotonic()
        sweep.run()
        best = best_trial(sweep.trials, metric, mode) if metric and mode else None
        reporter.summary(sweep.trials, time.monotonic() - started, best, self._path)
        self._trials = sweep.trials
        self._results = ResultGrid(sweep.trials, self._path, metric, mode)
        return self._results

    def get_results(self) -> ResultGrid:
        """The results of the last :meth:`fit` (or, after a restore, of the trials on disk)."""
        if self._results is not None:
            return self._results
        trials = [Trial.from_state(s) for s in (self._restored_state or {}).get("trials", [])]
        return ResultGrid(trials, self._path, self._tune_config.metric, self._tune_config.mode)

    def _save_tuner(self) -> None:
        data = {
            "param_space": self._param_space,
            "tune_config": self._tune_config,
            "run_config": self._run_config,
            "exp_id": self._exp_id,
        }
        try:
            payload = cloudpickle.dumps(data)
        except Exception as exc:
            raise ConfigError(f"The sweep's param space or configs cannot be pickled (for a restore): {exc!r}") from exc
        storage.write_atomic(os.path.join(self._path, TUNER_FILE), payload, private=True)

    # ----------------------------------------------------------------- restore
    @classmethod
    def can_restore(cls, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` is a sweep folder that :meth:`restore` can continue."""
        folder = os.path.expanduser(os.fspath(path))
        return os.path.exists(os.path.join(folder, TUNER_FILE)) and os.path.exists(os.path.join(folder, STATE_FILE))

    @classmethod
    def restore(
        cls,
        path: str | os.PathLike[str],
        trainable: Any,
        resume_unfinished: bool = True,
        resume_errored: bool = False,
        restart_errored: bool = False,
        param_space: dict[str, Any] | None = None,
    ) -> Tuner:
        """The Tuner of an interrupted sweep; its :meth:`fit` runs what is left.

        Finished trials are kept as they are. Trials that were running resume from their
        latest checkpoint (a trainer's run resumes by name; a function gets it from
        ``tune.get_checkpoint()``), and trials not started yet start.

        Args:
            path: The sweep's folder (``<storage_path>/<name>``).
            trainable: The same trainable as the interrupted sweep (it is not saved).
            resume_unfinished: Resume the trials that were running (else they stay unfinished).
            resume_errored: Run failed trials again, from their latest checkpoint.
            restart_errored: Run failed trials again from scratch.
            param_space: Replaces the saved param space (for values that could not be pickled).

        Raises:
            ConfigError: ``path`` is not a sweep folder.
        """
        folder = os.path.abspath(os.path.expanduser(os.fspath(path)))
        if not cls.can_restore(folder):
            raise ConfigError(
                f"{folder} is not a sweep that can be restored (it has no {TUNER_FILE} and {STATE_FILE})."
            )
        check_own_folder(folder, "sweep folder")  # what it unpickles must be the user's own
        with open(os.path.join(folder, TUNER_FILE), "rb") as f:
            saved = cloudpickle.load(f)
        with open(os.path.join(folder, STATE_FILE), "rb") as f:
            state = cloudpickle.load(f)
        run_config = saved["run_config"]
        run_config = (
            dataclasses.replace(run_config, name=os.path.basename(folder), storage_path=os.path.dirname(folder))
            if run_config is not None
            else TrainRunConfig(name=os.path.basename(folder), storage_path=os.path.dirname(folder))
        )
        tuner = cls(
            trainable,
            param_space=param_space if param_space is not None else saved["param_space"],
            tune_config=saved["tune_config"],
            run_config=run_config,
        )
        tuner._exp_id = saved["exp_id"]
        for trial in state["trials"]:
            if trial["status"] == "RUNNING" and resume_unfinished:
                trial["status"] = "PENDING"
            elif trial["status"] == "ERROR" and (resume_errored or restart_errored):
                trial["status"], trial["error_msg"] = "PENDING", None
                if restart_errored:
                    trial["checkpoint"] = None
            elif trial["status"] == "RUNNING":
                trial["status"] = "ERROR"
                trial["error_msg"] = "the sweep was interrupted while the trial ran (not resumed)"
        tuner._restored_state = state
        return tuner
