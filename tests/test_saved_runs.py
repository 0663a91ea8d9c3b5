"""Runs saved by an earlier ddptrain still load and resume: ``tests/data/run_3821c3e/`` was written
by commit 3821c3e (how: ``tests/data/README.md``). Moving internal modules must not break them:
``trainer.pkl`` names only public modules, and every file of the run directory is read by today's
code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain.cli.main import main
from ddptrain.torch import TorchTrainer

DATA = Path(__file__).resolve().parent / "data"
SAVED = DATA / "run_3821c3e"


@pytest.fixture
def saved_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the saved run, in a storage folder of its own; its training function importable
    (workers get the driver's ``sys.path``)."""
    monkeypatch.syspath_prepend(str(DATA))
    storage = tmp_path / "storage"
    storage.mkdir()
    shutil.copytree(SAVED, storage / SAVED.name)
    return storage / SAVED.name


def test_a_saved_run_reads_as_it_was_written(saved_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = train.Result.from_path(str(saved_run))
    assert result.metrics == {"epoch": 1, "loss": pytest.approx(2.374, abs=1e-3), "resumed": False}
    assert result.checkpoint is not None and Path(result.checkpoint.path).name == "checkpoint_000002"
    assert [Path(c.path).name for c, _ in result.best_checkpoints] == ["checkpoint_000001", "checkpoint_000002"]
    assert [m["epoch"] for m in result.metrics_history] == [0, 1]

    assert main(["runs", str(saved_run.parent), "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert (listed["name"], listed["status"], listed["reports"]) == ("run_3821c3e", "ERRORED", 2)
    assert main(["show", str(saved_run)]) == 0
    shown = capsys.readouterr().out
    assert "ERRORED" in shown and "interrupted on purpose" in shown and "checkpoint_000002" in shown


@pytest.mark.parametrize("how", ["restore", "same name"])
def test_a_saved_run_resumes_from_its_latest_checkpoint(saved_run: Path, how: str) -> None:
    if how == "restore":
        assert TorchTrainer.can_restore(str(saved_run))
        trainer = TorchTrainer.restore(str(saved_run))
    else:
        from compat_train import train_func

        trainer = TorchTrainer(
            train_func,
            train_loop_config={"epochs": 4, "fail_after": 2},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(
                name=saved_run.name,
                storage_path=str(saved_run.parent),
                checkpoint_config=train.CheckpointConfig(num_to_keep=2),
            ),
        )
    result = trainer.fit()
    assert result.error is None
    assert result.metrics["epoch"] == 3 and result.metrics["resumed"] is True
    assert [m["epoch"] for m in result.metrics_history] == [0, 1, 2, 3]
    assert Path(result.path) == saved_run
    assert sorted(p.name for p in saved_run.glob("checkpoint_*")) == ["checkpoint_000003", "checkpoint_000004"]
