"""ddptrain.tune: sweeps of real ddptrain fits and of functions (real processes, real gloo)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ddptrain as train
from ddptrain import tune
from ddptrain.tune.search.basic_variant import generate_variants


# ----------------------------------------------------------------- search spaces (no processes)
def test_search_space_grid_order_nested_and_seeded() -> None:
    space = {
        "lr": tune.grid_search([0.1, 0.2, 0.3]),
        "model": {"width": tune.choice([8, 16]), "depth": tune.randint(1, 4)},
        "drop": tune.quniform(0.0, 1.0, 0.25),
        "wd": tune.loguniform(1e-5, 1e-2),
        "x": tune.uniform(-1, 1),
        "noise": tune.randn(10.0, 0.1),
        "double_width": tune.sample_from(lambda spec: spec.config.model.width * 2),
        "fixed": "adam",
    }
    first = generate_variants(space, 2, np.random.RandomState(7))
    again = generate_variants(space, 2, np.random.RandomState(7))
    other = generate_variants(space, 2, np.random.RandomState(8))
    assert first == again and first != other
    assert [c["lr"] for c in first] == [0.1, 0.2, 0.3, 0.1, 0.2, 0.3]  # grid order, repeated num_samples times
    for config in first:
        assert config["model"]["width"] in (8, 16) and 1 <= config["model"]["depth"] < 4
        assert config["drop"] in (0.0, 0.25, 0.5, 0.75, 1.0)
        assert 1e-5 <= config["wd"] < 1e-2 and -1 <= config["x"] < 1 and 9 < config["noise"] < 11
        assert config["double_width"] == 2 * config["model"]["width"] and config["fixed"] == "adam"
    # Ray's idiom: seeding numpy's global state makes the default search reproducible.
    np.random.seed(3)
    a = [t for t in generate_variants({"x": tune.uniform(0, 1)}, 3, np.random.mtrand._rand)]
    np.random.seed(3)
    b = [t for t in generate_variants({"x": tune.uniform(0, 1)}, 3, np.random.mtrand._rand)]
    assert a == b
    with pytest.raises(ValueError, match="lower < upper"):
        tune.uniform(1, 0)
    with pytest.raises(ValueError, match="lower > 0"):
        tune.loguniform(0, 1)


def test_configs_and_imports_are_checked() -> None:
    with pytest.raises(train.ConfigError, match="`mode` must be 'min' or 'max'"):
        tune.TuneConfig(mode="best")
    with pytest.raises(train.ConfigError, match="`max_concurrent_trials` must be >= 1, got 0"):
        tune.TuneConfig(max_concurrent_trials=0)
    with pytest.raises(ValueError, match="`stop` must be a dict"):
        tune.RunConfig(stop=3)
    with pytest.raises(train.ConfigError, match="Trainable classes"):
        tune.Tuner(dict)
    with pytest.raises(RuntimeError, match="inside a trial"):
        tune.report({"x": 1})
    with pytest.raises(TypeError, match=r"`grid_search` takes a list of the values to try, .* got 3"):
        tune.grid_search(3)  # type: ignore[arg-type]
    # `import ddptrain` imports neither the sweep layer nor optuna.
    code = "import sys, ddptrain; print('ddptrain.tune' in sys.modules, 'optuna' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_asha_and_median_rule_decisions() -> None:
    asha = tune.ASHAScheduler(metric="acc", mode="max", max_t=8, grace_period=1, reduction_factor=2)
    for trial in "abc":
        asha.on_trial_add(trial)
    step = {trial: 0 for trial in "abc"}

    def result(trial: str, acc: float) -> str:
        step[trial] += 1
        return asha.on_trial_result(trial, {"acc": acc, "training_iteration": step[trial]})

    assert result("a", 1.0) == "CONTINUE"  # the first at a rung sets its bar
    assert result("b", 0.5) == "STOP"  # below the top half at rung 1
    assert result("c", 2.0) == "CONTINUE"
    assert [result("a", 1.0) for _ in range(6)] == ["CONTINUE"] * 6
    assert result("a", 1.0) == "STOP"  # max_t reached
    with pytest.raises(ValueError, match="needs a metric and a mode"):
        tune.ASHAScheduler().on_trial_add("x")

    rule = tune.MedianStoppingRule(time_attr="training_iteration", metric="loss", mode="min", grace_period=2)
    rule.set_search_properties(None, None)
    for trial in "abcd":
        rule.on_trial_add(trial)
    for it in (1, 2):
        for trial, loss in zip("abc", (1.0, 1.1, 0.9), strict=True):
            assert rule.on_trial_result(trial, {"loss": loss, "training_iteration": it}) == "CONTINUE"
    assert rule.on_trial_result("d", {"loss": 0.5, "training_iteration": 2}) == "CONTINUE"
    assert rule.on_trial_result("d", {"loss": 5.0, "training_iteration": 3}) == "CONTINUE"  # its best is good
    assert rule.on_trial_result("b", {"loss": 3.0, "training_iteration": 3}) == "STOP"  # worse than the median


# ----------------------------------------------------------------- function trainables (threads only)
def _objective(config: dict[str, Any]) -> None:
    if config["x"] == 2:
        raise ValueError("x=2 is a bad value")
    for step in range(3):
        tune.report({"score": -((config["x"] - 3) ** 2) + step, "step": step})


def test_function_trainable_grid_errors_and_status_lines(storage: str, capsys: pytest.CaptureFixture[str]) -> None:
    tuner = tune.Tuner(
        _objective,
        param_space={"x": tune.grid_search([1, 2, 3, 4])},
        tune_config=tune.TuneConfig(metric="score", mode="max"),
        run_config=tune.RunConfig(name="fn", storage_path=storage),
    )
    results = tuner.fit()
    assert len(results) == 4 and [r.config["x"] for r in results] == [1, 2, 3, 4]
    assert results.num_errors == 1 and results.num_terminated == 3
    assert "x=2 is a bad value" in str(results.errors[0]) and results[1].error is results.errors[0]
    best = results.get_best_result()
    assert best.config == {"x": 3} and best.metrics["score"] == 2 and best.metrics["training_iteration"] == 3
    assert [m["training_iteration"] for m in best.metrics_history] == [1, 2, 3]
    assert results.get_best_result("score", "min", scope="all").config == {"x": 1}
    with pytest.raises(ValueError, match=r"metric 'acc' .*; the trials' last reports have: .*score, "):
        results.get_best_result("acc", "max")  # a misspelt metric: the names there are
    assert Path(best.path).parent == Path(storage, "fn") and (Path(best.path) / "result.json").exists()
    frame = results.get_dataframe()
    assert list(frame["config/x"]) == [1, 2, 3, 4]
    out = capsys.readouterr().out
    assert "Trial _objective_" in out and "ERROR" in out and "x=2 is a bad value" in out
    assert "Sweep finished in" in out and "Best trial" in out and str(Path(storage, "fn")) in out


def _checkpointing(config: dict[str, Any]) -> None:
    import tempfile

    start = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        start = json.loads(Path(checkpoint.path, "state.json").read_text())["step"] + 1
    with open(config["log"], "a") as f:
        f.write(f"{config['x']} {start}\n")
    for step in range(start, 4):
        time.sleep(config["sleep"])
        with tempfile.TemporaryDirectory() as d:
            Path(d, "state.json").write_text(json.dumps({"step": step}))
            tune.report({"loss": config["x"] + step}, checkpoint=tune.Checkpoint.from_directory(d))


def test_stop_dict_callable_and_checkpoints_of_functions(storage: str) -> None:
    log = os.path.join(storage, "starts.txt")
    os.makedirs(storage)
    analysis = tune.run(
        _checkpointing,
        config={"x": tune.grid_search([1, 2]), "log": log, "sleep": 0.0},
        stop={"training_iteration": 2},
        storage_path=storage,
        name="stopdict",
        verbose=0,
    )
    assert [t.last_result["training_iteration"] for t in analysis.trials] == [2, 2]
    with pytest.raises(tune.TuneError, match="x=2 is a bad value"):  # raise_on_failed_trial=True
        tune.run(_objective, config={"x": tune.grid_search([2, 3])}, storage_path=storage, name="raises", verbose=0)
    assert analysis.get_best_config(metric="loss", mode="min")["x"] == 1
    assert all(t.status == "TERMINATED" and not t.stopped_early for t in analysis.trials)
    assert os.path.basename(analysis.trials[0].checkpoint.path) == "checkpoint_000002"
    analysis = tune.run(
        _checkpointing,
        config={"x": tune.grid_search([1, 2]), "log": log, "sleep": 0.0},
        stop=lambda trial_id, result: result["loss"] >= 3,
        storage_path=storage,
        name="stopfn",
        metric="loss",
        mode="max",
        verbose=0,
    )
    assert [t.last_result["loss"] for t in analysis.trials] == [3, 3]
    assert analysis.best_config["x"] in (1, 2) and analysis.best_result["loss"] == 3
    assert list(analysis.results_df["config/x"]) == [1, 2]


def _flaky(config: dict[str, Any]) -> None:
    import tempfile

    checkpoint = tune.get_checkpoint()
    start = 0 if checkpoint is None else int(Path(checkpoint.path, "step").read_text()) + 1
    with open(config["log"], "a") as f:
        f.write(f"{start}\n")
    for step in range(start, 3):
        if step == 1 and Path(config["log"]).read_text().count("\n") <= config["fail_times"]:
            raise RuntimeError("flaky")
        with tempfile.TemporaryDirectory() as d:
            Path(d, "step").write_text(str(step))
            tune.report({"step": step}, checkpoint=tune.Checkpoint.from_directory(d))


def test_failed_function_trials_restart_and_resume_errored(storage: str, tmp_path: Path) -> None:
    # FailureConfig applies per trial: the function is called again from its checkpoint.
    log = tmp_path / "once.txt"
    results = tune.Tuner(
        _flaky,
        param_space={"log": str(log), "fail_times": 1},
        run_config=tune.RunConfig(
            name="retry", storage_path=storage, verbose=0, failure_config=train.FailureConfig(max_failures=1)
        ),
    ).fit()
    assert results.num_errors == 0 and results[0].metrics["step"] == 2
    assert log.read_text().split() == ["0", "1"]  # the second call resumed at step 1
    assert [m["training_iteration"] for m in results[0].metrics_history] == [1, 2, 3]
    # Without retries the trial fails; a restore with resume_errored=True runs it again.
    log = tmp_path / "twice.txt"
    tune.Tuner(
        _flaky,
        param_space={"log": str(log), "fail_times": 1},
        run_config=tune.RunConfig(name="errored", storage_path=storage, verbose=0),
    ).fit()
    path = os.path.join(storage, "errored")
    assert tune.Tuner.restore(path, _flaky).get_results().num_errors == 1
    results = tune.Tuner.restore(path, _flaky, resume_errored=True).fit()
    assert results.num_errors == 0 and results[0].metrics["step"] == 2
    assert log.read_text().split() == ["0", "1"]


def _sleepy(config: dict[str, Any]) -> None:
    tune.report({"phase": 0})
    time.sleep(config["sleep"])
    tune.report({"phase": 1})


def test_cpu_resources_bound_concurrent_trials(storage: str) -> None:
    results = tune.Tuner(
        tune.with_resources(_sleepy, {"cpu": 1}),
        param_space={"i": tune.grid_search([0, 1, 2, 3, 4]), "sleep": 0.4},
        tune_config=tune.TuneConfig(total_cpus=2),
        run_config=tune.RunConfig(name="cpus", storage_path=storage, verbose=0),
    ).fit()
    intervals = [(r.metrics_history[0]["timestamp"], r.metrics["timestamp"]) for r in results]
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    live = [sum(d for _, d in events[: i + 1]) for i in range(len(events))]
    assert max(live) == 2  # two 1-CPU trials at a time on 2 CPUs
    assert results.num_errors == 0
    # A trial bigger than the sweep's CPUs fails with a clear error instead of waiting forever.
    results = tune.Tuner(
        tune.with_resources(_sleepy, {"CPU": 3}),
        param_space={"sleep": 0.0},
        tune_config=tune.TuneConfig(total_cpus=2),
        run_config=tune.RunConfig(name="big", storage_path=storage, verbose=0),
    ).fit()
    assert isinstance(results.errors[0], train.ConfigError)
    assert "needs 3 CPU(s) and 0 GPU(s) but the sweep has 2 CPU(s)" in str(results.errors[0])


def _gpu_trial(config: dict[str, Any]) -> None:
    import ddptrain.torch

    ctx = tune.get_context()
    time.sleep(config["sleep"])  # the trials overlap: each holds its GPU id while the other starts
    tune.report(
        {
            "ids": ctx.get_gpu_ids(),
            "indices": ctx.get_device_indices(),
            "devices": [str(d) for d in ctx.get_devices()],
            "device": str(ctx.get_device()),
            "torch_device": str(ddptrain.torch.get_device()),  # the worker-side helper agrees in a trial
        }
    )


def test_function_trials_get_their_gpus_as_devices_of_the_sweeps_process(
    storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No CUDA call: the sweep grants ids of its CUDA_VISIBLE_DEVICES, and the trials (threads of
    # the sweep's process, where torch numbers devices by position in that list) map them.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    results = tune.Tuner(
        tune.with_resources(_gpu_trial, {"GPU": 1}),
        param_space={"i": tune.grid_search([0, 1, 2]), "sleep": 0.3},
        run_config=tune.RunConfig(name="gpus", storage_path=storage, verbose=0),
    ).fit()
    assert results.num_errors == 0
    index_of = {5: 0, 7: 1}
    for result in results:
        (gpu,) = result.metrics["ids"]  # Ray's ids: as CUDA_VISIBLE_DEVICES names them
        assert gpu in index_of
        assert result.metrics["indices"] == [index_of[gpu]]
        assert result.metrics["devices"] == [f"cuda:{index_of[gpu]}"]
        assert result.metrics["device"] == result.metrics["torch_device"] == f"cuda:{index_of[gpu]}"
    assert {tuple(r.metrics["ids"]) for r in results} == {(5,), (7,)}  # both GPUs were used
    # Without CUDA_VISIBLE_DEVICES the ids are the indices; a trial without GPUs gets the CPU.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    results = tune.Tuner(
        tune.with_resources(_gpu_trial, {"GPU": 2}),
        param_space={"sleep": 0.0},
        tune_config=tune.TuneConfig(total_gpus=2),
        run_config=tune.RunConfig(name="all", storage_path=storage, verbose=0),
    ).fit()
    assert results.num_errors == 0
    assert {k: results[0].metrics[k] for k in ("ids", "indices", "devices")} == {
        "ids": [0, 1],
        "indices": [0, 1],
        "devices": ["cuda:0", "cuda:1"],
    }
    results = tune.Tuner(
        tune.with_resources(_gpu_trial, {"CPU": 1}),
        param_space={"sleep": 0.0},
        run_config=tune.RunConfig(name="cpu", storage_path=storage, verbose=0),
    ).fit()
    assert results.num_errors == 0
    assert {k: results[0].metrics[k] for k in ("ids", "indices", "devices", "device", "torch_device")} == {
        "ids": [],
        "indices": [],
        "devices": ["cpu"],
        "device": "cpu",
        "torch_device": "cpu",
    }


def test_function_trials_get_gpus_the_sweep_sees_by_uuid(storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A scheduler (SLURM, Kubernetes) may name the sweep's GPUs by UUID: they are ids all the same.
    gpu, mig = "GPU-3f2a9c1e-0000-4000-8000-000000000001", "MIG-77b1c3d4-0000-4000-8000-000000000002"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{gpu},{mig}")
    results = tune.Tuner(
        tune.with_resources(_gpu_trial, {"GPU": 1}),
        param_space={"i": tune.grid_search([0, 1]), "sleep": 0.3},
        run_config=tune.RunConfig(name="uuids", storage_path=storage, verbose=0),
    ).fit()
    assert results.num_errors == 0, results.errors
    seen = {tuple(r.metrics["ids"]): r.metrics["devices"] for r in results}
    assert seen == {(gpu,): ["cuda:0"], (mig,): ["cuda:1"]}


def test_a_trainer_trial_runs_with_the_uuids_it_was_granted(tmp_path: Path) -> None:
    from ddptrain.tune._trial_run import _trial_run_config
    from ddptrain.tune.trial import Trial

    gpu = "GPU-3f2a9c1e-0000-4000-8000-000000000001"
    trial = Trial(trial_id="t1", config={}, path=str(tmp_path / "t1"))
    config = _trial_run_config(trial, tune.RunConfig(), str(tmp_path), [], [gpu, 3])
    assert config.worker_runtime_env is not None
    assert config.worker_runtime_env["env_vars"]["CUDA_VISIBLE_DEVICES"] == f"{gpu},3"


def test_gpu_ids_map_to_positions_in_cuda_visible_devices() -> None:
    from ddptrain.tune.session import _device_indices

    assert _device_indices([3], "2,3") == [1]
    assert _device_indices([7, 5], "5,7") == [1, 0]
    assert _device_indices([3], "GPU-8d3c0f2a-0000-0000-0000-000000000000,3") == [1]  # a UUID keeps its position
    assert _device_indices([0, 2], None) == [0, 2]  # unset: torch's indices are the ids
    assert _device_indices([], "") == []
    assert _device_indices(["MIG-77b1", "GPU-3f2a"], "GPU-3f2a,MIG-77b1") == [1, 0]
    with pytest.raises(RuntimeError, match=r"GPU id\(s\) \[4\] granted to the trial are not in"):
        _device_indices([4], "5,7")


def _forever(config: dict[str, Any]) -> None:
    while True:
        tune.report({"t": time.time()})
        time.sleep(0.05)


def test_time_budget_stops_running_trials(storage: str) -> None:
    started = time.monotonic()
    results = tune.Tuner(
        _forever,
        param_space={"i": tune.grid_search([0, 1, 2])},
        tune_config=tune.TuneConfig(time_budget_s=1.0, max_concurrent_trials=1),
        run_config=tune.RunConfig(name="budget", storage_path=storage, verbose=0),
    ).fit()
    assert time.monotonic() - started < 5
    assert results.num_errors == 0 and results.num_terminated == 1 and results[0].metrics["training_iteration"] > 3


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_table_is_redrawn_in_place_on_a_terminal() -> None:
    from ddptrain.tune.progress import StatusReporter
    from ddptrain.tune.trial import Trial

    trials = [Trial(f"t_{i:05d}", {"lr": lr, "fixed": 1}, f"/x/f_t_{i:05d}") for i, lr in enumerate([0.1, 0.2])]
    trials[0].status, trials[0].iteration, trials[0].last_result = "RUNNING", 3, {"loss": 0.5}
    trials[1].status, trials[1].stopped_early = "TERMINATED", True
    terminal = _Terminal()
    reporter = StatusReporter("loss", "min", stream=terminal)
    reporter.trial_changed(trials[0])  # no state lines on a terminal: the table shows it
    reporter.update(trials, force=True)
    first = terminal.getvalue()
    assert "\x1b[" not in first and first.splitlines()[0] == "Trials: 1 RUNNING, 1 STOPPED"
    header, row0, row1 = first.splitlines()[1:]
    assert header.split() == ["Trial", "name", "status", "lr", "iter", "loss"]  # only the varying param
    assert row0.split() == ["f_t_00000", "RUNNING", "0.1", "3", "0.5"] and row1.split()[1] == "STOPPED"
    reporter.update(trials, force=True)
    assert terminal.getvalue()[len(first) :].startswith("\x1b[4F\x1b[J")  # back up over the 4 lines, redraw


# ----------------------------------------------------------------- Optuna
def test_optuna_search_is_reproducible_with_a_seed(storage: str) -> None:
    pytest.importorskip("optuna")
    from ddptrain.tune.search.optuna import OptunaSearch

    def configs(name: str) -> list[dict[str, Any]]:
        tuner = tune.Tuner(
            lambda config: tune.report({"loss": (config["x"] - 1) ** 2 + config["k"]}),
            param_space={"x": tune.uniform(-3, 3), "k": tune.randint(0, 3), "opt": tune.choice(["a", "b"]), "c": 5},
            tune_config=tune.TuneConfig(
                metric="loss", mode="min", num_samples=5, search_alg=OptunaSearch(seed=1), max_concurrent_trials=1
            ),
            run_config=tune.RunConfig(name=name, storage_path=storage, verbose=0),
        )
        results = tuner.fit()
        assert results.num_errors == 0 and len(results) == 5
        return [r.config for r in results]

    first, second = configs("a"), configs("b")
    assert first == second
    assert all(-3 <= c["x"] <= 3 and c["k"] in (0, 1, 2) and c["opt"] in "ab" and c["c"] == 5 for c in first)
    assert len({c["x"] for c in first}) == 5


def test_optuna_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)
    from ddptrain.tune.search.optuna import OptunaSearch

    with pytest.raises(ImportError, match=r'pip install "ddptrain\[tune\]"'):
        OptunaSearch()


_OPTUNA_DRIVER = textwrap.dedent(
    """
    import os, sys, tempfile, time
    from ddptrain import tune
    from ddptrain.tune.search.optuna import OptunaSearch

    def objective(config):
        start = 0
        if (checkpoint := tune.get_checkpoint()) is not None:
            start = int(open(os.path.join(checkpoint.path, "step")).read()) + 1
        with open(config["log"], "a") as f:
            f.write(f"{config['x']} {start}\\n")
        for step in range(start, 3):
            time.sleep(config["sleep"])
            with tempfile.TemporaryDirectory() as d:
                open(os.path.join(d, "step"), "w").write(str(step))
                tune.report({"loss": config["x"] ** 2 + step}, checkpoint=tune.Checkpoint.from_directory(d))

    def tuner(storage, name, log, sleep):
        return tune.Tuner(
            objective,
            param_space={"x": tune.uniform(-1, 1), "log": log, "sleep": sleep},
            tune_config=tune.TuneConfig(
                metric="loss", mode="min", num_samples=5, search_alg=OptunaSearch(seed=0), max_concurrent_trials=1
            ),
            run_config=tune.RunConfig(name=name, storage_path=storage, verbose=0),
        )

    if __name__ == "__main__":
        tuner(sys.argv[1], "killed", sys.argv[2], 0.3).fit()
    """
)


@pytest.mark.timeout(120)
def test_restore_an_optuna_sweep_of_functions(storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("optuna")
    script = tmp_path / f"optuna_driver_{os.getpid()}.py"
    script.write_text(_OPTUNA_DRIVER)
    log = tmp_path / "starts.txt"
    proc = subprocess.Popen([sys.executable, str(script), storage, str(log)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill it while its third trial runs, after a checkpoint
            if (
                log.exists()
                and len(log.read_text().splitlines()) == 3
                and [p for p in Path(storage).glob("*/*_00002/checkpoint_*") if p.name[11:].isdigit()]
            ):
                break
            time.sleep(0.02)
        else:
            pytest.fail("the sweep did not reach its third trial")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(script.stem)
    results = tune.Tuner.restore(os.path.join(storage, "killed"), module.objective).fit()
    assert len(results) == 5 and results.num_errors == 0
    starts = [line.split() for line in log.read_text().splitlines()]
    assert [s for _, s in starts].count("0") == 5 and len(starts) == 6  # only the killed trial ran twice
    assert starts[3][0] == starts[2][0] and starts[3][1] != "0"  # ... and resumed from its checkpoint
    assert [m["training_iteration"] for m in results[2].metrics_history] == [1, 2, 3]
    # The same configs as a sweep that was never interrupted (the sampler's sequence kept).
    fresh = module.tuner(storage, "fresh", str(tmp_path / "fresh.txt"), 0.0).fit()
    assert [r.config["x"] for r in results] == [r.config["x"] for r in fresh]


def test_pretty_print_writes_rays_yaml_of_a_result() -> None:
    from ddptrain.tune.logger import pretty_print

    result = {
        "batch_count": 16,
        "epoch": 1,
        "last_train_loss": 0.15574650466442108,
        "num_samples": 1000,
        "profile": {"mean_apply_s": 2.639293670654297e-05, "train_epoch_s": 0.023712158203125},
        "config": {"lr": 0.1},  # dropped, as are None values
        "trial_id": None,
    }
    # RaySGD's guide: print(pretty_print(trainer.train(profile=True)))
    assert pretty_print(result) == textwrap.dedent(
        """\
        batch_count: 16
        epoch: 1
        last_train_loss: 0.15574650466442108
        num_samples: 1000
        profile:
          mean_apply_s: 2.639293670654297e-05
          train_epoch_s: 0.023712158203125
        """
    )
    yaml = pytest.importorskip("yaml")  # Ray's own implementation is yaml.safe_dump of the JSON-clean dict
    odd = {
        "np": np.float32(0.5),
        "npi": np.int64(3),
        "arr": np.arange(2),
        "nan": float("nan"),
        "inf": float("-inf"),
        "big": 1e20,
        "list": [1, "a", {"x": 1, "y": [1, 2]}, [3, 4], {}, []],
        "strings": ["hello world", "true", "1.5", "", "a: b", "-x", "- x", "it's", "2024-01-01", "a #b", "012", "y"],
        "nested": {"a": {"b": {"c": None}}, "d": {}},
        "obj": Path("/tmp/x"),
    }
    expected = {**odd, "np": 0.5, "npi": 3, "arr": [0, 1], "obj": "/tmp/x"}
    assert pretty_print(odd) == yaml.safe_dump(json.loads(json.dumps(expected)), default_flow_style=False)
    assert pretty_print({"a": 1, "b": 2}, exclude={"b"}) == "a: 1\n"


def test_a_tuner_run_config_says_which_trainer_settings_it_replaces(tmp_path: Path, caplog) -> None:
    """As in Ray, the Tuner's run_config replaces the trainer's for every trial: a trainer's
    ``max_failures`` was silently dropped, so its trials failed at the first crash."""
    import logging

    def make(**run: Any) -> train.DataParallelTrainer:
        return train.DataParallelTrainer(lambda: None, run_config=train.RunConfig(**run))

    sweep = tune.RunConfig(name="s", storage_path=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        tune.Tuner(make(failure_config=train.FailureConfig(max_failures=-1)), run_config=sweep)
        said = [r.getMessage() for r in caplog.records if "replaces the trainer's" in r.getMessage()]
        assert len(said) == 1 and "failure_config=FailureConfig(max_failures=-1" in said[0], said
        caplog.clear()
        tune.Tuner(make(name="only-a-name"), run_config=sweep)  # nothing of the trainer's is lost
        same = tune.RunConfig(name="s", storage_path=str(tmp_path), failure_config=train.FailureConfig(2))
        tune.Tuner(make(failure_config=train.FailureConfig(2)), run_config=same)
        assert not [r for r in caplog.records if "replaces the trainer's" in r.getMessage()]
