"""The one reader of a run (``ddptrain.storage.read``), on run folders written by hand: no
process, no driver. What a reader must survive: a line cut short by a crash, a run still
being written, missing files, files that are not what ddptrain writes, and run folders of
older ddptrain versions (``tests/data/run_3821c3e``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from run_folders import write_run

from ddptrain.result import Result, read_metrics
from ddptrain.storage import read
from ddptrain.storage.metrics import MetricsSummary
from ddptrain.storage.read import RunView, open_result_run, read_run

SAVED_RUN = Path(__file__).parent / "data" / "run_3821c3e"


def _view(folder: Path) -> RunView:
    return RunView(folder, str(folder))


def _line(metrics: dict[str, object], time: float = 1e9) -> str:
    return json.dumps({"time": time, "attempt": 0, "metrics": metrics})


def test_a_line_cut_short_by_a_crash_is_skipped(tmp_path: Path) -> None:
    run = tmp_path / "cut"
    write_run(run, metrics=[{"loss": 3.0}, {"loss": 1.0}])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"time": 1000000000.0, "attempt": 0, "metr')  # the crash came here
    record = read_run(_view(run))
    assert (record.status, record.problems) == ("FINISHED", [])
    assert record.metrics.reports == 2
    assert record.metrics.last is not None and record.metrics.last["metrics"] == {"loss": 1.0}
    assert record.metrics.stats == {"loss": [1.0, 1.0, 3.0]}
    assert read_metrics(run) == [{"loss": 3.0}, {"loss": 1.0}]
    result = Result.from_path(run)
    assert result.metrics == {"loss": 1.0} and result.metrics_history == [{"loss": 3.0}, {"loss": 1.0}]
    assert result.checkpoint is None and result.path == str(run)


def test_a_run_still_being_written(tmp_path: Path) -> None:
    """The summary reads complete lines only (the driver may be writing the last one); a full
    read takes a last line without its newline when it is whole."""
    run = tmp_path / "live"
    write_run(run, {"status": "RUNNING", "started": 1e9}, metrics=[{"step": 1}])
    with open(run / "metrics.jsonl", "a") as f:
        f.write(_line({"step": 2}))  # no newline yet
    record = read_run(_view(run))
    assert record.status == "ABORTED"  # RUNNING, but no live driver holds it
    assert record.metrics.reports == 1 and record.metrics.offset == len(_line({"step": 1})) + 1
    assert [line["metrics"] for line in _view(run).metric_lines()] == [{"step": 1}, {"step": 2}]
    lines, end = _view(run).metrics_after(record.metrics.offset)
    assert (lines, end) == ([], record.metrics.offset)  # the unended line is not handed out yet


def test_missing_files_read_as_empty(tmp_path: Path) -> None:
    run = tmp_path / "bare"
    write_run(run)  # run.json only: no metrics.jsonl, no summary, no checkpoint index, no logs
    view = _view(run)
    record = read_run(view)
    assert (record.status, record.problems, record.metrics) == ("FINISHED", [], MetricsSummary())
    assert (record.checkpoints, record.best_checkpoint, record.latest_checkpoint) == ([], None, None)
    assert record.duration_s == 5
    assert view.attempts() == [] and view.metrics_tail(10) == ([], MetricsSummary())
    assert Result.from_path(run).metrics is None


def test_without_a_summary_the_lines_are_read_and_a_stale_one_is_not_trusted(tmp_path: Path) -> None:
    run = tmp_path / "summaries"
    write_run(run, metrics=[{"acc": 0.5}, {"acc": 0.75}, "not json", '["json", "but not a report"]'])
    record = read_run(_view(run))
    assert record.metrics.reports == 2 and record.metrics.foreign == 1
    assert record.problems == [f"{run / 'metrics.jsonl'}: 1 line(s) are not reports (skipped)"]
    # A summary that claims more than the file holds (the file was replaced) is ignored.
    (run / "metrics_summary.json").write_text(
        json.dumps({"version": 1, "offset": 10**6, "reports": 99, "foreign": 0, "last": None, "stats": {}})
    )
    assert read_run(_view(run)).metrics.reports == 2


def test_a_run_of_3821c3e_reads_as_it_was_written(tmp_path: Path) -> None:
    run = tmp_path / "run_3821c3e"
    shutil.copytree(SAVED_RUN, run)
    record = read_run(_view(run))
    assert (record.status, record.problems) == ("ERRORED", [])
    assert record.info["num_workers"] == 2 and record.info["attempt_errors"][0]["attempt"] == 0
    assert "interrupted on purpose" in record.info["error"]
    assert record.metrics.reports == 2 and record.metrics.stats is not None
    assert record.metrics.stats["loss"] == [2.3740289211273193, 1.3740289211273193, 2.3740289211273193]
    assert [Path(path).name for path, _ in record.checkpoints] == ["checkpoint_000001", "checkpoint_000002"]
    assert Path(record.latest_checkpoint or "").name == "checkpoint_000002"
    assert _view(run).attempts() == [0] and _view(run).log_ranks(0) == [0, 1]
    result = Result.from_path(run)
    assert result.metrics == {"epoch": 1, "loss": 2.3740289211273193, "resumed": False}
    assert result.checkpoint is not None and Path(result.checkpoint.path).name == "checkpoint_000002"


def test_what_is_not_as_ddptrain_writes_it_is_named_and_the_rest_read(tmp_path: Path) -> None:
    run = tmp_path / "odd"
    write_run(run, {"status": "MAYBE", "started": "yesterday", "num_workers": 4}, metrics=[{"x": 1}])
    (run / "checkpoints.json").write_text("{not json")
    record = read_run(_view(run))
    assert record.info == {"num_workers": 4}
    assert record.metrics.reports == 1
    assert len(record.problems) == 2
    assert "`status` is 'MAYBE'" in record.problems[0] and "`started` is 'yesterday'" in record.problems[0]
    assert "checkpoints.json" in record.problems[1]

    not_object = tmp_path / "list"
    write_run(not_object, b"[1, 2]")
    assert read_run(_view(not_object)).problems == [f"{not_object / 'run.json'} holds a JSON list, not an object"]


def test_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="is not a ddptrain run directory"):
        with open_result_run(str(tmp_path)):
            pass
    with pytest.raises(read.RunNotFound, match=r"is not a ddptrain run directory \(no run.json\)"):
        read.find_run(str(tmp_path))
    run = tmp_path / "some-run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    with pytest.raises(RuntimeError, match=r"\(it has no run.json\)\. It holds runs: give one of them, e.g. "):
        with open_result_run(str(tmp_path)):  # Result.from_path(storage_path)
            pass
