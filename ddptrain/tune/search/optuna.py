"""``OptunaSearch``: trial configs suggested by an Optuna sampler (TPE by default).

Optuna is an optional dependency (``pip install "ddptrain[tune]"``); it is imported when an
``OptunaSearch`` is created, never by ``import ddptrain`` or ``import ddptrain.tune``.
Trials are asked and told through Optuna's ask-and-tell interface, so concurrent trials work.
"""

from __future__ import annotations

import copy
from typing import Any

from ddptrain.tune.search.basic_variant import _is_grid, _set, _walk
from ddptrain.tune.search.sample import Categorical, Domain, Float, Function, Integer
from ddptrain.tune.search.searcher import Searcher

__all__ = ["OptunaSearch"]


def _import_optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ImportError(
            "`OptunaSearch` needs Optuna, which is not installed. Install the extra: "
            '`pip install "ddptrain[tune]"` (or `pip install optuna`).'
        ) from None
    return optuna


def _distribution(optuna: Any, path: str, domain: Domain) -> Any:
    dists = optuna.distributions
    if isinstance(domain, Categorical):
        return dists.CategoricalDistribution(list(domain.categories))
    if isinstance(domain, Float):
        if domain.log and domain.q is not None:
            raise ValueError(f"`{path}`: Optuna cannot sample a quantized log-uniform float; use loguniform.")
        return dists.FloatDistribution(domain.lower, domain.upper, log=domain.log, step=domain.q)
    if isinstance(domain, Integer):
        high = domain.upper if domain.q is not None else domain.upper - 1  # randint excludes `upper`
        return dists.IntDistribution(domain.lower, high, log=domain.log, step=domain.q or 1)
    raise ValueError(
        f"`{path}`: OptunaSearch cannot sample {domain!r}; use choice, uniform, quniform, loguniform, "
        "randint, qrandint or lograndint."
    )


class OptunaSearch(Searcher):
    """Suggest configs with Optuna (Ray's ``ray.tune.search.optuna.OptunaSearch``).

    Args:
        space: The search space; default: the Tuner's ``param_space``. Values that are not
            domains are passed through unchanged. ``grid_search``, ``randn`` and ``sample_from``
            are not supported (a ``ValueError`` says which key).
        metric: The metric to optimize (default: ``TuneConfig.metric``).
        mode: ``"min"`` or ``"max"`` (default: ``TuneConfig.mode``).
        points_to_evaluate: Configs tried first (Optuna's ``enqueue_trial``).
        sampler: An Optuna sampler; default ``TPESampler(seed=seed)``.
        seed: Seed of the default sampler: the same seed gives the same configs (with one
            trial at a time; concurrent trials may see results in a different order).
        evaluated_rewards: Accepted for compatibility with Ray; not supported.

    Example:
        >>> from ddptrain.tune.search.optuna import OptunaSearch
        >>> tune_config = tune.TuneConfig(search_alg=OptunaSearch(seed=0), metric="loss", mode="min", num_samples=8)
    """

    def __init__(
        self,
        space: dict[str, Any] | None = None,
        metric: str | None = None,
        mode: str | None = None,
        points_to_evaluate: list[dict[str, Any]] | None = None,
        sampler: Any = None,
        seed: int | None = None,
        evaluated_rewards: list[Any] | None = None,
    ) -> None:
        super().__init__(metric, mode)
        self._optuna = _import_optuna()
        if evaluated_rewards:
            raise ValueError("`evaluated_rewards` is not supported by ddptrain's OptunaSearch.")
        self._space = space
        self._points = list(points_to_evaluate or [])
        self._sampler = sampler if sampler is not None else self._optuna.samplers.TPESampler(seed=seed)
        self._study: Any = None
        self._distributions: dict[str, Any] = {}
        self._paths: dict[str, tuple[Any, ...]] = {}
        self._trials: dict[str, Any] = {}
        self._restored: dict[str, dict[str, Any]] = {}

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict[str, Any]) -> bool:
        super().set_search_properties(metric, mode, config)
        if self._space is None:
            self._space = config
        if self.metric is None or self.mode is None:
            raise ValueError(
                "OptunaSearch needs a metric and a mode: pass `TuneConfig(metric=..., mode=...)` "
                "or `OptunaSearch(metric=..., mode=...)`."
            )
        self._setup()
        return True

    def _setup(self) -> None:
        assert self._space is not None
        for path, value in _walk(self._space):
            name = "/".join(str(p) for p in path)
            if _is_grid(value) or isinstance(value, Function):
                kind = "grid_search" if _is_grid(value) else "sample_from"
                raise ValueError(f"`{name}`: OptunaSearch does not support {kind}; use choice or a range.")
            if isinstance(value, Domain):
                self._distributions[name] = _distribution(self._optuna, name, value)
                self._paths[name] = path
        self._optuna.logging.set_verbosity(self._optuna.logging.WARNING)
        direction = "minimize" if self.mode == "min" else "maximize"
        self._study = self._optuna.create_study(sampler=self._sampler, direction=direction)
        for point in self._points:
            self._study.enqueue_trial(point)

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if self._study is None:
            raise RuntimeError("OptunaSearch.suggest() was called before set_search_properties().")
        trial = self._study.ask(fixed_distributions=self._distributions)
        self._trials[trial_id] = trial
        assert self._space is not None
        config = copy.deepcopy(self._space)
        for name, path in self._paths.items():
            _set(config, path, trial.params[name])
        return config

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        trial = self._trials.get(trial_id)
        step = result.get("training_iteration")
        if trial is not None and self.metric in result and isinstance(step, int):
            trial.report(result[self.metric], step)

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        if trial_id in self._restored:
            self._add_trial(self._restored.pop(trial_id), result, error)
            return
        trial = self._trials.pop(trial_id, None)
        if trial is None:
            return
        state = self._optuna.trial.TrialState
        if error or not result or self.metric not in result:
            self._study.tell(trial, state=state.FAIL)
        else:
            self._study.tell(trial, float(result[self.metric]))

    def restore_trial(
        self, trial_id: str, config: dict[str, Any], result: dict[str, Any] | None, done: bool, error: bool
    ) -> None:
        """A trial of an earlier run of the sweep (``Tuner.restore``), in creation order.

        Its config was asked of the study then; asking again (and discarding the answer as a
        failed trial, which samplers ignore) keeps the sampler's random sequence where the
        uninterrupted sweep's would be, so the next trials do not repeat earlier configs.
        A finished trial is added with its result; an unfinished one when it completes.
        """
        if self._study is None:
            raise RuntimeError("OptunaSearch.restore_trial() was called before set_search_properties().")
        skipped = self._study.ask(fixed_distributions=self._distributions)
        self._study.tell(skipped, state=self._optuna.trial.TrialState.FAIL)
        if done:
            self._add_trial(config, result, error)
        else:
            self._restored[trial_id] = config

    def _add_trial(self, config: dict[str, Any], result: dict[str, Any] | None, error: bool) -> None:
        params = {}
        for name, path in self._paths.items():
            value: Any = config
            for key in path:
                value = value[key]
            params[name] = value
        state = self._optuna.trial.TrialState
        failed = error or not result or self.metric not in result
        trial = self._optuna.trial.create_trial(
            params=params,
            distributions=self._distributions,
            value=None if failed else float(result[self.metric]),  # type: ignore[index]
            state=state.FAIL if failed else state.COMPLETE,
        )
        self._study.add_trial(trial)
