"""The sweep loop: create trials, run each in its own thread as a real ``fit()``, route reports
to the scheduler and searcher, bound concurrency by resources (driver side; what a trial
reserves, here or on a host list, is counted in ``ddptrain.tune._resources``, and what runs in
a trial's thread is ``ddptrain.tune._trial_run``).

Why threads: a trial's "driver" is ddptrain's own driver loop (``fit()``), which spends its
time waiting on its store and its agent's pipe; its workers are separate processes. Running
that loop in a thread of the sweep's process costs nothing to start (no second Python, no
second ``import torch``), lets the sweep see every report at once through a ``UserCallback``,
and keeps teardown in ddptrain's hands: to stop a trial, the callback raises
:class:`~ddptrain.tune.session.TrialStopped` from the trainer's driver loop, whose ``finally``
blocks tear the worker group down (SIGTERM, grace, SIGKILL of the agent's process group) as
for any failure. If the sweep's process dies, every agent sees its stdin close and takes its
workers down with it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import cloudpickle

from ddptrain import _env
from ddptrain.checkpoint import Checkpoint
from ddptrain.config import CheckpointConfig, FailureConfig, RunConfig
from ddptrain.progress import quiet
from ddptrain.storage import layout as storage
from ddptrain.tune._resources import Grant, Resources
from ddptrain.tune._trial_run import call_function, fit_trainer, pick_up_checkpoints
from ddptrain.tune.progress import StatusReporter
from ddptrain.tune.schedulers import TrialScheduler
from ddptrain.tune.search.basic_variant import BasicVariantGenerator
from ddptrain.tune.search.searcher import Searcher
from ddptrain.tune.session import TrialSession, TrialStopped, _set_session
from ddptrain.tune.stopper import Stopper
from ddptrain.tune.trainable import FunctionTrainable, PreparedTrial, TrainerTrainable
from ddptrain.tune.trial import Trial

__all__ = ["Sweep", "STATE_FILE"]

_logger = logging.getLogger(__name__)
STATE_FILE = "experiment_state.pkl"
_SAVE_INTERVAL_S = 1.0
_WAKE_S = 0.5


class Sweep:
    """One run of a sweep: its trials, their threads and the machine's free resources."""

    def __init__(
        self,
        *,
        trainable: TrainerTrainable | FunctionTrainable,
        path: str,
        trials: list[Trial],
        searcher: Searcher,
        scheduler: TrialScheduler,
        stopper: Stopper | None,
        num_samples: int,
        max_concurrent: int | None,
        time_budget_s: float | None,
        total_cpus: float,
        total_gpus: int | None,
        run_config: RunConfig,
        reporter: StatusReporter,
        new_trial_id: Callable[[int], str],
    ) -> None:
        self.trainable = trainable
        self.path = path
        self.name = os.path.basename(path)
        self.trials = trials
        self.searcher = searcher
        self.scheduler = scheduler
        self.stopper = stopper
        self.num_samples = num_samples
        self.max_concurrent = max_concurrent
        self.time_budget_s = time_budget_s
        self.resources = Resources(total_cpus, total_gpus)
        self.run_config = run_config
        self.reporter = reporter
        self.new_trial_id = new_trial_id
        self._cond = threading.Condition()
        self._running: dict[str, tuple[threading.Thread, TrialSession, Grant]] = {}
        self._waiting: tuple[Trial, PreparedTrial] | None = None
        self._searcher_done = False
        self._stop_all = False
        self._interrupted = False
        self._dirty = True
        self._saved_at = 0.0

    # ----------------------------------------------------------------- main loop
    def run(self) -> None:
        started = time.monotonic()
        try:
            with self._cond:
                while True:
                    if self.time_budget_s is not None and time.monotonic() - started > self.time_budget_s:
                        if not self._stop_all:
                            _logger.info("ddptrain.tune: time budget of %.0f s is spent", self.time_budget_s)
                        self._stop_everything("the sweep's time budget is spent")
                    if self.stopper is not None and not self._stop_all and self.stopper.stop_all():
                        self._stop_everything("the stopper stopped the sweep")
                    if not self._stop_all:
                        self._launch_what_fits()
                    if not self._running and (self._stop_all or self._nothing_left()):
                        break
                    self._save_if_due()
                    self.reporter.update(self.trials)
                    self._cond.wait(_WAKE_S)
        except BaseException:
            self._interrupt_trials()
            raise
        finally:
            with self._cond:
                self._save(force=True)
            self.reporter.update(self.trials, force=True)

    def _interrupt_trials(self) -> None:
        """Ctrl-C (or any error) in the sweep's loop: stop every running trial now, as Ctrl-C
        stops a plain ``fit()``, and wait (bounded) for their teardown.

        The trials' threads never see the KeyboardInterrupt, and a trial may not report again
        for a long time; so :class:`TrialStopped` is raised in each trial's thread
        asynchronously (``PyThreadState_SetAsyncExc``), exactly where a KeyboardInterrupt would
        land in a ``fit()`` of the main thread. ddptrain's driver loop then tears its worker
        group down in its ``finally`` blocks. The trials stay unfinished (``RUNNING`` in the
        saved state), so ``Tuner.restore`` resumes them.
        """
        with self._cond:
            self._interrupted = True
            self._stop_everything("the sweep was interrupted")
            running = [(thread, session) for thread, session, _ in self._running.values()]
        for thread, session in running:
            # Only into the trainable: never into the sweep's own bookkeeping after it.
            if session.in_trainable and thread.ident is not None and thread.is_alive():
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(TrialStopped))
        deadline = time.monotonic() + _env.shutdown_grace_s() + 5.0
        for thread, _ in running:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _stop_everything(self, reason: str) -> None:
        self._stop_all = True
        for _, session, _ in self._running.values():
            session.stop_requested = True
            trial = session.trial
            trial.stop_reason = trial.stop_reason or reason

    def _nothing_left(self) -> bool:
        return self._waiting is None and self._searcher_done and not any(t.status == "PENDING" for t in self.trials)

    def _launch_what_fits(self) -> None:
        while self.max_concurrent is None or len(self._running) < self.max_concurrent:
            candidate = self._waiting or self._next_trial()
            if candidate is None:
                return
            trial, prepared = candidate
            error = self.resources.never_fits(trial.trial_id, prepared)
            if error is not None:
                self._waiting = None
                trial.error, trial.error_msg, trial.status = error, str(error), "ERROR"
                self.reporter.trial_changed(trial)
                self._dirty = True
                continue
            grant = self.resources.acquire(prepared)
            if grant is None:
                self._waiting = candidate  # it waits for running trials to give resources back
                return
            self._waiting = None
            self._start(trial, prepared, grant)

    def _next_trial(self) -> tuple[Trial, PreparedTrial] | None:
        trial = next((t for t in self.trials if t.status == "PENDING"), None)
        if trial is None and not self._searcher_done:
            if isinstance(self.searcher, BasicVariantGenerator) or len(self.trials) < self.num_samples:
                trial_id = self.new_trial_id(len(self.trials))
                config = self.searcher.suggest(trial_id)
                if config is None:
                    return None
                if config == Searcher.FINISHED:
                    self._searcher_done = True
                    return None
                assert isinstance(config, dict)
                trial = Trial(trial_id, config, os.path.join(self.path, f"{self.trainable.name}_{trial_id}"))
                self.trials.append(trial)
                self._dirty = True
            else:
                self._searcher_done = True
        if trial is None:
            return None
        try:
            prepared = self.trainable.prepare(trial.config)
        except Exception as exc:
            trial.status, trial.error, trial.error_msg = "ERROR", exc, f"{type(exc).__name__}: {exc}"
            self.reporter.trial_changed(trial)
            return self._next_trial()
        return trial, prepared

    def add_all_variants(self) -> None:
        """Create every trial of a grid/random search now (they show as PENDING, and a restore
        runs exactly the same configs)."""
        if not isinstance(self.searcher, BasicVariantGenerator):
            return
        while True:
            trial_id = self.new_trial_id(len(self.trials))
            config = self.searcher.suggest(trial_id)
            if not isinstance(config, dict):
                break
            self.trials.append(Trial(trial_id, config, os.path.join(self.path, f"{self.trainable.name}_{trial_id}")))
        self._searcher_done = True

    # ----------------------------------------------------------------- one trial
    def _start(self, trial: Trial, prepared: PreparedTrial, grant: Grant) -> None:
        keep = (self.run_config.checkpoint_config or CheckpointConfig()).num_to_keep
        resources = {"CPU": prepared.cpus, "GPU": prepared.gpus}
        session = TrialSession(trial, self._on_report, self.name, resources, grant.gpu_ids, keep)
        trial.status = "RUNNING"
        trial.start_time = time.time()
        trial.stopped_early, trial.stop_reason = False, None
        self.scheduler.on_trial_add(trial.trial_id)
        thread = threading.Thread(
            target=self._run_trial,
            args=(session, prepared, grant),
            name=f"ddptrain-trial-{trial.trial_id}",
            daemon=True,
        )
        self._running[trial.trial_id] = (thread, session, grant)
        self.reporter.trial_changed(trial)
        self._save(force=True)  # a restore must know of every trial that started
        thread.start()

    def _run_trial(self, session: TrialSession, prepared: PreparedTrial, grant: Grant) -> None:
        trial = session.trial
        _set_session(session)
        fitted = False
        try:
            session.in_trainable = True
            trial.write_params()
            if isinstance(self.trainable, TrainerTrainable):
                with quiet():  # the sweep's own table says how each trial is doing
                    fit_trainer(self.trainable, trial, prepared, grant, self.run_config, self.path)
                fitted = True
            else:
                call_function(self.trainable, trial, self.run_config.failure_config or FailureConfig())
            status = "TERMINATED"
        except TrialStopped:
            status = "RUNNING" if self._interrupted else "TERMINATED"
        except BaseException as exc:
            status = "ERROR"
            trial.error, trial.error_msg = exc, f"{type(exc).__name__}: {exc}"
        finally:
            session.in_trainable = False
            _set_session(None)
        if isinstance(self.trainable, TrainerTrainable) and not fitted:
            pick_up_checkpoints(trial)
        with self._cond:
            trial.status = status
            trial.end_time = time.time()
            self.resources.release(self._running.pop(trial.trial_id)[2])
            result = trial.last_result or None
            self.scheduler.on_trial_complete(trial.trial_id, result)
            self.searcher.on_trial_complete(trial.trial_id, result, error=status == "ERROR")
            self.reporter.trial_changed(trial)
            self._save(force=True)
            self._cond.notify_all()

    def _on_report(self, trial: Trial, metrics: dict[str, Any], checkpoint: Checkpoint | None) -> bool:
        """One report of a trial (in the trial's thread): record it, ask whether to stop."""
        with self._cond:
            now = time.time()
            trial.iteration += 1
            previous = trial.last_result.get("timestamp", trial.start_time or now)
            result = dict(metrics)
            result.update(
                training_iteration=trial.iteration,
                trial_id=trial.trial_id,
                timestamp=now,
                time_this_iter_s=now - previous,
                time_total_s=now - (trial.start_time or now),
            )
            # The result line first, then the state naming the checkpoint: a driver killed in
            # between resumes from the previous checkpoint and drops this line (truncate_results),
            # instead of resuming after a report whose line was never written.
            trial.last_result = result
            trial.append_result(result)
            if checkpoint is not None:
                trial.checkpoint = checkpoint
                self._dirty = True
                self._save(force=True)  # a restore resumes from it
            self.searcher.on_trial_result(trial.trial_id, result)
            stop = False
            if self.stopper is not None and self.stopper(trial.trial_id, result):
                stop, trial.stop_reason = True, "the stop criteria were met"
            elif self.scheduler.on_trial_result(trial.trial_id, result) == TrialScheduler.STOP:
                max_t = getattr(self.scheduler, "max_t", None)
                time_attr = getattr(self.scheduler, "time_attr", "training_iteration")
                stop, trial.stopped_early = True, max_t is None or result.get(time_attr, 0) < max_t
                scheduler = type(self.scheduler).__name__
                trial.stop_reason = f"stopped by {scheduler}" if trial.stopped_early else f"reached {scheduler}'s max_t"
            self._dirty = True
            self._cond.notify_all()
            return stop

    # ----------------------------------------------------------------- state on disk
    def _save_if_due(self) -> None:
        if self._dirty and time.monotonic() - self._saved_at > _SAVE_INTERVAL_S:
            self._save(force=True)

    def _save(self, force: bool = False) -> None:
        if not (force or self._dirty):
            return
        state = {"trials": [t.state() for t in self.trials], "searcher_done": self._searcher_done}
        try:
            storage.write_atomic(os.path.join(self.path, STATE_FILE), cloudpickle.dumps(state), private=True)
        except OSError as exc:
            _logger.warning("ddptrain.tune: cannot save the sweep's state in %s: %r", self.path, exc)
            return
        self._dirty = False
        self._saved_at = time.monotonic()
