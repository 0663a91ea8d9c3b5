"""RunLayout: the names of a run directory's own files, where they have logic to get wrong."""

from __future__ import annotations

from pathlib import Path

from ddptrain.storage.layout import RunLayout


def test_attempts_are_numbered_from_the_log_folders_in_numeric_order(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    assert layout.attempts() == []  # no logs folder yet
    for name in ("attempt_10", "attempt_2", "attempt_x", "attempt_", "other"):
        (layout.logs / name).mkdir(parents=True)
    assert layout.attempts() == [2, 10]
    assert RunLayout.attempt_number("attempt_7") == 7 and RunLayout.attempt_number("rank_7") is None


def test_rank_logs_of_an_attempt_by_rank(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    for rank in (10, 2, 0):
        layout.rank_log(3, rank).parent.mkdir(parents=True, exist_ok=True)
        layout.rank_log(3, rank).write_text(str(rank))
    (layout.attempt_logs(3) / "rank_.log").write_text("not a rank's")
    assert {rank: path.read_text() for rank, path in layout.rank_logs(3).items()} == {0: "0", 2: "2", 10: "10"}
    assert list(layout.rank_logs(3)) == [0, 2, 10]
    assert layout.rank_logs(4) == {}


def test_the_names_on_disk_stay_those_earlier_runs_have(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    assert layout.rank_log(1, 3) == tmp_path / "logs" / "attempt_1" / "rank_3.log"
    assert layout.staged(1, 4, 2) == tmp_path / ".staging" / "a1_r4" / "rank_2"
    assert RunLayout.staged_name(1, 4, 2) == ".staging/a1_r4/rank_2"  # a key below a run on remote storage
    assert [p.name for p in (layout.run_json, layout.metrics, layout.index, layout.trainer)] == [
        "run.json",
        "metrics.jsonl",
        "checkpoints.json",
        "trainer.pkl",
    ]
