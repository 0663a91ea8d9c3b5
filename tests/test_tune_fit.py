"""ddptrain.tune with trainers as trials: every trial a real fit() with real worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from example_runner import run_example_in_process

import ddptrain as train
from ddptrain import tune
from ddptrain.tune.integration.ray_train import TuneReportCallback


def _timed_loop(config: dict[str, Any]) -> None:
    start = time.time()
    for step in range(config.get("steps", 2)):
        time.sleep(config.get("sleep", 0.0))
        world = train.get_context().get_world_size()
        train.report({"loss": config["lr"] * 10 + step, "start": start, "world_size": world})


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


@pytest.mark.slow
def test_grid_of_trainers_runs_two_at_a_time(storage: str) -> None:
    trainer = train.DataParallelTrainer(
        _timed_loop,
        train_loop_config={"lr": 1.0, "sleep": 0.1, "steps": 2},
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(name="grid", storage_path=storage),
    )
    tuner = tune.Tuner(
        trainer,
        param_space={
            "train_loop_config": {"lr": tune.grid_search([0.3, 0.1, 0.4, 0.2])},
            "scaling_config": {"num_workers": 2, "resources_per_worker": {"CPU": 0.5}},  # overrides the trainer's
        },
        tune_config=tune.TuneConfig(metric="loss", mode="min", max_concurrent_trials=2, total_cpus=2),
    )
    results = tuner.fit()
    assert len(results) == 4 and results.num_errors == 0
    assert [r.config["train_loop_config"]["lr"] for r in results] == [0.3, 0.1, 0.4, 0.2]
    best = results.get_best_result()
    assert best.config["train_loop_config"] == {"lr": 0.1} and best.metrics["loss"] == pytest.approx(2.0)
    # From each trial's start (as the sweep timed it) to its last report: 2 at a time, never 3.
    intervals = [
        (r.metrics_history[0]["timestamp"] - r.metrics_history[0]["time_total_s"], r.metrics["timestamp"])
        for r in results
    ]
    assert _max_overlap(intervals) == 2
    for r in results:
        assert Path(r.path).parent == Path(storage, "grid")
        lines = (Path(r.path) / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 2 and r.metrics["training_iteration"] == 2 and r.metrics["world_size"] == 2


def _quality_loop(config: dict[str, Any]) -> None:
    for step in range(1, 9):
        time.sleep(0.25)
        train.report({"acc": config["quality"] * step})


@pytest.mark.slow
def test_asha_stops_bad_trials_and_tears_their_workers_down(storage: str) -> None:
    trainer = train.DataParallelTrainer(_quality_loop, scaling_config=train.ScalingConfig(num_workers=1))
    analysis = tune.run(
        trainer,
        # The good ones first: the bad ones start once a good one has set the rungs' bars.
        config={"train_loop_config": {"quality": tune.grid_search([1.0, 0.9, 0.1, 0.05])}},
        scheduler=tune.ASHAScheduler(max_t=8, grace_period=1, reduction_factor=2),
        metric="acc",
        mode="max",
        max_concurrent_trials=2,
        storage_path=storage,
        name="asha",
        verbose=0,
    )
    good, _, bad, worse = analysis.trials
    assert analysis.best_config == {"train_loop_config": {"quality": 1.0}}
    assert good.last_result["training_iteration"] == 8 and not good.stopped_early
    for trial in (bad, worse):
        assert trial.status == "TERMINATED" and trial.stopped_early and trial.error is None
        history = trial.read_results()
        assert len(history) < 8, history  # stopped at a rung, before its last iteration
        # The worker group went down at once (the loop would have run 2 s more).
        assert trial.end_time - history[-1]["timestamp"] < 3.0
        assert "stopped by AsyncHyperBandScheduler" in (trial.stop_reason or "")


def _val_loop(config: dict[str, Any]) -> None:
    for epoch in range(5):
        train.report({"val_loss": 1.0 / config["lr"] / (epoch + 1), "epoch": epoch})
        time.sleep(0.1)


@pytest.mark.slow
def test_seed_001_tune_run_with_as_trainable_and_stop(storage: str) -> None:
    trainer = train.DataParallelTrainer(_val_loop, scaling_config=train.ScalingConfig(num_workers=1))
    # lr=0 makes a worker raise ZeroDivisionError: that trial fails, the others finish.
    analysis = tune.run(
        trainer.as_trainable(),  # Ray's DataParallelTrainer.as_trainable()
        config={"lr": tune.grid_search([1e-4, 0, 1e-3])},
        stop={"training_iteration": 2},
        storage_path=storage,
        name="seed001",
        raise_on_failed_trial=False,
        verbose=0,
    )
    assert analysis.get_best_config(metric="val_loss", mode="min") == {"lr": 1e-3}
    ok, failed = [analysis.trials[0], analysis.trials[2]], analysis.trials[1]
    for trial in ok:
        assert trial.status == "TERMINATED" and trial.last_result["training_iteration"] == 2
        assert trial.last_result["epoch"] == 1
    assert failed.status == "ERROR" and isinstance(failed.error, train.TrainingFailedError)
    assert "ZeroDivisionError" in str(failed.error) and failed.last_result == {}
    assert len(analysis.results_df) == 3


def _checkpoint_loop(config: dict[str, Any]) -> None:
    for epoch in range(6):
        with tempfile.TemporaryDirectory() as d:
            Path(d, "epoch.txt").write_text(str(epoch))
            train.report({"loss": 10 - epoch}, checkpoint=train.Checkpoint.from_directory(d))
        time.sleep(0.2)


def _fit_inside(config: dict[str, Any]) -> str:
    trainer = train.DataParallelTrainer(
        _checkpoint_loop,
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(
            name="train", storage_path=tune.get_context().get_trial_dir(), callbacks=[TuneReportCallback()]
        ),
    )
    trainer.fit()
    return "not reached: the sweep stops the trial"


@pytest.mark.slow
def test_tune_report_callback_forwards_reports_and_checkpoints(storage: str) -> None:
    results = tune.Tuner(
        _fit_inside,
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(name="cb", storage_path=storage, stop={"training_iteration": 4}, verbose=0),
    ).fit()
    (result,) = results
    assert result.error is None and result.return_value is None
    metrics = result.metrics
    assert metrics["training_iteration"] == 4 and metrics["loss"] == 7
    assert metrics["checkpoint_path"] == result.checkpoint.path
    assert Path(result.checkpoint.path, "epoch.txt").read_text() == "3"
    assert Path(result.checkpoint.path).parent == Path(result.path, "train")


_DRIVER = textwrap.dedent(
    """
    import sys, time
    import ddptrain as train
    from ddptrain import tune

    def loop(config):
        import json, os, tempfile, time
        from pathlib import Path
        start = 0
        if (ckpt := train.get_checkpoint()) is not None:
            start = int(Path(ckpt.path, "step.txt").read_text()) + 1
        with open(config["log"], "a") as f:
            f.write(json.dumps([config["x"], start]) + "\\n")
        for step in range(start, 3):
            time.sleep(0.3)
            with tempfile.TemporaryDirectory() as d:
                Path(d, "step.txt").write_text(str(step))
                train.report({"score": config["x"] * 10 + step}, checkpoint=train.Checkpoint.from_directory(d))

    if __name__ == "__main__":
        trainer = train.DataParallelTrainer(loop, scaling_config=train.ScalingConfig(num_workers=1))
        tune.Tuner(
            trainer,
            param_space={"train_loop_config": {"x": tune.grid_search([1, 2]), "log": sys.argv[2]}},
            tune_config=tune.TuneConfig(max_concurrent_trials=1),
            run_config=tune.RunConfig(name="sweep", storage_path=sys.argv[1]),
        ).fit()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_restore_after_the_driver_is_killed(storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / f"tune_driver_{os.getpid()}.py"
    script.write_text(_DRIVER)
    log = tmp_path / "starts.jsonl"
    sweep = Path(storage, "sweep")
    proc = subprocess.Popen([sys.executable, str(script), storage, str(log)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill it once trial 2 of 2 has committed a checkpoint
            starts = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
            if any(x == 2 for x, _ in starts) and [
                p for p in sweep.glob("*_00001/checkpoint_*") if p.name[11:].isdigit()
            ]:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the sweep did not reach its second trial")
        assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert tune.Tuner.can_restore(sweep) and not tune.Tuner.can_restore(tmp_path)
    # The same trainable again, its function imported from the driver's script by name.
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(script.stem)
    trainer = train.DataParallelTrainer(module.loop, scaling_config=train.ScalingConfig(num_workers=1))
    tuner = tune.Tuner.restore(str(sweep), trainable=trainer)
    results = tuner.fit()
    assert len(results) == 2 and results.num_errors == 0
    assert [r.metrics["score"] for r in results] == [12, 22]
    starts = [json.loads(line) for line in log.read_text().splitlines()]
    assert starts.count([1, 0]) == 1 and [x for x, _ in starts].count(1) == 1  # trial 1 was not run again
    second = [s for x, s in starts if x == 2]
    assert second[0] == 0 and len(second) == 2 and second[1] > 0  # resumed from its checkpoint


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tune_sweep_example(storage: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    # The example's main() in this process (a script driver would import torch and start a
    # fork server of its own first).
    monkeypatch.setenv("DDPTRAIN_STORAGE_PATH", storage)
    out = run_example_in_process(
        "tune_sweep.py", "--epochs", "2", "--lrs", "0.2,0.0001", monkeypatch=monkeypatch, capfd=capfd
    )
    assert "Sweep finished in" in out and ": 2 trials (" in out
    assert "best lr: 0.2" in out and "loaded the best checkpoint from" in out


_LONG_DRIVER = textwrap.dedent(
    """
    import signal, sys, time
    # Ctrl-C reaches this driver even when the test suite runs from a background job (whose
    # children inherit SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import ddptrain as train
    from ddptrain import tune

    def loop(config):
        for i in range(1000):
            time.sleep(0.1)
            train.report({"i": i})

    if __name__ == "__main__":
        trainer = train.DataParallelTrainer(
            loop, scaling_config=train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})
        )
        tune.Tuner(
            trainer,
            param_space={"train_loop_config": {"x": tune.grid_search([1, 2, 3])}},
            run_config=tune.RunConfig(name="sweep", storage_path=sys.argv[1]),
        ).fit()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_trial_and_leaves_them_resumable(storage: str, tmp_path: Path) -> None:
    script = tmp_path / "long_driver.py"
    script.write_text(_LONG_DRIVER)
    proc = subprocess.Popen(
        [sys.executable, str(script), storage], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # trials running and reporting
            if list(Path(storage, "sweep").glob("*/result.json")):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the trials did not start")
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert time.monotonic() - started < 10  # the trials' worker groups came down with it
    assert proc.returncode != 0 and "KeyboardInterrupt" in stderr and "terminate called" not in stderr
    tuner = tune.Tuner.restore(str(Path(storage, "sweep")), trainable=lambda config: None)
    assert [t["status"] for t in tuner._restored_state["trials"]] == ["PENDING", "PENDING", "PENDING"]
