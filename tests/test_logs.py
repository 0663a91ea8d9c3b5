"""Worker output: live on the driver's console with a rank prefix, and one file per rank."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ddptrain as train


def chatty() -> None:
    rank = train.get_context().get_world_rank()
    print(f"out line from {rank}")
    print(f"err line from {rank}", file=sys.stderr)
    print("no newline at the end", end="")


def test_output_is_prefixed_and_written_per_rank(storage: str, capfd) -> None:
    train.DataParallelTrainer(
        chatty,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="logs", storage_path=storage),
    ).fit()
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"[rank{rank}] out line from {rank}\n" in out
        assert f"[rank{rank}] err line from {rank}\n" in err
        assert f"[rank{rank}] no newline at the end\n" in out
        log = Path(storage, "logs", "logs", "attempt_0", f"rank_{rank}.log").read_text()
        assert f"out line from {rank}\n" in log and f"err line from {rank}\n" in log
        assert f"from {1 - rank}" not in log


def test_console_ranks_filter(storage: str, capfd, monkeypatch) -> None:
    monkeypatch.setenv("DDPTRAIN_CONSOLE_RANKS", "1")
    train.DataParallelTrainer(
        chatty,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="quiet", storage_path=storage),
    ).fit()
    out, _ = capfd.readouterr()
    assert "[rank1] out line from 1" in out
    assert "[rank0]" not in out
    assert "out line from 0" in Path(storage, "quiet", "logs", "attempt_0", "rank_0.log").read_text()


def say_run(config: dict) -> None:
    print(f"this is run {config['run']}")
    train.report({"run": config["run"]})


def test_rerunning_a_named_run_continues_attempt_numbers(storage: str) -> None:
    started = time.time()
    for run in (1, 2):
        train.DataParallelTrainer(
            say_run,
            train_loop_config={"run": run},
            run_config=train.RunConfig(name="again", storage_path=storage),
        ).fit()
    logs = Path(storage, "again", "logs")
    assert sorted(p.name for p in logs.iterdir()) == ["attempt_0", "attempt_1"]
    assert (logs / "attempt_0" / "rank_0.log").read_text() == "this is run 1\n"
    assert (logs / "attempt_1" / "rank_0.log").read_text() == "this is run 2\n"
    lines = [json.loads(line) for line in Path(storage, "again", "metrics.jsonl").read_text().splitlines()]
    assert [(line["attempt"], line["metrics"]) for line in lines] == [(0, {"run": 1}), (1, {"run": 2})]
    assert all(started <= line["time"] <= time.time() for line in lines)
