"""Inspecting runs from the shell: `ddptrain runs`, `show`, `logs`, `export`, `plot`, on real
runs (finished, failed, live and then killed)."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from run_folders import write_run

import ddptrain as train
from ddptrain.cli.main import main
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


def test_a_storage_path_given_for_a_run_or_missing_says_what_to_type(runs: str, capfd, tmp_path: Path) -> None:
    code, _, err = cli(capfd, "show", runs)  # the folder that holds the runs, not a run
    assert code == 2
    assert f"no run {runs!r}: {runs} is not a ddptrain run directory (no run.json)" in err  # one path, not twice
    assert f"is a storage path that holds runs: list them with `ddptrain runs {runs}`" in err
    missing = str(tmp_path / "typo")
    code, out, err = cli(capfd, "runs", missing)
    assert code == 1 and f"ddptrain runs: {missing}: no such folder" in err and not out
    assert cli(capfd, "runs", missing, "--json")[:2] == (0, "[]\n")  # no runs yet, for scripts that poll
    Path(missing).write_text("")
    code, _, err = cli(capfd, "runs", missing)
    assert code == 1 and f"ddptrain runs: {missing}: not a folder" in err
    one = os.path.join(runs, "bad")  # a run's own folder
    code, out, err = cli(capfd, "runs", one)
    assert code == 1 and f"{one} is a run, not a folder of runs: see it with `ddptrain show {one}`" in err, err


def reports_time_and_report(config: dict) -> None:
    for step in range(2):
        train.report({"time": 10.0 + step, "report": f"epoch {step}", "attempt": "mine", "loss": 1.0 - step / 2})


def test_metrics_named_like_the_export_columns_lose_nothing(capfd, tmp_path: Path) -> None:
    """A metric ``time`` (or ``report``, ``attempt``) replaced ddptrain's column in export, plot
    and the dashboard: the report numbers and times were gone, and ``--x time`` plotted the
    metric. Now both are there, the metric as ``metrics/time``."""
    storage = str(tmp_path / "runs")
    TorchTrainer(
        reports_time_and_report,
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(storage_path=storage, name="timed"),
    ).fit()
    run = os.path.join(storage, "timed")
    code, out, _ = cli(capfd, "export", run)
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and [(r["report"], r["attempt"]) for r in rows] == [("1", "0"), ("2", "0")]
    assert float(rows[0]["time"]) > 1e9  # ddptrain's time stamp, not the metric
    assert [(r["metrics/time"], r["metrics/report"], r["metrics/attempt"]) for r in rows] == [
        ("10.0", "epoch 0", "mine"),
        ("11.0", "epoch 1", "mine"),
    ]
    pytest.importorskip("matplotlib")
    code, _, err = cli(capfd, "plot", run, "metrics/time", "--x", "time", "-o", str(tmp_path / "p.png"))
    assert code == 0, err


def test_plot_draws_one_panel_per_metric_for_several_runs(runs: str, capfd, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for suffix, magic in ((".png", b"\x89PNG"), (".svg", b"<?xml")):
        target = tmp_path / f"plot{suffix}"
        code, _, err = cli(capfd, "plot", os.path.join(runs, "good"), os.path.join(runs, "bad"), "-o", str(target))
        assert code == 0, err
        assert target.read_bytes().startswith(magic) and "(loss, step)" in err


def test_plot_takes_metrics_as_positionals_beside_dash_m(runs: str, capfd, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = str(tmp_path / "plot.png")
    good, bad = os.path.join(runs, "good"), os.path.join(runs, "bad")
    code, _, err = cli(capfd, "plot", good, bad, "loss", "-o", target)
    assert code == 0, err
    assert f"wrote {target} (loss)" in err
    code, _, err = cli(capfd, "plot", good, "step", "-m", "loss", "-o", target)
    assert code == 0 and f"wrote {target} (step, loss)" in err, err
    code, _, err = cli(capfd, "plot", good, "accuracy", "-o", target)
    assert code == 2
    assert "no run 'accuracy'" in err and "nor is 'accuracy' a metric of the runs given (they have: loss, step)" in err


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


def ddptrain(*args: str) -> subprocess.CompletedProcess[str]:
    """The command in its own process, bounded: a read that waits on a FIFO fails the test."""
    return subprocess.run(
        [sys.executable, "-m", "ddptrain", *args],
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_runs_shows_unreadable_runs_as_such_beside_the_others(tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    write_run(storage / "good", metrics=[{"loss": 0.5}, {"loss": 0.25}])
    write_run(storage / "diverged", metrics=[{"loss": 0.5}, {"loss": math.nan}])
    bad = {
        "not-json": (b'{"status": ', "run.json is not JSON"),
        "not-utf8": (b'{"status": "\xff"}', "run.json is not JSON"),
        "a-list": ([1, 2], "run.json holds a JSON list, not an object"),
        "wrong-types": ({"status": "DONE", "started": "x", "attempt": -1}, "`status` is 'DONE', `started` is 'x'"),
        "foreign-lines": (None, "metrics.jsonl: 1 line(s) are not reports"),
    }
    for name, (run_json, _) in bad.items():
        write_run(storage / name, run_json, metrics=['{"metrics": 5}'] if name == "foreign-lines" else None)
    done = ddptrain("runs", str(storage))
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[1:] if line and not line.startswith(" ")}
    assert "FINISHED" in rows["good"] and "loss=0.25" in rows["good"]
    assert "FINISHED" in rows["diverged"] and "loss=nan" in rows["diverged"]
    for name, (_, problem) in bad.items():
        assert rows[name].split()[1] == "UNREADABLE", name
        assert next(line for line in done.stdout.splitlines() if line.startswith(f"  {name}: ")).count(problem), name
    runs = {r["name"]: r for r in json.loads(ddptrain("runs", str(storage), "--json").stdout)}
    assert runs["good"]["problem"] is None and runs["good"]["reports"] == 2
    assert all(problem in runs[name]["problem"] for name, (_, problem) in bad.items())
    shown = ddptrain("show", str(storage / "wrong-types"))
    assert (
        shown.returncode == 0
        and "run 'wrong-types': UNREADABLE" in shown.stdout
        and "`attempt` is '-1'" in shown.stdout
    )


def test_fifos_in_a_run_folder_are_refused_not_waited_on(tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    for name in ("metrics.jsonl", "checkpoints.json", "logs/attempt_0/rank_0.log"):
        folder = storage / name.split("/")[-1].replace(".", "-")
        write_run(folder, metrics=[{"loss": 1.0}] if name != "metrics.jsonl" else None)
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(folder / name)
    listed = ddptrain("runs", str(storage), "--json")
    assert listed.returncode == 0, listed.stderr
    problems = {r["name"]: r["problem"] for r in json.loads(listed.stdout)}
    assert "metrics.jsonl is a FIFO, not a regular file" in problems["metrics-jsonl"]
    assert "checkpoints.json is a FIFO, not a regular file" in problems["checkpoints-json"]
    assert problems["rank_0-log"] is None  # `runs` reads no log
    shown = ddptrain("show", str(storage / "metrics-jsonl"))
    assert shown.returncode == 0 and "UNREADABLE" in shown.stdout and "is a FIFO" in shown.stdout
    exported = ddptrain("export", str(storage / "metrics-jsonl"))
    assert exported.returncode == 2 and "metrics.jsonl is a FIFO, not a regular file" in exported.stderr
    logs = ddptrain("logs", str(storage / "rank_0-log"))
    assert logs.returncode == 2 and "rank_0.log is a FIFO, not a regular file" in logs.stderr


def test_links_out_of_a_run_folder_are_never_followed(tmp_path: Path) -> None:
    """A run folder someone else wrote, whose files link to files of the reader's own."""
    mine = tmp_path / "mine"
    (mine / "attempt_0").mkdir(parents=True)
    (mine / "secret.jsonl").write_text(json.dumps({"time": 1, "attempt": 0, "metrics": {"SECRET": 1}}) + "\n")
    (mine / "attempt_0" / "rank_0.log").write_text("SECRET log line\n")
    storage = tmp_path / "runs"
    write_run(storage / "linked-files")
    (storage / "linked-files" / "metrics.jsonl").symlink_to(mine / "secret.jsonl")
    (storage / "linked-files" / "logs" / "attempt_0").mkdir(parents=True)
    (storage / "linked-files" / "logs" / "attempt_0" / "rank_0.log").symlink_to(mine / "attempt_0" / "rank_0.log")
    write_run(storage / "linked-folder", metrics=[{"loss": 1.0}])
    (storage / "linked-folder" / "logs").symlink_to(mine)
    done: dict[tuple[str, str], subprocess.CompletedProcess[str]] = {}
    for run in ("linked-files", "linked-folder"):
        for command in ("runs", "show", "export", "logs"):
            if (command, "") in done:
                continue  # `runs` lists the storage folder: once is enough
            key = (command, run if command != "runs" else "")
            done[key] = ddptrain(command, str(storage / run) if command != "runs" else str(storage))
            assert "SECRET" not in done[key].stdout + done[key].stderr, key
    assert "metrics.jsonl is a symbolic link, not a regular file" in done["show", "linked-files"].stdout
    exported = done["export", "linked-files"]
    assert exported.returncode == 2 and "never follows a link" in exported.stderr
    logs = done["logs", "linked-files"]
    assert logs.returncode == 2 and "rank_0.log is a symbolic link" in logs.stderr
    logs = done["logs", "linked-folder"]
    assert logs.returncode == 2 and "logs is a symbolic link, not a folder" in logs.stderr


def test_runs_and_show_read_the_summary_and_the_lines_after_it(runs: str, tmp_path: Path, capfd) -> None:
    """The driver keeps a summary of metrics.jsonl; readers read only what was written after it."""
    run = Path(shutil.copytree(Path(runs) / "good", tmp_path / "good"))
    metrics = run / "metrics.jsonl"
    with open(metrics, "a") as f:  # two reports after the driver last wrote its summary
        for step in (3, 4):
            f.write(json.dumps({"time": time.time(), "attempt": 0, "metrics": {"loss": 0.1, "step": step}}) + "\n")
    first = metrics.read_bytes().split(b"\n")[0]
    with open(metrics, "r+b") as f:  # what the summary covers is never read again
        f.write(b" " * len(first))
    code, out, _ = cli(capfd, "runs", str(tmp_path), "--json")
    [summary] = json.loads(out)
    assert (summary["reports"], summary["last_metrics"]) == (5, {"loss": 0.1, "step": 4})
    assert summary["problem"] is None
    code, out, _ = cli(capfd, "show", str(run))
    assert "reports: 5" in out and "loss: last 0.1, min 0.1, max 0.5" in out and "step: last 4, min 0, max 4" in out


def test_a_long_run_of_an_older_ddptrain_is_read_from_its_tail(tmp_path: Path, capfd, monkeypatch) -> None:
    """No summary (written before there was one): `runs` and `show` count the lines and read
    the last one (the min and max are not known without reading it all)."""
    from ddptrain.storage import metrics as run_metrics

    monkeypatch.setattr(run_metrics, "_DELTA_MAX_BYTES", 1000)  # "long": over 1000 bytes
    write_run(tmp_path / "old", metrics=[{"loss": 1.0 / (i + 1), "step": i} for i in range(100)])
    code, out, _ = cli(capfd, "runs", str(tmp_path), "--json")
    [summary] = json.loads(out)
    assert (summary["reports"], summary["last_metrics"]) == (100, {"loss": 0.01, "step": 99})
    assert summary["metric_stats"] is None  # not known without reading it all
    code, out, _ = cli(capfd, "show", str(tmp_path / "old"))
    assert "reports: 100" in out and "last: loss=0.01 step=99 (min and max: not recorded" in out
    assert "`ddptrain export " + str(tmp_path / "old") in out
