"""Checkpoints: persisted atomically, merged across ranks, kept by score, and resumed from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from forked_driver import ForkedDriver

import ddptrain as train
from ddptrain.storage.checkpoint_manager import RunDirectoryError


def write_checkpoint(directory: str, **files: str) -> None:
    for name, text in files.items():
        Path(directory, name).write_text(text)


# --- the seed's loop: every rank saves, every epoch -------------------------------------------
def save_every_epoch(config: dict) -> dict:
    rank = train.get_context().get_world_rank()
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            start = json.loads(Path(d, "state.json").read_text())["epoch"] + 1
    for epoch in range(start, config["epochs"]):
        if config.get("crash_at") == epoch and rank == 1 and not Path(config["dir"], "crashed").exists():
            Path(config["dir"], "crashed").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        with tempfile.TemporaryDirectory() as d:
            write_checkpoint(d, **{"state.json": json.dumps({"epoch": epoch}), f"rank_{rank}.txt": str(epoch)})
            train.report(
                {"epoch": epoch, "score": config.get("scores", [0] * 99)[epoch]},
                checkpoint=train.Checkpoint.from_directory(d),
            )
        # The temporary directory is gone; the persisted copy is what get_checkpoint() returns.
        assert Path(train.get_checkpoint().path, "state.json").exists()
    return {"start": start}


def test_checkpoints_from_every_rank_are_merged_and_loadable(storage: str) -> None:
    result = train.DataParallelTrainer(
        save_every_epoch,
        train_loop_config={"epochs": 3},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="seed", storage_path=storage),
    ).fit()
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as d:
        assert sorted(os.listdir(d)) == ["rank_0.txt", "rank_1.txt", "state.json"]
        assert json.loads(Path(d, "state.json").read_text()) == {"epoch": 2}
    assert [os.path.basename(c.path) for c, _ in result.best_checkpoints] == [
        "checkpoint_000001",
        "checkpoint_000002",
        "checkpoint_000003",
    ]
    assert result.best_checkpoints[-1][1] == {"epoch": 2, "score": 0}
    run_dir = Path(storage, "seed")
    assert not (run_dir / ".staging").exists()
    again = train.Result.from_path(run_dir)
    assert again.checkpoint == result.checkpoint
    assert again.metrics == result.metrics


def rank_zero_name_wins() -> None:
    rank = train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as d:
        write_checkpoint(d, **{"common.txt": f"from rank {rank}", f"only_{rank}.txt": "x"})
        sub = Path(d, "nested")
        sub.mkdir()
        (sub / f"deep_{rank}.txt").write_text("y")
        train.report(
            {"rank": rank}, checkpoint=train.Checkpoint.from_directory(d), checkpoint_dir_name=f"named_by_{rank}"
        )
    if rank == 0:  # only rank 0 passes a checkpoint now
        with tempfile.TemporaryDirectory() as d:
            write_checkpoint(d, **{"solo.txt": "0"})
            train.report({"rank": 0}, checkpoint=train.Checkpoint.from_directory(d))
    else:
        train.report({"rank": rank})


def test_rank_zero_names_the_merged_checkpoint_and_subsets_work(storage: str) -> None:
    result = train.DataParallelTrainer(
        rank_zero_name_wins,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="merge", storage_path=storage),
    ).fit()
    merged = Path(storage, "merge", "named_by_0")
    assert sorted(p.relative_to(merged).as_posix() for p in merged.rglob("*") if p.is_file()) == [
        "common.txt",
        "nested/deep_0.txt",
        "nested/deep_1.txt",
        "only_0.txt",
        "only_1.txt",
    ]
    assert (merged / "common.txt").read_text() == "from rank 0"
    assert not Path(storage, "merge", "named_by_1").exists()
    assert os.listdir(result.checkpoint.path) == ["solo.txt"]


def bad_dir_name(config: dict) -> None:
    with tempfile.TemporaryDirectory() as d:
        train.report({}, checkpoint=train.Checkpoint.from_directory(d), checkpoint_dir_name=config["name"])


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "a/b", "..", ".hidden"])
def test_checkpoint_names_that_escape_the_run_directory_are_refused(storage: str, name: str) -> None:
    with pytest.raises(train.TrainingFailedError) as info:
        train.DataParallelTrainer(
            bad_dir_name,
            train_loop_config={"name": name},
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert isinstance(info.value.__cause__, ValueError)
    assert "`checkpoint_dir_name` must be a plain folder name" in str(info.value)


def report_a_file(config: dict) -> str:
    """What report() raised, on the user's own line, for a checkpoint that is a file or missing."""
    handle, path = tempfile.mkstemp()
    os.close(handle)
    said = []
    for checkpoint in (path, path + ".gone"):
        for mode in ("SYNC", "ASYNC"):
            try:
                train.report({}, checkpoint=train.Checkpoint(checkpoint), checkpoint_upload_mode=mode)
            except OSError as exc:
                said.append(f"{type(exc).__name__}: {exc}")
    os.remove(path)
    train.report({"after": 1})  # nothing was sent: the run goes on
    return "\n".join(said)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_checkpoint_that_is_a_file_is_refused_at_report_saying_so(storage: str, workers: int) -> None:
    result = train.DataParallelTrainer(
        report_a_file,
        scaling_config=train.ScalingConfig(num_workers=workers),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    said = result.return_value.splitlines()
    assert len(said) == 4, said
    assert all(line.startswith("NotADirectoryError: Checkpoint ") for line in said[:2]), said
    assert "is a file, not a folder: a checkpoint is a folder of files" in said[0]
    assert all(line.startswith("FileNotFoundError: Checkpoint directory ") for line in said[2:]), said
    assert result.metrics == {"after": 1} and result.checkpoint is None


def reports_accuracy(config: dict) -> None:
    for step in range(3):
        with tempfile.TemporaryDirectory() as d:
            write_checkpoint(d, step=str(step))
            train.report({"accuracy": step / 10, "step": step}, checkpoint=train.Checkpoint.from_directory(d))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_score_attribute_no_checkpoint_has_is_said_once(storage: str, workers: int, capfd) -> None:
    """A typo in `checkpoint_score_attribute` silently ranked every checkpoint as the worst."""
    result = train.DataParallelTrainer(
        reports_accuracy,
        scaling_config=train.ScalingConfig(num_workers=workers),
        run_config=train.RunConfig(
            storage_path=storage, checkpoint_config=train.CheckpointConfig(2, checkpoint_score_attribute="acc")
        ),
    ).fit()
    err = capfd.readouterr().err
    said = "checkpoint_score_attribute 'acc' is not among the metrics of checkpoint_000001 (they are: accuracy, step)"
    assert err.count(said) == 1 and err.count("is not among the metrics") == 1, err
    assert "or correct the name" in err
    assert result.checkpoint is not None and result.checkpoint.path.endswith("checkpoint_000003")


def nested_val_loss(config: dict) -> None:
    """Reports ``{"epoch": e, "val": {"loss": ...}}`` with a checkpoint, the best first."""
    for epoch, loss in enumerate([0.1, 0.5, 0.9]):
        with tempfile.TemporaryDirectory() as d:
            write_checkpoint(d, epoch=str(epoch))
            train.report({"epoch": epoch, "val": {"loss": loss}}, checkpoint=train.Checkpoint.from_directory(d))


@pytest.mark.parametrize(
    ("attribute", "kept", "warned"),
    [
        ("val/loss", ["checkpoint_000001", "checkpoint_000003"], False),  # Ray's name of a nested metric
        ("val_loss", ["checkpoint_000003"], True),  # a typo: nothing to rank by, the newest is kept
    ],
)
def test_the_score_attribute_reaches_nested_metrics(
    storage: str, capfd, attribute: str, kept: list[str], warned: bool
) -> None:
    """As in Ray (which flattens metrics), 'val/loss' ranks by ``metrics["val"]["loss"]``: the
    best checkpoint was deleted as unscored, and the console called the name a typo."""
    result = train.DataParallelTrainer(
        nested_val_loss,
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(
            name="scored",
            storage_path=storage,
            checkpoint_config=train.CheckpointConfig(
                num_to_keep=1, checkpoint_score_attribute=attribute, checkpoint_score_order="min"
            ),
        ),
    ).fit()
    assert sorted(p.name for p in Path(storage, "scored").glob("checkpoint_*")) == kept
    assert result.best_checkpoints[0][0].path.endswith(kept[0])
    err = capfd.readouterr().err
    if warned:
        assert "'val_loss' is not among the metrics of checkpoint_000001 (they are: epoch, val/loss)" in err
    else:
        assert "is not among the metrics" not in err, err


def test_checkpoint_metadata_and_local_helpers(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "weights.bin").write_bytes(b"\0" * 1000)
    checkpoint = train.Checkpoint.from_directory(source)
    assert checkpoint.get_metadata() == {}
    checkpoint.set_metadata({"epoch": 3})
    checkpoint.update_metadata({"lr": 0.1})
    assert train.Checkpoint(source).get_metadata() == {"epoch": 3, "lr": 0.1}
    with pytest.raises(TypeError, match="as_directory"):
        open(checkpoint)  # noqa: SIM115
    assert repr(checkpoint) == f"Checkpoint(filesystem=local, path={source})"
    # Several threads copying to one target share one copy and all see it complete.
    target = tmp_path / "copy"
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(checkpoint.to_directory(target))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [str(target)] * 4
    assert (target / "weights.bin").stat().st_size == 1000
    assert train.Checkpoint(target).get_metadata() == {"epoch": 3, "lr": 0.1}
    assert Path(checkpoint.to_directory()).is_dir()


def metadata_in_worker() -> dict:
    with tempfile.TemporaryDirectory() as d:
        checkpoint = train.Checkpoint.from_directory(d)
        checkpoint.set_metadata({"step": 10})
        train.report({"x": 1}, checkpoint=checkpoint)
    return train.get_checkpoint().get_metadata()


def test_metadata_travels_with_the_persisted_checkpoint(storage: str) -> None:
    result = train.DataParallelTrainer(
        metadata_in_worker,
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_value == {"step": 10}
    assert result.checkpoint.get_metadata() == {"step": 10}


# --- retention ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("num_to_keep", "attribute", "order", "on_disk", "best"),
    [
        (1, "score", "max", [0, 4], [0]),  # the best survives a worse latest checkpoint
        (2, "score", "max", [0, 2, 4], [2, 0]),
        (2, "score", "min", [1, 3, 4], [3, 1]),
        (2, None, "max", [3, 4], [3, 4]),
    ],
)
def test_retention_keeps_the_best_plus_the_latest(
    storage: str, num_to_keep: int, attribute: str | None, order: str, on_disk: list[int], best: list[int]
) -> None:
    result = train.DataParallelTrainer(
        save_every_epoch,
        train_loop_config={"epochs": 5, "scores": [5, 1, 4, 2, 3]},
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(
            name="keep",
            storage_path=storage,
            checkpoint_config=train.CheckpointConfig(
                num_to_keep=num_to_keep, checkpoint_score_attribute=attribute, checkpoint_score_order=order
            ),
        ),
    ).fit()
    # Like Ray Train: the top `num_to_keep` by score stay on disk, and the latest one too.
    assert sorted(p.name for p in Path(storage, "keep").glob("checkpoint_*")) == [
        f"checkpoint_{e + 1:06d}" for e in on_disk
    ]
    assert result.checkpoint.path.endswith("checkpoint_000005")
    # `best_checkpoints` lists only the top `num_to_keep`, worst first.
    assert [m["epoch"] for _, m in result.best_checkpoints] == best
    assert [m["epoch"] for _, m in train.Result.from_path(result.path).best_checkpoints] == best
    if attribute:
        best_path = result.get_best_checkpoint("score", order).path
        assert best_path.endswith(f"checkpoint_{best[-1] + 1:06d}")
        assert json.loads(Path(best_path, "state.json").read_text()) == {"epoch": best[-1]}
    with pytest.raises(RuntimeError, match="metric 'nope'"):
        result.get_best_checkpoint("nope", "max")


def list_reported() -> list:
    for epoch in range(2):
        with tempfile.TemporaryDirectory() as d:
            train.report({"epoch": epoch}, checkpoint=train.Checkpoint.from_directory(d))
    return [(os.path.basename(r.checkpoint.path), r.metrics) for r in train.get_all_reported_checkpoints()]


def test_get_all_reported_checkpoints(storage: str) -> None:
    result = train.DataParallelTrainer(
        list_reported,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    expected = [("checkpoint_000001", {"epoch": 0}), ("checkpoint_000002", {"epoch": 1})]
    assert result.return_values == [expected, expected]


# --- failures and restarts ------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_killed_worker_restarts_from_the_latest_checkpoint(storage: str, tmp_path: Path) -> None:
    result = train.DataParallelTrainer(
        save_every_epoch,
        train_loop_config={"epochs": 4, "crash_at": 2, "dir": str(tmp_path)},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="ft", storage_path=storage, failure_config=train.FailureConfig(max_failures=1)),
    ).fit()
    assert result.return_values == [{"start": 2}, {"start": 2}]
    # Rank 0 may have reported epoch 2 in the first attempt before rank 1 died; every report is kept.
    epochs = [m["epoch"] for m in result.metrics_history]
    assert epochs in ([0, 1, 2, 3], [0, 1, 2, 2, 3])
    assert result.metrics["epoch"] == 3
    logs = Path(storage, "ft", "logs")
    assert sorted(p.name for p in logs.iterdir()) == ["attempt_0", "attempt_1"]


def always_fails() -> None:
    if train.get_context().get_world_rank() == 0:
        raise RuntimeError(f"failure in pid {os.getpid()}")
    time.sleep(60)


@pytest.mark.timeout(120)
def test_every_attempts_root_cause_is_listed_once_the_budget_is_spent(storage: str) -> None:
    with pytest.raises(train.TrainingFailedError) as info:
        train.DataParallelTrainer(
            always_fails,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(
                name="budget", storage_path=storage, failure_config=train.FailureConfig(max_failures=2)
            ),
        ).fit()
    message = str(info.value)
    assert "Root cause of every attempt (3):" in message
    for attempt in range(3):
        assert f"attempt {attempt}: rank 0" in message
        assert f"attempt_{attempt}/rank_0.log" in message


def kill_during_copy(config: dict) -> None:
    checkpoint = train.get_checkpoint()
    rank = train.get_context().get_world_rank()
    if checkpoint is None:
        with tempfile.TemporaryDirectory() as d:
            write_checkpoint(d, **{"state.json": json.dumps({"epoch": 0})})
            train.report({"epoch": 0}, checkpoint=train.Checkpoint.from_directory(d))
        if rank == 1:
            staging = Path(train.get_context().get_storage().experiment_fs_path, ".staging")

            def kill_when_copying() -> None:
                while not any(p.name.startswith(".rank_1.") for p in staging.rglob(".rank_*")):
                    time.sleep(0.001)
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Thread(target=kill_when_copying, daemon=True).start()
        with tempfile.TemporaryDirectory() as d:
            Path(d, "big.bin").write_bytes(os.urandom(64 * 1024 * 1024))
            train.report({"epoch": 1}, checkpoint=train.Checkpoint.from_directory(d))
        time.sleep(30)  # not reached by rank 1
    return json.loads(Path(checkpoint.path, "state.json").read_text())


@pytest.mark.timeout(120)
def test_a_worker_killed_while_copying_leaves_earlier_checkpoints_intact(storage: str) -> None:
    result = train.DataParallelTrainer(
        kill_during_copy,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(
            name="copy", storage_path=storage, failure_config=train.FailureConfig(max_failures=1)
        ),
    ).fit()
    assert result.return_values == [{"epoch": 0}, {"epoch": 0}]
    run_dir = Path(storage, "copy")
    assert sorted(p.name for p in run_dir.glob("checkpoint_*")) == ["checkpoint_000001"]
    assert not (run_dir / ".staging").exists()


# --- resume ---------------------------------------------------------------------------
RESUME_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, tempfile, time
    from pathlib import Path
    import ddptrain as train

    def loop(config):
        start = 0
        checkpoint = train.get_checkpoint()
        if checkpoint:
            start = json.loads(Path(checkpoint.path, "state.json").read_text())["step"] + 1
        for step in range(start, config["steps"]):
            with tempfile.TemporaryDirectory() as d:
                for i in range(20):
                    Path(d, f"part_{i}.bin").write_bytes(os.urandom(20_000))
                Path(d, "state.json").write_text(json.dumps({"step": step}))
                train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(d))
            print("step", step, flush=True)
        return start

    if __name__ == "__main__":
        result = train.DataParallelTrainer(
            loop, train_loop_config={"steps": int(sys.argv[2])},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="resumable", storage_path=sys.argv[1]),
        ).fit()
        print("RESULT", json.dumps({"start": result.return_value, "steps": len(result.metrics_history)}))
    """
)


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The driver script in a process of its own (forked: it need not import torch again)."""
    proc = ForkedDriver(script, list(args))
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess([str(script), *args], proc.returncode or 0, out, err)


@pytest.mark.timeout(180)
def test_killed_driver_resumes_loudly_from_the_last_committed_checkpoint(storage: str, tmp_path: Path) -> None:
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    proc = ForkedDriver(script, [storage, "100000"])  # a driver process of its own
    for line in proc.stdout:  # let it commit a good number of checkpoints, then kill it mid-stream
        if line.startswith("[rank0] step 40"):
            break
    proc.kill()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err

    run_dir = Path(storage, "resumable")
    crashed = train.Result.from_path(run_dir)  # a crashed run directory is loadable
    last = json.loads(Path(crashed.checkpoint.path, "state.json").read_text())["step"]
    assert last >= 40
    assert len(list(Path(crashed.checkpoint.path).glob("part_*.bin"))) == 20
    for checkpoint, _ in crashed.best_checkpoints:  # every committed checkpoint is complete
        assert Path(checkpoint.path, "state.json").exists()

    done = run_script(script, storage, str(last + 3))
    assert done.returncode == 0, done.stderr
    assert f"resuming run 'resumable' from checkpoint {crashed.checkpoint.path}" in done.stderr
    summary = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert summary["start"] == last + 1
    assert not list(run_dir.glob(".*partial"))


def test_a_resumed_run_never_commits_over_a_checkpoint_after_metrics_lost_lines(
    storage: str, caplog: pytest.LogCaptureFixture
) -> None:
    def fit(epochs: int) -> train.Result:
        return train.DataParallelTrainer(
            save_every_epoch,
            train_loop_config={"epochs": epochs},
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(name="lossy", storage_path=storage),
        ).fit()

    first = fit(2)
    Path(first.path, "metrics.jsonl").write_text("")  # the file lost its lines
    again = fit(3)
    assert again.return_values == [{"start": 2}]
    # The new checkpoint gets a new name; the ones the run resumed from keep their contents.
    assert again.checkpoint.path.endswith("checkpoint_000003")
    assert [os.path.basename(c.path) for c, _ in again.best_checkpoints] == [
        "checkpoint_000001",
        "checkpoint_000002",
        "checkpoint_000003",
    ]
    for epoch, (checkpoint, metrics) in enumerate(again.best_checkpoints):
        assert json.loads(Path(checkpoint.path, "state.json").read_text()) == {"epoch": epoch}
        assert metrics["epoch"] == epoch
    assert "metrics.jsonl has 0 reports but the checkpoint index records report #2" in caplog.text


def test_a_corrupt_index_is_a_clear_error_and_changes_nothing(storage: str) -> None:
    run_dir = Path(storage, "corrupt")
    run_dir.mkdir(parents=True)
    index = run_dir / "checkpoints.json"
    index.write_text('{"version": 1, "checkpoints": [')
    before = sorted(p.name for p in run_dir.iterdir())
    with pytest.raises(RunDirectoryError, match="Cannot read the checkpoint index .*Nothing was changed"):
        train.DataParallelTrainer(
            save_every_epoch,
            train_loop_config={"epochs": 1},
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(name="corrupt", storage_path=storage),
        ).fit()
    assert index.read_text() == '{"version": 1, "checkpoints": ['
    assert sorted(p.name for p in run_dir.iterdir()) == before
    index.write_text(json.dumps({"version": 99}))
    with pytest.raises(RunDirectoryError, match="version 99"):
        train.Result.from_path(run_dir) if (run_dir / "run.json").exists() else train.DataParallelTrainer(
            save_every_epoch,
            train_loop_config={"epochs": 1},
            run_config=train.RunConfig(name="corrupt", storage_path=storage),
        ).fit()


def test_resume_from_checkpoint_starts_a_new_run_from_it(storage: str, tmp_path: Path) -> None:
    source = tmp_path / "given"
    source.mkdir()
    (source / "state.json").write_text(json.dumps({"epoch": 1}))
    result = train.DataParallelTrainer(
        save_every_epoch,
        train_loop_config={"epochs": 3},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="fresh", storage_path=storage),
        resume_from_checkpoint=train.Checkpoint.from_directory(source),
    ).fit()
    assert result.return_values == [{"start": 2}, {"start": 2}]


def test_restore_continues_an_interrupted_run(storage: str, tmp_path: Path) -> None:
    result = train.DataParallelTrainer(
        save_every_epoch,
        train_loop_config={"epochs": 2},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="restorable", storage_path=storage),
    ).fit()
    assert train.DataParallelTrainer.can_restore(result.path)
    assert not train.DataParallelTrainer.can_restore(tmp_path)
    trainer = train.DataParallelTrainer.restore(result.path, train_loop_config={"epochs": 4})
    again = trainer.fit()
    assert again.return_values == [{"start": 2}, {"start": 2}]
    assert [m["epoch"] for m in again.metrics_history] == [0, 1, 2, 3]
    with pytest.raises(RunDirectoryError, match="has no trainer.pkl"):
        train.DataParallelTrainer.restore(tmp_path)


def crash_right_after_report(config: dict) -> int:
    checkpoint = train.get_checkpoint()
    step = 0 if checkpoint is None else json.loads(Path(checkpoint.path, "state.json").read_text())["step"] + 1
    if step == 0:
        with tempfile.TemporaryDirectory() as d:
            write_checkpoint(d, **{"state.json": json.dumps({"step": 0})})
            train.report({"step": 0}, checkpoint=train.Checkpoint.from_directory(d))
        if train.get_context().get_world_rank() == 1:
            os._exit(3)  # milliseconds after report() returned
        time.sleep(30)
    return step


@pytest.mark.timeout(120)
def test_a_checkpoint_is_never_lost_once_report_returned(storage: str) -> None:
    for run in range(3):  # the crash follows the report by microseconds: try a few times
        result = train.DataParallelTrainer(
            crash_right_after_report,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(
                name=f"race{run}", storage_path=storage, failure_config=train.FailureConfig(max_failures=1)
            ),
        ).fit()
        assert result.return_values == [1, 1]


def reserved_name(config: dict) -> str:
    with tempfile.TemporaryDirectory() as d:
        try:
            train.report({}, checkpoint=train.Checkpoint.from_directory(d), checkpoint_dir_name=config["name"])
        except ValueError as exc:
            return str(exc)
    return "accepted"


@pytest.mark.parametrize("name", ["logs", "checkpoints.json", "metrics.jsonl", "run.json", "trainer.pkl"])
def test_checkpoint_names_of_run_files_are_refused(storage: str, name: str) -> None:
    result = train.DataParallelTrainer(
        reserved_name,
        train_loop_config={"name": name},
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(name="r", storage_path=storage),
    ).fit()
    assert "is the name of one of the run's own files" in result.return_value
    assert Path(storage, "r", "logs", "attempt_0", "rank_0.log").exists()


def test_a_folder_that_is_not_a_checkpoint_is_not_overwritten(storage: str) -> None:
    Path(storage, "r", "notes").mkdir(parents=True)
    Path(storage, "r", "notes", "keep.txt").write_text("mine")
    result = train.DataParallelTrainer(
        reserved_name,
        train_loop_config={"name": "notes"},
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(name="r", storage_path=storage),
    ).fit()
    assert "is not a checkpoint of this run" in result.return_value
    assert Path(storage, "r", "notes", "keep.txt").read_text() == "mine"


def test_an_interrupted_overwrite_is_rolled_back(storage: str) -> None:
    from ddptrain.storage import layout as store

    run_dir = Path(storage, "roll")
    run_dir.mkdir(parents=True)
    staged = run_dir / "staged"
    staged.mkdir()
    (staged / "v.txt").write_text("1")
    path = run_dir / "latest"
    store.move_into_place(store.build_checkpoint(str(run_dir), [str(staged)], "latest"), path)
    store.remove_staged([str(staged)])
    # The driver died between moving the old copy aside and renaming the new one in.
    os.rename(path, run_dir / ".latest.0123abcd.old")
    (run_dir / ".latest.4567ef.partial").mkdir()
    store.clean_leftovers(str(run_dir))
    assert (run_dir / "latest" / "v.txt").read_text() == "1"
    assert sorted(p.name for p in run_dir.iterdir()) == ["latest"]


def returns_early_while_rank0_waits() -> None:
    if train.get_context().get_world_rank() == 0:
        train.collective.barrier()


@pytest.mark.timeout(60)
def test_a_rank_that_returned_while_others_wait_fails_the_run(storage: str) -> None:
    with pytest.raises(train.TrainingFailedError) as info:
        train.DataParallelTrainer(
            returns_early_while_rank0_waits,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert "rank(s) [1] returned from the training function while rank(s) [0] wait" in str(info.value)


def test_restore_asks_for_the_datasets_again(storage: str) -> None:
    result = train.DataParallelTrainer(
        lambda: None,
        datasets={"train": train.data.from_items([1, 2])},
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(name="withdata", storage_path=storage),
    ).fit()
    with pytest.raises(ValueError, match=r"used the datasets \['train'\]"):
        train.DataParallelTrainer.restore(result.path)
    trainer = train.DataParallelTrainer.restore(result.path, datasets={"train": train.data.from_items([3])})
    assert list(trainer.datasets) == ["train"]


def list_after_report_without_checkpoint() -> list:
    # Only rank 0 saves, and it is slow to get there: rank 1's report returns at once.
    rank = train.get_context().get_world_rank()
    if rank == 0:
        time.sleep(1.0)
        with tempfile.TemporaryDirectory() as d:
            write_checkpoint(d, **{"model.txt": "weights"})
            train.report({"step": 1}, checkpoint=train.Checkpoint.from_directory(d))
    else:
        train.report({"step": 1})
    return [(os.path.basename(r.checkpoint.path), r.metrics) for r in train.get_all_reported_checkpoints()]


def test_get_all_reported_checkpoints_waits_for_reports_in_flight(storage: str) -> None:
    # As in Ray: the call first waits for every report this rank made to be processed, so the
    # checkpoint rank 0 passed to the same report() call is listed on rank 1 too.
    result = train.DataParallelTrainer(
        list_after_report_without_checkpoint,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    expected = [("checkpoint_000001", {"step": 1})]
    assert result.return_values == [expected, expected]


def list_with_timeout() -> tuple:
    rank = train.get_context().get_world_rank()
    if rank == 0:
        time.sleep(3.0)
        with tempfile.TemporaryDirectory() as d:
            train.report({"step": 1}, checkpoint=train.Checkpoint.from_directory(d))
        return ()
    train.report({"step": 1})
    start = time.monotonic()
    listed = train.get_all_reported_checkpoints(timeout_s=0.5)
    return len(listed), time.monotonic() - start


def test_get_all_reported_checkpoints_timeout_returns_what_is_committed(storage: str) -> None:
    result = train.DataParallelTrainer(
        list_with_timeout,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    listed, waited_s = result.return_values[1]
    assert listed == 0  # rank 0's checkpoint was not reported yet when the timeout was over
    assert 0.4 < waited_s < 2.5


# --- checkpoints and runs on file systems given as objects (Ray's persistence tests) ----------
def _dir_filesystem(root: Path, wrapped: bool) -> object:
    """Ray's "custom file system" of its persistence tests: a local folder through fsspec's
    DirFileSystem, given as it is or wrapped as a pyarrow file system."""
    pafs = pytest.importorskip("pyarrow.fs")
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    root.mkdir(parents=True, exist_ok=True)
    fs = DirFileSystem(path=str(root), fs=LocalFileSystem())
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)) if wrapped else fs


@pytest.fixture
def mock_scheme() -> Iterator[None]:
    """``mock://``: an fsspec scheme whose class wraps a pyarrow file system (pyarrow's in-memory
    one), as fsspec's ``hdfs://`` does."""
    pafs = pytest.importorskip("pyarrow.fs")
    import fsspec
    from fsspec.implementations.arrow import ArrowFSWrapper
    from fsspec.registry import _registry

    class MockArrowFS(ArrowFSWrapper):
        protocol = "mock"

        def __init__(self, **kwargs: object) -> None:
            super().__init__(fs=pafs._MockFileSystem(), **kwargs)

    fsspec.register_implementation("mock", MockArrowFS, clobber=True)
    yield
    MockArrowFS.clear_instance_cache()
    _registry.pop("mock", None)


def _remote_checkpoints(where: str, tmp_path: Path) -> tuple[train.Checkpoint, train.Checkpoint]:
    """A checkpoint with a file ``dummy.txt`` on ``mock://`` or on a custom file system, and one
    that does not exist."""
    if where == "mock":
        checkpoint = train.Checkpoint("mock:///mock_bucket/ckpt_dir")
        missing = train.Checkpoint("mock:///mock_bucket/no_such_ckpt")
    else:
        fs = _dir_filesystem(tmp_path / "custom_fs", wrapped=True)
        checkpoint = train.Checkpoint("mock_bucket/ckpt_dir", filesystem=fs)
        missing = train.Checkpoint("mock_bucket/no_such_ckpt", filesystem=fs)
    checkpoint._fs.makedirs(checkpoint._fs._strip_protocol(checkpoint.path), exist_ok=True)
    checkpoint._fs.pipe_file(checkpoint._fs._strip_protocol(checkpoint.path) + "/dummy.txt", b"dummy")
    return checkpoint, missing


def test_a_uri_checkpoints_path_works_with_its_filesystem(mock_scheme: None, tmp_path: Path) -> None:
    """Ray's checkpoint test writes a checkpoint's files through ``.filesystem`` at ``.path``:
    for a scheme whose fsspec class wraps a pyarrow file system too."""
    pafs = pytest.importorskip("pyarrow.fs")
    source = tmp_path / "ckpt_dir"
    source.mkdir()
    (source / "dummy.txt").write_text("dummy")
    checkpoint = train.Checkpoint("mock:///mock_bucket/ckpt_dir")
    fs = checkpoint.filesystem
    assert isinstance(fs, pafs.FileSystem)
    fs.create_dir(checkpoint.path)
    pafs.copy_files(str(source), checkpoint.path, destination_filesystem=fs)
    with fs.open_output_stream(checkpoint.path + "/extra.txt") as out:
        out.write(b"extra")
    assert fs.get_file_info(checkpoint.path + "/dummy.txt").type == pafs.FileType.File
    assert sorted(os.listdir(checkpoint.to_directory())) == ["dummy.txt", "extra.txt"]


@pytest.mark.parametrize("where", ["mock", "custom_fs"])
def test_remote_checkpoints_download_into_one_prefix(where: str, mock_scheme: None, tmp_path: Path) -> None:
    checkpoint, _ = _remote_checkpoints(where, tmp_path)
    downloaded = Path(checkpoint.to_directory())
    assert os.listdir(downloaded) == ["dummy.txt"]
    assert downloaded.name.startswith("checkpoint_tmp_")
    with checkpoint.as_directory() as d:
        assert Path(d, "dummy.txt").read_text() == "dummy"
        assert Path(d).name.startswith("checkpoint_tmp_")  # one prefix for both (Ray's)
    assert not Path(d).exists()


@pytest.mark.parametrize("where", ["mock", "custom_fs"])
def test_a_missing_remote_checkpoint_is_a_file_not_found_error(where: str, mock_scheme: None, tmp_path: Path) -> None:
    _, missing = _remote_checkpoints(where, tmp_path)
    target = tmp_path / "copy_of_missing"
    with pytest.raises(FileNotFoundError, match=missing.path):
        missing.to_directory(target)
    assert not target.exists()
    with pytest.raises(FileNotFoundError, match=missing.path), missing.as_directory():
        pass


def count_on_custom_fs(config: dict) -> int:
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            start = json.loads(Path(d, "state.json").read_text())["epoch"] + 1
    rank = train.get_context().get_world_rank()
    for epoch in range(start, config["epochs"]):
        with tempfile.TemporaryDirectory() as d:
            write_checkpoint(d, **{"state.json": json.dumps({"epoch": epoch}), f"rank_{rank}.txt": str(epoch)})
            train.report({"epoch": epoch}, checkpoint=train.Checkpoint.from_directory(d))
    return start


def test_a_run_on_a_filesystem_with_folders_creates_them_and_restores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ray's persistence tests' custom file system: parent folders that do not exist yet are
    created; the run resumes and restores with the file system given again."""
    root = tmp_path / "custom_fs"
    fs = _dir_filesystem(root, wrapped=True)

    def trainer(epochs: int) -> train.DataParallelTrainer:
        return train.DataParallelTrainer(
            count_on_custom_fs,
            train_loop_config={"epochs": epochs},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="run", storage_path="bucket/exp", storage_filesystem=fs),
        )

    result = trainer(2).fit()
    assert result.path == "bucket/exp/run"
    assert "results in bucket/exp/run\n" in capsys.readouterr().err  # a path on the file system, as given
    assert result.checkpoint.path == "bucket/exp/run/checkpoint_000002"
    persisted = root / "bucket" / "exp" / "run"
    assert sorted(os.listdir(persisted / "checkpoint_000002")) == ["rank_0.txt", "rank_1.txt", "state.json"]
    assert {"run.json", "metrics.jsonl", "checkpoints.json", "trainer.pkl"} <= set(os.listdir(persisted))
    assert (persisted / "logs" / "attempt_0" / "rank_1.log").is_file()

    assert train.DataParallelTrainer.can_restore("bucket/exp/run", storage_filesystem=fs)
    restored = train.DataParallelTrainer.restore(
        "bucket/exp/run", storage_filesystem=fs, train_loop_config={"epochs": 3}
    )
    again = restored.fit()
    assert again.return_values == [2, 2]
    assert [m["epoch"] for m in again.metrics_history] == [0, 1, 2]
    # The file system is not saved with the run: without it, the error says to pass it.
    with pytest.raises(RunDirectoryError, match=r"restore\(path, storage_filesystem=fs\)"):
        train.DataParallelTrainer.restore("bucket/exp/run")
