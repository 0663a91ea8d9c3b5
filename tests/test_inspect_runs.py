"""Inspecting runs from the shell: `ddptrain runs`, `show`, `logs`, `export`, `plot`, on real
runs (finished, failed, live and then killed)."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain.cli import main
from ddptrain.torch import TorchTrainer

ROOT = str(Path(__file__).resolve().parent.parent)


def three_reports() -> None:
    rank = train.get_context().get_world_rank()
    for step in range(3):
        print(f"rank {rank} at step {step}")
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "w").write_text(str(step))
            checkpoint = train.Checkpoint.from_directory(folder)
            train.report({"loss": [0.5, 0.2, 0.3][step], "step": step}, checkpoint=checkpoint)


def fails() -> None:
    raise ValueError("bad data in shard 3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> str:
    storage = str(tmp_path_factory.mktemp("inspect") / "runs")
    TorchTrainer(
        three_reports,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(
            storage_path=storage,
            name="good",
            checkpoint_config=train.CheckpointConfig(checkpoint_score_attribute="loss", checkpoint_score_order="min"),
        ),
    ).fit()
    with pytest.raises(train.TrainingFailedError):
        TorchTrainer(
            fails,
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(storage_path=storage, name="bad"),
        ).fit()
    return storage


def cli(capfd, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capfd.readouterr()
    return code, out, err


def test_runs_lists_every_run_with_its_status(runs: str, capfd) -> None:
    code, out, _ = cli(capfd, "runs", runs)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["NAME", "STATUS", "ATTEMPTS", "STARTED", "DURATION"]
    good = next(line for line in lines if line.startswith("good "))
    assert "FINISHED" in good and "loss=0.3 step=2" in good and "checkpoint_000002" in good
    assert next(line for line in lines if line.startswith("bad ")).split()[1] == "ERRORED"
    code, out, _ = cli(capfd, "runs", runs, "--json")
    data = {r["name"]: r for r in json.loads(out)}
    assert data["good"]["reports"] == 3 and data["good"]["best_checkpoint"].endswith("checkpoint_000002")
    assert "bad data in shard 3" in data["bad"]["error"]


def test_show_names_the_root_cause_metrics_and_checkpoints(runs: str, capfd) -> None:
    code, out, _ = cli(capfd, "show", os.path.join(runs, "good"))
    assert code == 0
    assert "run 'good': FINISHED" in out and "workers: 2 on" in out
    assert "loss: last 0.3, min 0.2, max 0.5" in out
    assert "checkpoint_000002  loss=0.2 step=1  [best]" in out
    assert "checkpoint_000003  loss=0.3 step=2  [latest]" in out
    code, out, _ = cli(capfd, "show", os.path.join(runs, "bad"))
    assert "run 'bad': ERRORED" in out
    assert "attempt 0 failed: rank 0" in out and "ValueError: bad data in shard 3" in out and "rank_0.log" in out


def test_logs_and_export(runs: str, capfd, tmp_path: Path) -> None:
    code, out, _ = cli(capfd, "logs", os.path.join(runs, "good"), "--rank", "1")
    assert code == 0 and out.splitlines() == [f"rank 1 at step {s}" for s in range(3)]
    code, _, err = cli(capfd, "logs", os.path.join(runs, "good"), "--attempt", "4")
    assert code == 1 and "attempts: [0]" in err
    code, out, _ = cli(capfd, "export", os.path.join(runs, "good"))
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [(r["report"], r["attempt"], r["loss"], r["step"]) for r in rows] == [
        ("1", "0", "0.5", "0"),
        ("2", "0", "0.2", "1"),
        ("3", "0", "0.3", "2"),
    ]
    target = tmp_path / "good.json"
    code, _, _ = cli(capfd, "export", os.path.join(runs, "good"), "--format", "json", "-o", str(target))
    assert [row["loss"] for row in json.loads(target.read_text())] == [0.5, 0.2, 0.3]
    code, _, err = cli(capfd, "show", "no-such-run")
    assert code == 2 and "no run 'no-such-run'" in err


def test_plot_draws_one_panel_per_metric_for_several_runs(runs: str, capfd, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for suffix, magic in ((".png", b"\x89PNG"), (".svg", b"<?xml")):
        target = tmp_path / f"plot{suffix}"
        code, _, err = cli(capfd, "plot", os.path.join(runs, "good"), os.path.join(runs, "bad"), "-o", str(target))
        assert code == 0, err
        assert target.read_bytes().startswith(magic) and "(loss, step)" in err


LIVE = textwrap.dedent(
    """
    import time
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    def slow():
        train.report({"step": 0})
        time.sleep(120)

    TorchTrainer(slow, scaling_config=train.ScalingConfig(num_workers=1),
                 run_config=train.RunConfig(storage_path=STORAGE, name="live")).fit()
    """
)


@pytest.mark.timeout(120)
def test_a_live_run_is_running_and_a_killed_one_aborted(tmp_path: Path, capfd) -> None:
    storage = tmp_path / "runs"
    script = tmp_path / "live.py"
    script.write_text(LIVE.replace("STORAGE", repr(str(storage))))
    env = {**os.environ, "PYTHONPATH": ROOT, "DDPTRAIN_SHUTDOWN_GRACE_S": "1"}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            time.sleep(0.5)
            code, out, _ = cli(capfd, "runs", str(storage), "--json")
            found = json.loads(out)
            if found and found[0]["reports"] == 1:
                status = found[0]["status"]
                break
        assert status == "RUNNING"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started
        proc.wait()
    code, out, _ = cli(capfd, "runs", str(storage), "--json")
    assert json.loads(out)[0]["status"] == "ABORTED"
