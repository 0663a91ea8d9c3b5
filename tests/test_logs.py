"""Worker output: live on the driver's console with a rank prefix, and one file per rank."""

from __future__ import annotations

import sys
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
