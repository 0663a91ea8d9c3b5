"""Asynchronous validation (``ValidationConfig``, ``report(validation=...)``): the validation
runs in a process of its own beside training, its metrics merge into the checkpoint's and rank
it, a validation that raises or hangs is reported without killing training, ``fit()`` waits for
the validations left (bounded), and the consistency modes of ``get_all_reported_checkpoints``."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

import ddptrain as train
from ddptrain import CheckpointConsistencyMode, ReportedCheckpointStatus, ValidationConfig, ValidationTaskConfig
from ddptrain.cli.runs import main_show
from ddptrain.errors import ConfigError
from tests.test_ray_compat import ddptrain_run


def _fit(
    loop: Any, storage: str, validate: Any, workers: int = 1, keep: int | None = None, **kwargs: Any
) -> train.Result:
    return train.DataParallelTrainer(
        loop,
        scaling_config=train.ScalingConfig(num_workers=workers),
        validation_config=ValidationConfig(validate, task_config=ValidationTaskConfig(fn_kwargs=kwargs)),
        run_config=train.RunConfig(
            name="run",
            storage_path=storage,
            checkpoint_config=train.CheckpointConfig(num_to_keep=keep, checkpoint_score_attribute="acc"),
        ),
    ).fit()


def _save(step: int) -> train.Checkpoint:
    folder = tempfile.mkdtemp()
    Path(folder, "step").write_text(str(step))
    return train.Checkpoint(folder)


def _report(step: int, **kwargs: Any) -> None:
    checkpoint = _save(step)
    train.report({"loss": 1.0, "step": step}, checkpoint=checkpoint, **kwargs)
    shutil.rmtree(checkpoint.path)  # SYNC: it is committed


def _step(checkpoint: train.Checkpoint) -> int:
    return int(Path(checkpoint.path, "step").read_text())


def _listed(reported: list[train.ReportedCheckpoint]) -> list[tuple[str, str, Any]]:
    return [(os.path.basename(r.checkpoint.path), r.status.value, r.metrics.get("acc")) for r in reported]


def _validation_lines(storage: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in Path(storage, "run", "metrics.jsonl").read_text().splitlines()]
    return [line["validation"] for line in lines if "validation" in line]


def _scored(checkpoint: train.Checkpoint, scores: dict[str, float], delay_s: float) -> dict[str, Any]:
    time.sleep(delay_s)
    step = _step(checkpoint)
    return {"acc": scores[str(step)], "loss": -step, "pid": os.getpid()}


def test_validation_runs_beside_training_merges_and_ranks_by_its_metric(storage: str, capfd) -> None:
    def loop() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        _report(0, validation=True)
        # COMMITTED does not wait for the validation: the checkpoint is listed, pending.
        seen["committed"] = _listed(train.get_all_reported_checkpoints(CheckpointConsistencyMode.COMMITTED))
        seen["timed_out"] = _listed(train.get_all_reported_checkpoints(timeout_s=0.05))
        # While #1 is validated, #2 and #3 commit: with num_to_keep=1 a checkpoint without its
        # score would be deleted, but #1 is pending validation and is kept.
        _report(1, validation=True)
        _report(2, validation=ValidationTaskConfig(fn_kwargs={"scores": {"2": 0.5}, "delay_s": 0.0}))
        seen["validated"] = _listed(train.get_all_reported_checkpoints())  # VALIDATED: waits for all three
        seen["pid"] = os.getpid()
        return seen

    result = _fit(loop, storage, _scored, keep=1, scores={"0": 0.9, "1": 0.1}, delay_s=0.3)
    seen = result.return_value
    assert seen["committed"] == [("checkpoint_000001", "PENDING_VALIDATION", None)]
    assert seen["timed_out"] == [("checkpoint_000001", "PENDING_VALIDATION", None)]
    # Ranked by the validated metric (worst first): #2 (0.1) was deleted once validated, the
    # best (#1, 0.9) and the latest (#3) are kept.
    assert seen["validated"] == [("checkpoint_000003", "VALIDATED", 0.5), ("checkpoint_000001", "VALIDATED", 0.9)]
    assert sorted(p.name for p in Path(storage, "run").glob("checkpoint_*")) == [
        "checkpoint_000001",
        "checkpoint_000003",
    ]
    [(best, metrics)] = result.best_checkpoints
    assert os.path.basename(best.path) == "checkpoint_000001"
    assert metrics["acc"] == 0.9 and metrics["loss"] == 0 and metrics["step"] == 0  # same keys overwrite
    assert result.metrics == {"loss": -2, "step": 2, "acc": 0.5, "pid": result.metrics["pid"]}
    lines = _validation_lines(storage)
    assert [(v["checkpoint"], v["metrics"]["acc"], v["error"]) for v in lines] == [
        ("checkpoint_000001", 0.9, None),
        ("checkpoint_000002", 0.1, None),
        ("checkpoint_000003", 0.5, None),
    ]
    # Not a training worker, nor the driver: a process of its own.
    assert {v["metrics"]["pid"] for v in lines}.isdisjoint({seen["pid"], os.getpid()})
    err = capfd.readouterr().err
    assert "checkpoint_000001 validated in" in err
    assert "is not among the metrics" not in err  # "acc" comes from the validation
    assert main_show(str(Path(storage, "run")), as_json=False) == 0
    shown = capfd.readouterr().out
    assert "checkpoint_000001  loss=0 step=0 acc=0.9 pid=" in shown and "[best, validated]" in shown


def _fails_or_waits(checkpoint: train.Checkpoint, delay_s: float) -> dict[str, Any]:
    if _step(checkpoint) == 0:
        raise ValueError("no layer named 'head' in this checkpoint")
    time.sleep(delay_s)
    return {"acc": 0.75}


def test_a_validation_that_raises_is_reported_and_fit_waits_for_one_that_outlives_training(storage: str, capfd) -> None:
    def loop() -> float:
        _report(0, validation=True)
        _report(1, validation=True)
        return time.time()  # the validation of #2 is still running

    result = _fit(loop, storage, _fails_or_waits, delay_s=1.5)
    returned_at = result.return_value
    err = capfd.readouterr().err
    # The failure: its traceback on the console and in metrics.jsonl, training went on.
    assert "the validation of checkpoint_000001 failed" in err
    assert "ValueError: no layer named 'head' in this checkpoint" in err
    assert "it keeps the metrics it was reported with" in err
    failed, validated = _validation_lines(storage)
    assert failed["checkpoint"] == "checkpoint_000001" and failed["metrics"] == {}
    assert "Traceback" in failed["error"] and "_fails_or_waits" in failed["error"]
    run_json = json.loads(Path(storage, "run", "run.json").read_text())
    assert run_json["validation_errors"][0]["checkpoint"] == "checkpoint_000001"
    # Its score stays as reported (no "acc": it ranks as a checkpoint without one).
    ranked = {os.path.basename(c.path): m for c, m in result.best_checkpoints}
    assert ranked["checkpoint_000001"] == {"loss": 1.0, "step": 0}
    # fit() waited for the validation that outlived the training function, and said so.
    waited = r"waiting up to 600 s for the validation of checkpoint\(s\) (checkpoint_000001, )?checkpoint_000002 \("
    assert re.search(waited, err), err
    assert validated["checkpoint"] == "checkpoint_000002" and validated["error"] is None
    lines = [json.loads(line) for line in Path(storage, "run", "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["time"] > returned_at + 0.5
    assert ranked["checkpoint_000002"]["acc"] == 0.75


def _hangs(checkpoint: train.Checkpoint, pids: str) -> dict[str, Any]:
    child = subprocess.Popen(["sleep", "60"])  # what it starts is killed with it
    with open(pids, "a") as f:
        f.write(f"{os.getpid()} {child.pid}\n")
    try:
        time.sleep(60)
    finally:  # a stop is SIGTERM first: the function's cleanup runs
        Path(pids + ".cleaned").write_text("yes")
    return {"acc": 1.0}


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left to an init that does not reap does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_hanging_validation_is_killed_at_its_bounds(storage: str, tmp_path: Path, monkeypatch, capfd) -> None:
    monkeypatch.setenv("DDPTRAIN_VALIDATION_TIMEOUT_S", "1")
    monkeypatch.setenv("DDPTRAIN_VALIDATION_WAIT_S", "0.5")
    monkeypatch.setenv("DDPTRAIN_SHUTDOWN_GRACE_S", "0.5")
    pids = str(tmp_path / "pids")

    def loop() -> list[tuple[str, str, Any]]:
        _report(0, validation=True)
        time.sleep(2.5)  # its validation is killed after 1 s meanwhile
        listed = _listed(train.get_all_reported_checkpoints())
        _report(1, validation=True)  # still running when training ends: killed after the wait
        return listed

    start = time.monotonic()
    result = _fit(loop, storage, _hangs, workers=0, pids=pids)
    assert time.monotonic() - start < 15
    assert result.return_value == [("checkpoint_000001", "VALIDATED", None)]
    first, second = _validation_lines(storage)
    assert "killed after 1 s (DDPTRAIN_VALIDATION_TIMEOUT_S)" in first["error"]
    assert "not done 0.5 s after training ended (DDPTRAIN_VALIDATION_WAIT_S)" in second["error"]
    err = capfd.readouterr().err
    assert "waiting up to 0.5 s for the validation of checkpoint(s) checkpoint_000002" in err
    assert "the validation of checkpoint_000002 failed" in err and "it is not validated" in err
    statuses = {os.path.basename(c.path): m for c, m in result.best_checkpoints}
    assert set(statuses) == {"checkpoint_000001", "checkpoint_000002"}
    started = [int(pid) for line in Path(pids).read_text().splitlines() for pid in line.split()]
    assert len(started) in (2, 4) and not any(map(_alive, started))  # the second may be killed before it wrote


def test_bad_validation_input_says_what_to_do(storage: str) -> None:
    with pytest.raises(ConfigError, match="must be a function"):
        ValidationConfig(fn=3)
    with pytest.raises(ConfigError, match="must be a dict of keyword arguments"):
        ValidationTaskConfig(fn_kwargs=[1])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be a ddptrain.ValidationConfig"):
        train.DataParallelTrainer(lambda: None, validation_config=lambda c: {})

    def loop() -> None:
        checkpoint = _save(0)
        with pytest.raises(ValueError, match="pass `validate_fn` too"):
            train.report({}, checkpoint=checkpoint, validate_config={"a": 1})
        with pytest.raises(ValueError, match="not both"):
            train.report({}, checkpoint=checkpoint, validation=True, validate_fn=lambda c: {})
        with pytest.raises(TypeError, match="must be True, False or a ValidationTaskConfig"):
            train.report({}, checkpoint=checkpoint, validation="yes")
        with pytest.raises(ValueError, match="must be CheckpointConsistencyMode.COMMITTED or VALIDATED"):
            train.get_all_reported_checkpoints(consistency_mode="SOMETIMES")
        shutil.rmtree(checkpoint.path)

    _fit(loop, storage, _scored, workers=0)
    assert ReportedCheckpointStatus("PENDING_VALIDATION") is ReportedCheckpointStatus.PENDING_VALIDATION


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rays_async_validation_guide_runs_unmodified(storage: str) -> None:
    proc = ddptrain_run("async_validation_guide.py", storage)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checkpoint_000001 validated in" in proc.stderr and "checkpoint_000002 validated in" in proc.stderr
    assert "best checkpoints: [('checkpoint_000001', ['epoch', 'loss', 'score'])," in proc.stdout


_DRIVER = """
import sys, time
import ddptrain as train
from tests.test_validation import _hangs, _report

def loop():
    _report(0, validation=True)
    time.sleep(60)

train.DataParallelTrainer(
    loop,
    scaling_config=train.ScalingConfig(num_workers=0),
    validation_config=train.ValidationConfig(_hangs, task_config=train.ValidationTaskConfig({"pids": sys.argv[2]})),
    run_config=train.RunConfig(name="run", storage_path=sys.argv[1]),
).fit()
"""


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_validation_ends_with_its_driver(signal_name: str, storage: str, tmp_path: Path) -> None:
    """Ctrl-C (KeyboardInterrupt in fit()) and SIGTERM (a preemption notice) stop the
    validation; so does a SIGKILLed driver (the validation process watches it): SIGTERM first,
    so the function's ``finally`` blocks run, then SIGKILL; its folder is removed."""
    pids = tmp_path / "pids"
    root = Path(__file__).resolve().parent.parent
    driver = subprocess.Popen(
        [os.sys.executable, "-c", _DRIVER, storage, str(pids)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "DDPTRAIN_PREEMPTION_WINDOW_S": "0.5"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and pids.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.05)
        started = [int(pid) for pid in pids.read_text().split()]
        folder = Path(f"/proc/{started[0]}/cmdline").read_bytes().split(b"\0")[-3].decode()
        assert Path(folder, "task.pkl").exists()
        os.kill(driver.pid, getattr(__import__("signal"), signal_name))
        driver.wait(30)
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 8
    while (any(map(_alive, started)) or os.path.exists(folder)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, started))
    assert Path(str(pids) + ".cleaned").exists()  # its `finally` ran, the driver killed or not
    assert not os.path.exists(folder)  # nor is the pickled function left behind


def _quick(checkpoint: train.Checkpoint, pids: str) -> dict[str, Any]:
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(1.0)  # the test reads its folder from its command line meanwhile
    return {"acc": 1.0}


def test_a_result_its_killed_driver_never_read_is_removed(storage: str, tmp_path: Path) -> None:
    """The validation ended and wrote its result; the driver, stopped before it read it, is then
    SIGKILLed: its folder (with the pickled function) does not stay behind."""
    pids = tmp_path / "pids"
    root = Path(__file__).resolve().parent.parent
    driver = subprocess.Popen(
        [os.sys.executable, "-c", _DRIVER.replace("_hangs", "_quick"), storage, str(pids)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and pids.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.02)
        pid = int(pids.read_text())
        folder = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-3].decode()
        os.kill(driver.pid, signal.SIGSTOP)  # it cannot read the result now
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(pid) and Path(folder, "result.json").exists()
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(30)
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 3
    while os.path.exists(folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(folder)


def test_a_bad_validation_knob_fails_fit_at_once(storage: str, monkeypatch) -> None:
    monkeypatch.setenv("DDPTRAIN_VALIDATION_CPUS", "one")
    with pytest.raises(ConfigError, match="`DDPTRAIN_VALIDATION_CPUS` must be a CPU list such as '3'"):
        _fit(lambda: None, storage, _scored, workers=0)


def test_a_failed_training_kills_its_validation(storage: str, tmp_path: Path) -> None:
    pids = str(tmp_path / "pids")

    def loop() -> None:
        _report(0, validation=True)
        while not (os.path.exists(pids) and Path(pids).read_text().endswith("\n")):
            time.sleep(0.05)
        raise RuntimeError("diverged")

    start = time.monotonic()
    with pytest.raises(train.WorkerGroupError, match="diverged"):
        _fit(loop, storage, _hangs, workers=0, pids=pids)
    assert time.monotonic() - start < 20
    started = [int(pid) for pid in Path(pids).read_text().split()]
    assert not any(map(_alive, started))
    [line] = _validation_lines(storage)
    assert line["error"] == "Validation killed: the run stopped before it ended."


def _parent(checkpoint: train.Checkpoint) -> dict[str, Any]:
    return {"acc": 1.0, "parent": os.getppid()}


def test_a_validation_host_must_be_one_of_the_runs_hosts(storage: str) -> None:
    def fit(host: str, hosts: list[str] | None) -> train.Result:
        return train.DataParallelTrainer(
            lambda: _report(0, validation=True),
            scaling_config=train.ScalingConfig(num_workers=0, hosts=hosts),
            validation_config=ValidationConfig(_parent, host=host),
            run_config=train.RunConfig(name="run", storage_path=storage),
        ).fit()

    with pytest.raises(ConfigError, match=r"host='h9'\)` is not one of the run's hosts \(localhost, h0\)"):
        fit("h9", ["localhost", "h0"])
    with pytest.raises(ConfigError, match="names a host, but the run has no host list"):
        fit("h0", None)
    with pytest.raises(ConfigError, match="must be the name of one of the run's hosts"):
        ValidationConfig(_parent, host="")
    assert not Path(storage, "run").exists()  # failed at once
    # This machine's name in the host list: validated here, without SSH (the driver started it).
    result = fit("localhost", ["localhost", "h0"])
    assert result.metrics["parent"] == os.getpid()


_WAITING_DRIVER = """
import os, subprocess, sys, tempfile, time
import ddptrain as train

def loop():
    for step in range(2):
        folder = tempfile.mkdtemp()
        open(os.path.join(folder, "step"), "w").write(str(step))
        train.report({"step": step}, checkpoint=train.Checkpoint(folder), validation=True)

def hangs(checkpoint, pids):
    child = subprocess.Popen(["sleep", "60"])
    with open(pids, "a") as f:
        f.write(f"{os.getpid()} {child.pid}\\n")
    time.sleep(60)
    return {"acc": 1.0}

if __name__ == "__main__":
    result = train.DataParallelTrainer(
        loop,
        scaling_config=train.ScalingConfig(num_workers=1),
        validation_config=train.ValidationConfig(hangs, task_config=train.ValidationTaskConfig({"pids": sys.argv[2]})),
        run_config=train.RunConfig(name="run", storage_path=sys.argv[1]),
    ).fit()
    print("returned", result.checkpoint.path, flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("notices", [1, 2])
def test_a_preemption_notice_ends_the_wait_for_validations_after_training(
    notices: int, storage: str, tmp_path: Path, monkeypatch
) -> None:
    # Training is over and fit() waits for the validations left (DDPTRAIN_VALIDATION_WAIT_S,
    # 600 s): a SIGTERM was ignored there (even a second one, "stop now"), so fit() went on
    # waiting for them whatever the notice's deadline.
    import signal

    from forked_driver import ForkedDriver

    monkeypatch.setenv("DDPTRAIN_PREEMPTION_WINDOW_S", "2" if notices == 1 else "60")
    script, pids = tmp_path / "waiting.py", tmp_path / "pids"
    script.write_text(_WAITING_DRIVER)
    driver = ForkedDriver(script, [storage, str(pids)], stderr="stdout")
    try:
        seen = ""
        for line in driver.stdout:
            seen += line
            if "waiting up to 600 s for the validation of checkpoint(s)" in line:
                break
        deadline = time.monotonic() + 30
        while not (pids.exists() and pids.read_text().endswith("\n")):  # the first validation runs
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        for _ in range(notices):
            driver.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        started = time.monotonic()
        out, _ = driver.communicate(timeout=20)
    finally:
        driver.kill()
    assert driver.returncode == 0, seen + out
    assert time.monotonic() - started < 15  # the notice's deadline (2 s) or at once, then the teardown
    pid = driver.pid
    assert f"preemption notice (SIGTERM to the driver (pid {pid})): validations not done in" in out
    assert "returned" in out  # training finished: fit() returns its result
    why = f"the run was preempted (SIGTERM to the driver (pid {pid})) before it ended."
    assert [line["error"] for line in _validation_lines(storage)] == [
        f"Validation killed: {why}",
        f"Validation not run: {why}",
    ]
    started_pids = [int(p) for p in pids.read_text().split()]
    assert not any(map(_alive, started_pids))


_DIES_AT_ONCE = """
import os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from ddptrain.driver.validation import _CHILD
subprocess.Popen([sys.executable, "-c", _CHILD, sys.argv[1], sys.argv[2], str(os.getpid())], start_new_session=True,
                 stdout=open(sys.argv[3], "w"), stderr=subprocess.STDOUT)
os._exit(0)  # before the validation process has even started
"""


def slow_validation(checkpoint: object) -> dict:
    time.sleep(2)
    return {"acc": 1.0}


def test_a_validation_whose_driver_died_before_it_started_ends_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    """A driver SIGKILLed right after it started a validation: the validation took its parent
    (by then init) for the driver, so it ran to the end and left a shell waiting forever, and
    its folder with the pickled function (seen in a CI run of the driver-kill test). It now
    knows the driver's pid: it stops at once, and its folder goes."""
    import cloudpickle
    from conftest import tagged_processes

    monkeypatch.setenv("DDPTRAIN_SHUTDOWN_GRACE_S", "0.5")
    folder = tmp_path / "ddptrain-validation-test"
    folder.mkdir()
    request = {"sys_path": list(sys.path), "ray_compat": False, "default": None, "checkpoint": None}
    request["spec"] = cloudpickle.dumps((slow_validation, (), None))
    (folder / "task.pkl").write_bytes(cloudpickle.dumps(request))
    root = str(Path(__file__).resolve().parent.parent)
    subprocess.run([sys.executable, "-c", _DIES_AT_ONCE, root, str(folder), str(tmp_path / "log")], check=True)
    deadline = time.monotonic() + 8
    while (folder.exists() or tagged_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not folder.exists(), (tmp_path / "log").read_text()
    assert tagged_processes() == []
    assert "the validation was stopped (SIGTERM)" in (tmp_path / "log").read_text()
