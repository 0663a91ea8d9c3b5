"""Sweeps over ddptrain trainers and functions: Ray Tune's API (``ray.tune`` → ``ddptrain.tune``).

Each trial is a real ddptrain ``fit()`` (or a function reporting with ``tune.report``), run
concurrently with others as the machine's CPUs and GPUs allow. ``import ddptrain`` does not
import this package.

Example:
    >>> from ddptrain import tune
    >>> tuner = tune.Tuner(trainer, param_space={"train_loop_config": {"lr": tune.loguniform(1e-4, 1e-1)}},
    ...                    tune_config=tune.TuneConfig(metric="loss", mode="min", num_samples=8))
    >>> results = tuner.fit()
"""

from ddptrain.checkpoint import Checkpoint
from ddptrain.tune import schedulers, search, stopper
from ddptrain.tune.analysis import ExperimentAnalysis, run
from ddptrain.tune.result_grid import ResultGrid, TuneError, TuneResult
from ddptrain.tune.schedulers import ASHAScheduler, AsyncHyperBandScheduler, FIFOScheduler, MedianStoppingRule
from ddptrain.tune.search.basic_variant import BasicVariantGenerator
from ddptrain.tune.search.sample import (
    choice,
    grid_search,
    lograndint,
    loguniform,
    qloguniform,
    qrandint,
    qrandn,
    quniform,
    randint,
    randn,
    sample_from,
    uniform,
)
from ddptrain.tune.session import TrialStopped, TuneContext, get_checkpoint, get_context, report
from ddptrain.tune.stopper import Stopper
from ddptrain.tune.trainable import as_trainable, with_resources
from ddptrain.tune.trial import Trial
from ddptrain.tune.tuner import RunConfig, TuneConfig, Tuner

Result = TuneResult

__all__ = [
    "ASHAScheduler",
    "AsyncHyperBandScheduler",
    "BasicVariantGenerator",
    "Checkpoint",
    "ExperimentAnalysis",
    "FIFOScheduler",
    "MedianStoppingRule",
    "Result",
    "ResultGrid",
    "RunConfig",
    "Stopper",
    "Trial",
    "TrialStopped",
    "TuneConfig",
    "TuneContext",
    "TuneError",
    "TuneResult",
    "Tuner",
    "as_trainable",
    "choice",
    "get_checkpoint",
    "get_context",
    "grid_search",
    "lograndint",
    "loguniform",
    "qloguniform",
    "qrandint",
    "qrandn",
    "quniform",
    "randint",
    "randn",
    "report",
    "run",
    "sample_from",
    "schedulers",
    "search",
    "stopper",
    "uniform",
    "with_resources",
]
