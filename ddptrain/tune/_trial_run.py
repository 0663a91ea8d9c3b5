"""What runs in one trial's thread: the trial's trainable, from its start to its end.

``Sweep`` decides when a trial starts and what its reports lead to; this module owns how the
trainable itself is run. A trainer trial is one ``fit()`` under a ``RunConfig`` derived from
the sweep's (a run folder inside the sweep's, the GPUs the trial was granted, the sweep's own
``TuneReportCallback``); when it stops or fails, its committed checkpoints are read back from
that folder. A function trial is called again from its last checkpoint after a failure, as
many times as ``FailureConfig.max_failures`` allows.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ddptrain.config import FailureConfig, RunConfig
from ddptrain.launch.hosts import GpuId
from ddptrain.result import Result
from ddptrain.storage.layout import RunLayout
from ddptrain.storage.read import read_metrics
from ddptrain.tune._resources import Grant
from ddptrain.tune.integration.ray_train import TuneReportCallback
from ddptrain.tune.trainable import FunctionTrainable, PreparedTrial, TrainerTrainable
from ddptrain.tune.trial import Trial

__all__ = ["fit_trainer", "pick_up_checkpoints", "call_function"]

_logger = logging.getLogger(__name__)


def fit_trainer(
    trainable: TrainerTrainable,
    trial: Trial,
    prepared: PreparedTrial,
    grant: Grant,
    sweep_config: RunConfig,
    sweep_path: str,
) -> None:
    """Run a trainer trial's ``fit()`` on what ``grant`` holds; record its checkpoints and
    return value on ``trial``. A restored trial's fit resumes its run."""
    assert prepared.trainer is not None
    if RunLayout(trial.path).run_json.exists():  # restored: the fit resumes the run
        trial.iteration = len(read_metrics(trial.path))
    # The sweep adds its own TuneReportCallback: one the user added would report twice.
    callbacks = [c for c in trainable.trainer.run_config.callbacks or [] if not isinstance(c, TuneReportCallback)]
    callbacks += [
        c
        for c in sweep_config.callbacks or []
        if all(c is not o for o in callbacks) and not isinstance(c, TuneReportCallback)
    ]
    run_config = _trial_run_config(trial, sweep_config, sweep_path, callbacks, grant.gpu_ids)
    result = trainable.run(prepared, run_config, grant.hosts)
    trial.checkpoint = result.checkpoint
    trial.best_checkpoints = result.best_checkpoints
    trial.return_value = result.return_value


def _trial_run_config(
    trial: Trial, base: RunConfig, sweep_path: str, trainer_callbacks: list[Any], gpu_ids: list[GpuId]
) -> RunConfig:
    """The trial's ``RunConfig``: the sweep's failure, checkpoint and logging settings, its run
    folder inside the sweep's, and ``CUDA_VISIBLE_DEVICES`` set to the GPUs it was granted."""
    runtime_env = dict(base.worker_runtime_env or {})
    if gpu_ids:
        env_vars = dict(runtime_env.get("env_vars") or {})
        env_vars["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        runtime_env["env_vars"] = env_vars
    return RunConfig(
        name=os.path.basename(trial.path),
        storage_path=sweep_path,
        failure_config=base.failure_config,
        checkpoint_config=base.checkpoint_config,
        callbacks=[*trainer_callbacks, TuneReportCallback(add_checkpoint_path=False)],
        worker_runtime_env=runtime_env,
        logging_config=base.logging_config,
    )


def pick_up_checkpoints(trial: Trial) -> None:
    """A stopped or failed trainer trial: its committed checkpoints, from its run directory."""
    if not RunLayout(trial.path).run_json.exists():
        return
    try:
        result = Result.from_path(trial.path)
    except Exception as exc:  # a broken index: the trial's own error says more
        _logger.warning("ddptrain.tune: cannot read the checkpoints of %s: %r", trial.path, exc)
        return
    trial.checkpoint = result.checkpoint
    trial.best_checkpoints = result.best_checkpoints


def call_function(trainable: FunctionTrainable, trial: Trial, failure_config: FailureConfig) -> None:
    """Call a function trial until it returns, restarting it from its last checkpoint (or from
    scratch) after each failure that ``failure_config`` allows; the last failure is raised."""
    if trial.checkpoint is not None:  # restored: reports go on from the checkpoint's iteration
        number = os.path.basename(trial.checkpoint.path).removeprefix("checkpoint_")
        if number.isdigit():
            trial.iteration = int(number)
            trial.truncate_results(trial.iteration)
    elif trial.iteration or trial.last_result:  # restored without a checkpoint: from scratch
        trial.iteration = 0
        trial.truncate_results(0)
    while True:
        try:
            trial.return_value = trainable.run(trial.config)
            return
        except Exception as exc:
            trial.num_failures += 1
            allowed = failure_config.max_failures
            if allowed != -1 and trial.num_failures > allowed:
                raise
            _logger.warning(
                "ddptrain.tune: trial %s failed (%r); restarting it from %s (failure %d of %s allowed)",
                trial.trial_id,
                exc,
                trial.checkpoint.path if trial.checkpoint else "scratch",
                trial.num_failures,
                "unlimited" if allowed == -1 else allowed,
            )
