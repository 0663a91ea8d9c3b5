"""The console view of a run: a start line, progress per report, restarts, an end summary;
in place on a terminal without garbling worker output; silent when turned off."""

from __future__ import annotations

import logging
import os
import pty
import re
import select
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from forked_driver import ForkedDriver

import ddptrain as train
from ddptrain.driver.progress import format_metrics
from ddptrain.progress import set_progress
from ddptrain.torch import TorchTrainer

ROOT = str(Path(__file__).resolve().parent.parent)


def three_reports() -> None:
    for step in range(3):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "w").write_text(str(step))
            train.report({"loss": 1.0 / (step + 1), "step": step}, checkpoint=train.Checkpoint.from_directory(folder))


def fit(storage: str, fn=three_reports, **run_kwargs) -> train.Result:
    return TorchTrainer(
        fn,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage, name="shown", **run_kwargs),
    ).fit()


def test_lines_mode_says_where_the_run_is_and_how_it_ended(storage: str, capfd, monkeypatch) -> None:
    monkeypatch.setenv("DDPTRAIN_PROGRESS", "lines")
    monkeypatch.setenv("DDPTRAIN_PROGRESS_INTERVAL_S", "0")
    result = fit(
        storage,
        checkpoint_config=train.CheckpointConfig(checkpoint_score_attribute="loss", checkpoint_score_order="min"),
    )
    err = capfd.readouterr().err
    run_dir = os.path.abspath(result.path)
    assert f"ddptrain: run 'shown' started (attempt 0, 2 workers); results in {run_dir}" in err
    assert "[shown] attempt 0 | 3 reports | loss=0.3333 step=2 | checkpoint_000003 |" in err
    best = os.path.join(run_dir, "checkpoint_000003")
    assert re.search(rf"run 'shown' finished in 0:00:\d\d \(3 reports, attempt 0\); best checkpoint {best} ", err)
    assert err.rstrip().endswith(f"everything is in {run_dir}")


def reports_on_rank_0_only() -> None:
    for step in range(4):
        if train.get_context().get_world_rank() == 0:  # Ray's usual pattern
            train.report({"step": step})


def test_the_summary_counts_reports_made_on_rank_0_only(storage: str, capfd, monkeypatch, caplog) -> None:
    # It said "0 reports" while Result.metrics_history had every one of them, and warned once
    # per report() call that rank 1 never made it.
    monkeypatch.setenv("DDPTRAIN_PROGRESS", "lines")
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        result = fit(storage, reports_on_rank_0_only)
    unmade = [r.getMessage() for r in caplog.records if "never by rank(s)" in r.getMessage()]
    assert len(unmade) == 1 and "report() calls #1-#4 were made by rank(s) [0] but never by rank(s) [1]" in unmade[0]
    assert [m["step"] for m in result.metrics_history] == [0, 1, 2, 3]
    err = capfd.readouterr().err
    assert re.search(r"run 'shown' finished in 0:00:\d\d \(4 reports, attempt 0\)", err), err
    assert "[shown] attempt 0 | 4 reports | step=3 |" in err, err


def test_restarts_and_failures_are_announced(storage: str, capfd, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DDPTRAIN_PROGRESS", "lines")
    marker = tmp_path / "crashed"

    def crash_once() -> None:
        if not marker.exists():
            marker.touch()
            raise ValueError("first attempt fails")
        raise KeyError("second attempt fails too")

    with pytest.raises(train.TrainingFailedError):
        fit(storage, crash_once, failure_config=train.FailureConfig(max_failures=1))
    err = capfd.readouterr().err
    assert "ddptrain: attempt 0 failed (rank " in err
    assert "attempt 1 starts from scratch (failure 1 of 1 allowed)" in err
    assert "ValueError: first attempt fails" in err
    assert re.search(r"run 'shown' failed after 0:00:\d\d \(0 reports, attempt 1\): rank \d .*KeyError", err)


CRASHES_ONCE = textwrap.dedent(
    """
    import os
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    def crash_once():
        if train.get_context().get_world_rank() == 0 and not os.path.exists(MARKER):
            open(MARKER, "w").close()
            raise ValueError("first attempt fails")

    if __name__ == "__main__":
        TorchTrainer(crash_once, scaling_config=train.ScalingConfig(num_workers=2),
                     run_config=train.RunConfig(storage_path=STORAGE, name="again",
                                                failure_config=train.FailureConfig(max_failures=-1))).fit()
    """
)


def test_a_restart_is_one_line_on_a_console_without_logging_set_up(tmp_path: Path) -> None:
    """A script that sets up no logging got each restart twice: the progress line and the
    controller's warning (printed by Python's last-resort handler)."""
    script = tmp_path / "again.py"
    script.write_text(
        CRASHES_ONCE.replace("MARKER", repr(str(tmp_path / "crashed"))).replace("STORAGE", repr(str(tmp_path / "r")))
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "DDPTRAIN_PROGRESS": "lines"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    restarts = [line for line in proc.stderr.splitlines() if "attempt 0 failed (" in line]
    assert len(restarts) == 1, proc.stderr
    assert "attempt 1 starts from scratch (failure 1 of unlimited allowed)" in restarts[0]


def test_off_mode_prints_nothing_of_ddptrains_own(storage: str, capfd) -> None:
    set_progress("off")
    try:
        fit(storage)
    finally:
        set_progress(None)
    assert "ddptrain: run" not in capfd.readouterr().err


def test_a_bad_mode_is_refused_before_anything_starts(storage: str, monkeypatch) -> None:
    monkeypatch.setenv("DDPTRAIN_PROGRESS", "loud")
    with pytest.raises(train.ConfigError, match="`DDPTRAIN_PROGRESS` must be one of"):
        fit(storage)
    with pytest.raises(train.ConfigError):
        set_progress("loud")


def test_metrics_are_shortened() -> None:
    metrics = {"loss": 0.123456789, "name": "x" * 40, "nested": {"a": 1}, "step": 7, "lr": 1e-4, "extra": 1}
    assert format_metrics(metrics) == f"loss=0.1235 name={'x' * 21}... step=7 lr=0.0001 ..."


SCRIPT = textwrap.dedent(
    """
    import time
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    def loop():
        for step in range(6):
            print(f"hello from rank {train.get_context().get_world_rank()} step {step}", flush=True)
            train.report({"step": step})
            time.sleep(0.3)

    if __name__ == "__main__":
        TorchTrainer(loop, scaling_config=train.ScalingConfig(num_workers=2),
                     run_config=train.RunConfig(storage_path=STORAGE, name="live")).fit()
    """
)


@pytest.mark.timeout(120)
def test_on_a_terminal_the_status_line_is_redrawn_and_worker_lines_stay_whole(tmp_path: Path) -> None:
    script = tmp_path / "live.py"
    script.write_text(SCRIPT.replace("STORAGE", repr(str(tmp_path / "runs"))))
    parent, child = pty.openpty()
    env = {**os.environ, "PYTHONPATH": ROOT, "TERM": "xterm", "COLUMNS": "200"}
    env.pop("DDPTRAIN_PROGRESS", None)
    proc = ForkedDriver(script, [], env=env, terminal=child)  # a driver process of its own, forked
    os.close(child)
    out = b""
    while True:
        ready, _, _ = select.select([parent], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(parent, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(parent)
    text = out.decode(errors="replace").replace("\r\n", "\n")
    assert proc.returncode == 0, text
    assert "\r\x1b[2K[live] attempt 0 | " in text  # the status line, drawn in place
    for rank in (0, 1):
        for step in range(6):
            line = f"[rank{rank}] hello from rank {rank} step {step}\n"
            # Each worker line is whole: at most the status line's clear code in front of it.
            assert re.search(r"(^|\n|\x1b\[2K)" + re.escape(line), text), (line, text)
    assert "run 'live' finished in" in text
