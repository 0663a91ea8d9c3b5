"""``report(checkpoint_upload_mode=...)``: ASYNC uploads in the background, NO_UPLOAD and
``checkpoint_upload_fn`` register a checkpoint the user put in place, back-pressure, and an
upload that fails fails the run naming the store. (On S3, with SIGKILLs: test_remote_storage.)"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ddptrain as train
from ddptrain import CheckpointUploadMode
from ddptrain.errors import StorageError, TrainingFailedError
from ddptrain.storage.uploads import CheckpointUploads

ASYNC = CheckpointUploadMode.ASYNC


def _fit(loop: Any, tmp_path: Path, workers: int = 1, name: str = "run", **config: Any) -> train.Result:
    return train.DataParallelTrainer(
        loop,
        train_loop_config=config,
        scaling_config=train.ScalingConfig(num_workers=workers),
        run_config=train.RunConfig(
            name=name, storage_path=str(tmp_path), checkpoint_config=train.CheckpointConfig(num_to_keep=2)
        ),
    ).fit()


def _async_loop(config: dict[str, Any]) -> dict[str, Any]:
    """Three ASYNC reports of a large-ish folder; what the worker saw as each report returned."""
    rank = train.get_context().get_world_rank()
    run_dir = train.get_context().get_storage().experiment_fs_path
    seen, folders = [], []
    for step in range(3):
        d = tempfile.mkdtemp()
        Path(d, f"weights_{rank}.bin").write_bytes(os.urandom(config["size"]))
        Path(d, f"step_{rank}").write_text(str(step))
        train.report(
            {"step": step},
            checkpoint=train.Checkpoint.from_directory(d),
            checkpoint_upload_mode=ASYNC,
            delete_local_checkpoint_after_upload=config["delete"],
        )
        seen.append(os.path.exists(os.path.join(run_dir, f"checkpoint_{step + 1:06d}")))
        folders.append(d)
    listed = [r.checkpoint.path for r in train.get_all_reported_checkpoints()]  # waits for the commits
    left = [os.path.exists(d) for d in folders]
    for d in folders:
        shutil.rmtree(d, ignore_errors=True)
    return {"seen": seen, "listed": listed, "left": left}


def test_async_reports_return_before_the_commit_which_follows_in_report_order(tmp_path: Path) -> None:
    result = _fit(_async_loop, tmp_path, workers=2, size=16 << 20, delete=False)
    run_dir = tmp_path / "run"
    for rank_result in result.return_values:
        # The report returned while its checkpoint was not committed yet (the bytes were not
        # copied in the training thread), and get_all_reported_checkpoints() waited for it.
        assert rank_result["seen"] == [False, False, False]
        assert rank_result["left"] == [True, True, True]  # delete_local_checkpoint_after_upload=False
        assert rank_result["listed"] == [str(run_dir / "checkpoint_000002"), str(run_dir / "checkpoint_000003")]
    assert result.checkpoint.path == str(run_dir / "checkpoint_000003")
    with result.checkpoint.as_directory() as d:
        assert sorted(os.listdir(d)) == ["step_0", "step_1", "weights_0.bin", "weights_1.bin"]
        assert Path(d, "step_1").read_text() == "2"
    # Committed in report order: the index lists them by report, each with its own metrics.
    assert [(c.path.rsplit("/", 1)[1], m["step"]) for c, m in result.best_checkpoints] == [
        ("checkpoint_000002", 1),
        ("checkpoint_000003", 2),
    ]
    assert not (run_dir / ".staging").exists()


def test_async_deletes_the_local_folder_after_its_upload_by_default(tmp_path: Path) -> None:
    result = _fit(_async_loop, tmp_path, size=1 << 20, delete=None)
    assert result.return_values[0]["left"] == [False, False, False]
    with result.checkpoint.as_directory() as d:
        assert sorted(os.listdir(d)) == ["step_0", "weights_0.bin"]
        assert os.path.getsize(os.path.join(d, "weights_0.bin")) == 1 << 20


def _in_place_loop(config: dict[str, Any]) -> None:
    """NO_UPLOAD into the run's own folder, then checkpoint_upload_fn (ASYNC, then SYNC)."""
    storage = train.get_context().get_storage()
    manual = storage.build_checkpoint_path_from_name("manual")
    os.makedirs(manual)
    Path(manual, "model").write_text("0")
    train.report(
        {"step": 0},
        checkpoint=train.Checkpoint(manual),
        checkpoint_dir_name="manual",
        checkpoint_upload_mode="NO_UPLOAD",
    )

    def upload(checkpoint: train.Checkpoint, dir_name: str) -> train.Checkpoint:
        target = config.get("target") or storage.build_checkpoint_path_from_name(dir_name)
        shutil.copytree(checkpoint.path, target)
        Path(target, "uploaded_by").write_text("fn")
        return train.Checkpoint.from_directory(target)

    for step, mode in ((1, ASYNC), (2, CheckpointUploadMode.SYNC))[: config.get("steps", 2)]:
        d = tempfile.mkdtemp()
        Path(d, "model").write_text(str(step))
        train.report(
            {"step": step}, checkpoint=train.Checkpoint(d), checkpoint_upload_mode=mode, checkpoint_upload_fn=upload
        )


def test_no_upload_and_checkpoint_upload_fn_commit_what_the_user_put_in_place(tmp_path: Path) -> None:
    result = train.DataParallelTrainer(
        _in_place_loop,
        train_loop_config={},
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(name="run", storage_path=str(tmp_path)),
    ).fit()
    run_dir = tmp_path / "run"
    paths = [c.path for c, _ in result.best_checkpoints]
    assert paths == [str(run_dir / "manual"), str(run_dir / "checkpoint_000002"), str(run_dir / "checkpoint_000003")]
    assert Path(paths[0], "model").read_text() == "0"
    for step, path in ((1, paths[1]), (2, paths[2])):
        assert Path(path, "model").read_text() == str(step)
        assert Path(path, "uploaded_by").read_text() == "fn"


def test_a_checkpoint_put_elsewhere_is_refused_with_the_folder_to_use(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(TrainingFailedError) as info:
        train.DataParallelTrainer(
            _in_place_loop,
            train_loop_config={"target": str(elsewhere), "steps": 1},
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(name="run", storage_path=str(tmp_path)),
        ).fit()
    text = str(info.value)
    assert "`checkpoint_upload_fn` returned is at" in text and str(elsewhere) in text
    assert str(tmp_path / "run" / "checkpoint_000002") in text  # the folder to use


def _failing_upload_loop(config: dict[str, Any]) -> None:
    run_dir = train.get_context().get_storage().experiment_fs_path
    Path(run_dir, ".staging").write_text("")  # a file where the staging folder goes: uploads fail
    d = tempfile.mkdtemp()
    Path(d, "model").write_text("0")
    train.report({"step": 0}, checkpoint=train.Checkpoint(d), checkpoint_upload_mode=ASYNC)
    # The function returns at once; its end waits for the upload, which fails the run.


def test_an_async_upload_that_fails_fails_the_run_naming_the_store(tmp_path: Path) -> None:
    with pytest.raises(TrainingFailedError) as info:
        _fit(_failing_upload_loop, tmp_path)
    root = info.value.failures[0].exception
    assert isinstance(root, StorageError), info.value
    assert "Uploading checkpoint 'checkpoint_000001' of report #1 to" in str(root)
    assert str(tmp_path / "run") in str(root)
    assert not (tmp_path / "run" / "checkpoint_000001").exists()


def _slow_upload_loop(config: dict[str, Any]) -> dict[str, float]:
    """Two ASYNC reports whose uploads take 1.5 s each: when the second report returned, and
    when the first upload ended."""
    times: dict[str, float] = {}
    storage = train.get_context().get_storage()

    def upload(checkpoint: train.Checkpoint, dir_name: str) -> train.Checkpoint:
        time.sleep(1.5)
        target = storage.build_checkpoint_path_from_name(dir_name)
        shutil.copytree(checkpoint.path, target)
        times.setdefault("first upload ended", time.monotonic())
        return train.Checkpoint(target)

    for step in range(2):
        d = tempfile.mkdtemp()
        Path(d, "model").write_text(str(step))
        train.report(
            {"step": step}, checkpoint=train.Checkpoint(d), checkpoint_upload_mode=ASYNC, checkpoint_upload_fn=upload
        )
    times["second report returned"] = time.monotonic()
    return times


def test_back_pressure_holds_a_report_until_an_upload_slot_is_free(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DDPTRAIN_MAX_PENDING_UPLOADS", "1")
    result = _fit(_slow_upload_loop, tmp_path)
    times = result.return_values[0]
    assert times["second report returned"] >= times["first upload ended"]
    assert result.checkpoint.path == str(tmp_path / "run" / "checkpoint_000002")


def test_uploads_run_in_order_and_a_full_queue_waits_saying_so(caplog) -> None:
    """The queue itself (the path the worker's reports take), with uploads the test releases."""
    uploads = CheckpointUploads(max_pending=2, warn_after_s=0.2)
    release, order, announced = threading.Event(), [], []

    def job(index: int) -> Any:
        def run() -> None:
            release.wait(10)
            order.append(index)

        return run

    for index in (1, 2):
        uploads.submit(index, lambda i=index: announced.append(i), job(index))  # returns at once: 2 slots
    assert announced == [1, 2] and uploads.pending == [1, 2]
    threading.Timer(0.6, release.set).start()
    with caplog.at_level(logging.WARNING, logger="ddptrain.storage.uploads"):
        uploads.submit(3, lambda: announced.append(3), job(3))  # waits for upload #1
    assert order[0] == 1 and announced == [1, 2, 3]
    assert "report #3 waits for the checkpoint upload(s) of report(s) [1, 2]" in caplog.text
    assert "DDPTRAIN_MAX_PENDING_UPLOADS" in caplog.text
    uploads.wait()
    assert order == [1, 2, 3] and uploads.pending == []


def test_a_failed_upload_drops_the_later_ones_and_is_raised() -> None:
    uploads = CheckpointUploads(max_pending=3)
    done: list[int] = []

    def fail() -> None:
        time.sleep(0.2)
        raise StorageError("the store said no")

    uploads.submit(1, lambda: None, fail)
    uploads.submit(2, lambda: None, lambda: done.append(2))
    with pytest.raises(StorageError, match="the store said no"):
        uploads.wait()
    assert done == []  # never committed before (or without) the one that failed
    with pytest.raises(StorageError):
        uploads.submit(3, lambda: None, lambda: None)


def test_bad_upload_arguments_are_refused(tmp_path: Path) -> None:
    def loop() -> None:
        d = tempfile.mkdtemp()
        ckpt = train.Checkpoint(d)
        with pytest.raises(ValueError, match="must be a CheckpointUploadMode"):
            train.report({}, checkpoint=ckpt, checkpoint_upload_mode="LATER")
        with pytest.raises(ValueError, match="pass one of them"):
            train.report({}, checkpoint=ckpt, checkpoint_upload_mode="NO_UPLOAD", checkpoint_upload_fn=lambda c, n: c)
        with pytest.raises(ValueError, match="needs a validation function"):
            train.report({}, checkpoint=ckpt, validation=True)
        shutil.rmtree(d)

    _fit(loop, tmp_path, workers=0)


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def _uploader() -> int:
    """The pid of this worker's upload process (a child running ddptrain.storage.upload_process)."""
    for child in _children(os.getpid()):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"ddptrain.storage.upload_process" in f.read():
                return child
    raise AssertionError(f"no upload process among the worker's children {_children(os.getpid())}")


def _report_async(step: int) -> None:
    d = tempfile.mkdtemp()
    Path(d, "model").write_text(str(step))
    train.report({"step": step}, checkpoint=train.Checkpoint(d), checkpoint_upload_mode=ASYNC)


def _uploader_loop(config: dict[str, Any]) -> dict[str, Any]:
    _report_async(0)
    train.get_all_reported_checkpoints()  # its upload is done: the uploader waits for the next
    pid = _uploader()
    return {"pid": pid, "nice": os.getpriority(os.PRIO_PROCESS, pid) - os.getpriority(os.PRIO_PROCESS, 0)}


def test_async_uploads_run_in_a_process_of_their_own_at_a_lower_cpu_priority(tmp_path: Path, monkeypatch) -> None:
    """The upload's CPU (hashing, the HTTP client) is not taken from the training process, and
    the uploader ends with the training function."""
    result = _fit(_uploader_loop, tmp_path)
    seen = result.return_values[0]
    assert seen["nice"] == 10
    assert not os.path.exists(f"/proc/{seen['pid']}"), "the uploader outlived the training function"
    assert result.checkpoint.path == str(tmp_path / "run" / "checkpoint_000001")
    monkeypatch.setenv("DDPTRAIN_UPLOAD_NICE", "0")
    assert _fit(_uploader_loop, tmp_path, name="run0").return_values[0]["nice"] == 0
    monkeypatch.setenv("DDPTRAIN_UPLOAD_NICE", "high")
    with pytest.raises(TrainingFailedError, match="`DDPTRAIN_UPLOAD_NICE` must be a whole number from 0 to 19"):
        _fit(_uploader_loop, tmp_path, name="bad")


def _uploader_killed_loop(config: dict[str, Any]) -> None:
    if train.get_checkpoint() is not None:
        return  # the restart resumes from the first checkpoint
    _report_async(0)
    train.get_all_reported_checkpoints()
    os.kill(_uploader(), signal.SIGKILL)
    _report_async(1)  # its upload finds the uploader gone
    train.get_all_reported_checkpoints()


def test_an_uploader_killed_fails_the_attempt_naming_it_and_the_restart_resumes(tmp_path: Path) -> None:
    with pytest.raises(TrainingFailedError) as info:
        _fit(_uploader_killed_loop, tmp_path)
    root = info.value.failures[0].exception
    assert isinstance(root, StorageError)
    assert "Uploading checkpoint 'checkpoint_000002' of report #2 failed: the worker's upload process" in str(root)
    assert "killed by SIGKILL" in str(root)
    assert not (tmp_path / "run" / "checkpoint_000002").exists()
    assert (tmp_path / "run" / "checkpoint_000001").exists()  # the whole one stays


def _worker_killed_mid_upload_loop(config: dict[str, Any]) -> None:
    _report_async(0)
    train.get_all_reported_checkpoints()
    pid = _uploader()
    os.kill(pid, signal.SIGSTOP)  # the next upload hangs
    _report_async(1)
    Path(config["pid_file"]).write_text(str(pid))
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_mid_upload_leaves_no_uploader_and_no_partial_checkpoint(tmp_path: Path) -> None:
    pid_file = tmp_path / "uploader.pid"
    with pytest.raises(TrainingFailedError):
        _fit(_worker_killed_mid_upload_loop, tmp_path, pid_file=str(pid_file))
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}"), "the uploader outlived its worker"
    assert (tmp_path / "run" / "checkpoint_000001").exists()
    assert not (tmp_path / "run" / "checkpoint_000002").exists()


def test_a_failed_async_upload_is_in_its_ranks_log(tmp_path: Path) -> None:
    # The run failed naming the store, but rank 0's own log said nothing of it: the worker was
    # killed (its upload's failure fails the group) before it logged the failure.
    with pytest.raises(TrainingFailedError) as info:
        _fit(_failing_upload_loop, tmp_path)
    log = Path(info.value.failures[0].log_path).read_text()
    assert "the checkpoint upload of report #1 failed: Uploading checkpoint 'checkpoint_000001'" in log, log
    assert "NotADirectoryError" in log, log
