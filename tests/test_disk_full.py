"""A full disk under the run directory: fit() fails within seconds naming the file and the free
space, nothing hangs or is left running, and the run resumes once space is freed.

The file system is a small real tmpfs, so these tests need root (they skip otherwise). Each
``fit()`` that meets the full disk runs in a child process with a deadline: a hang fails the test.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from forked_driver import ForkedDriver

import ddptrain as train
from ddptrain.config import CheckpointConfig
from ddptrain.errors import DiskFullError
from ddptrain.storage import layout as storage
from ddptrain.storage.checkpoint_manager import CheckpointManager
from ddptrain.storage.open import worker_storage
from ddptrain.storage.upload_process import UploadProcess
from ddptrain.wire.protocol import StorageSpec

_TESTS = os.path.dirname(os.path.abspath(__file__))
_HANG_S = 90  # a child fit() still running after this hung


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(path: Path, leave: int) -> None:
    """Write a filler file that leaves about ``leave`` bytes free on its file system."""
    size = max(0, storage_free(path.parent) - leave)
    with open(path, "wb") as f:
        f.write(b"\0" * size)
    assert abs(storage_free(path.parent) - leave) <= 8192  # tmpfs counts whole pages


def storage_free(path: Path) -> int:
    import shutil

    return shutil.disk_usage(path).free


def _write_state(step: int, size: int = 100) -> train.Checkpoint:
    folder = tempfile.mkdtemp(prefix="disk-full-ckpt-")
    Path(folder, "state.json").write_text(json.dumps({"step": step}))
    Path(folder, "weights.bin").write_bytes(os.urandom(size))
    return train.Checkpoint.from_directory(folder)


def _resumed_step() -> int | None:
    checkpoint = train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        step: int = json.loads(Path(folder, "state.json").read_text())["step"]
    train.report({"resumed_from": step})
    return step


def chatty_loop(config: dict) -> int:
    """Commits a checkpoint, then prints and reports until the disk is full."""
    step = _resumed_step()
    if step is not None:
        return step
    train.report({"step": 1}, checkpoint=_write_state(1))
    line = "x" * 1000
    for i in range(200_000):  # bounded: 200 MB of output per rank
        print(f"{i} {line}", flush=True)
        if i % 100 == 0:
            train.report({"step": 1, "line": i})
    return -1


def metrics_loop(config: dict) -> int:
    """Commits a checkpoint, then reports big metrics (and prints nothing) until the disk is full."""
    step = _resumed_step()
    if step is not None:
        return step
    train.report({"step": 1}, checkpoint=_write_state(1))
    blob = "m" * 20_000
    for i in range(20_000):  # bounded: 400 MB of metrics
        train.report({"step": 1, "report": i, "blob": blob})
    return -1


def big_checkpoint_loop(config: dict) -> int:
    """Commits a small checkpoint, then one too big for the disk."""
    step = _resumed_step()
    if step is not None:
        return step
    train.report({"step": 1}, checkpoint=_write_state(1))
    train.report({"step": 2}, checkpoint=_write_state(2, size=config["size"]))
    return 2


def _uploader() -> int:
    """The pid of this worker's upload process (its child running ddptrain.storage.upload_process)."""
    me = os.getpid()
    for task in os.listdir(f"/proc/{me}/task"):
        for child in Path(f"/proc/{me}/task/{task}/children").read_text().split():
            if b"ddptrain.storage.upload_process" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError("the worker has no upload process")


def async_big_checkpoint_loop(config: dict) -> int:
    """Reports checkpoints of ``config["sizes"]`` bytes with ``CheckpointUploadMode.ASYNC``: the
    first one uploaded, then the others queued at once behind the second (its upload process is
    stopped while they are reported). Writes its and its uploader's pids to ``config["pids"]``."""
    step = _resumed_step()
    if step is not None:
        return step
    async_ = train.CheckpointUploadMode.ASYNC
    train.report({"step": 1}, checkpoint=_write_state(1, config["sizes"][0]), checkpoint_upload_mode=async_)
    train.get_all_reported_checkpoints()  # its upload is done: the upload process waits for the next
    uploader = _uploader()
    if "pids" in config:
        tag = f"DDPTRAIN_TEST_TAG={os.environ['DDPTRAIN_TEST_TAG']}".encode()  # what conftest finds leftovers by
        tagged = tag in Path(f"/proc/{uploader}/environ").read_bytes().split(b"\0")
        rank = train.get_context().get_world_rank()
        seen = {"worker": os.getpid(), "uploader": uploader, "tagged": tagged}
        Path(config["pids"], f"rank_{rank}.json").write_text(json.dumps(seen))
    os.kill(uploader, signal.SIGSTOP)  # the next upload waits until every later report is queued
    try:
        for step, size in enumerate(config["sizes"][1:], start=2):
            train.report({"step": step}, checkpoint=_write_state(step, size), checkpoint_upload_mode=async_)
    finally:
        os.kill(uploader, signal.SIGCONT)
    return len(config["sizes"])


_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, sys.argv[1])
    import ddptrain as train
    import test_disk_full
    from ddptrain.torch import TorchTrainer

    args = json.loads(sys.argv[2])
    os.environ.update(args["env"])
    trainer = TorchTrainer(
        getattr(test_disk_full, args["loop"]),
        train_loop_config=args["config"],
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(
            name="full", storage_path=args["storage"], failure_config=train.FailureConfig(max_failures=3)
        ),
    )
    start = time.monotonic()
    try:
        result = trainer.fit()
        out = {"ok": True, "return_value": result.return_value, "checkpoint": result.checkpoint.path}
    except Exception as exc:
        out = {"ok": False, "type": type(exc).__name__, "message": str(exc),
               "cause": type(exc.__cause__).__name__, "path": getattr(exc.__cause__, "path", None)}
    out["elapsed_s"] = time.monotonic() - start
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def _fit_in_child(storage_path: Path, loop: str, config: dict | None = None, env: dict | None = None) -> dict:
    """Run fit() in a child process (``env`` added to its environment); fails the test if it is
    still running after _HANG_S."""
    args = json.dumps({"storage": str(storage_path), "loop": loop, "config": config or {}, "env": env or {}})
    fd, script = tempfile.mkstemp(prefix="disk-full-driver-", suffix=".py")  # not on the small disk
    try:
        with os.fdopen(fd, "w") as f:
            f.write(_CHILD)
        proc = ForkedDriver(script, [_TESTS, args])  # forked from this process: no torch import of its own
        try:
            out, err = proc.communicate(timeout=_HANG_S)
        except subprocess.TimeoutExpired:
            proc.kill()  # its agents and workers see their driver die
            proc.communicate()
            pytest.fail(f"fit() hung on a full disk (still running after {_HANG_S} s)")
    finally:
        os.unlink(script)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the child printed no result (exit code {proc.returncode}):\n{err[-3000:]}"
    result: dict = json.loads(lines[-1][len("RESULT ") :])
    return result


def _assert_clear_disk_error(failed: dict, disk: Path) -> None:
    assert not failed["ok"], failed
    assert failed["type"] in ("ControllerError", "WorkerGroupError"), failed
    assert failed["cause"] == "DiskFullError", failed
    assert failed["path"].startswith(str(disk)), failed
    assert f"free of {2.0:.1f} MiB" in failed["message"], failed["message"]
    assert "same RunConfig(name=...)" in failed["message"], failed["message"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("loop", "full_file"), [("chatty_loop", "rank_*.log"), ("metrics_loop", "metrics.jsonl")])
def test_output_that_fills_the_disk_fails_fit_fast_and_the_run_resumes(
    small_disk: Path, loop: str, full_file: str
) -> None:
    filler = small_disk / "filler"
    _fill(filler, leave=512 * 1024)
    failed = _fit_in_child(small_disk, loop)
    _assert_clear_disk_error(failed, small_disk)
    assert Path(failed["path"]).match(full_file), failed["path"]
    assert failed["elapsed_s"] < 40, failed  # 31 s seen on a loaded machine; the fault is a hang
    print(f"fit() failed on the full disk after {failed['elapsed_s']:.1f} s: {failed['message'].splitlines()[0]}")

    filler.unlink()  # space is back: the same run resumes from its committed checkpoint
    resumed = _fit_in_child(small_disk, loop)
    assert resumed["ok"], resumed
    assert resumed["return_value"] == 1
    assert os.path.basename(resumed["checkpoint"]) == "checkpoint_000001"


@pytest.mark.timeout(300)
def test_checkpoint_that_fills_the_disk_fails_without_restarts_and_the_run_resumes(small_disk: Path) -> None:
    filler = small_disk / "filler"
    _fill(filler, leave=600 * 1024)
    failed = _fit_in_child(small_disk, "big_checkpoint_loop", {"size": 512 * 1024})
    _assert_clear_disk_error(failed, small_disk)
    assert failed["type"] == "WorkerGroupError"  # staged by a worker
    assert "not restarted" in failed["message"]
    assert failed["elapsed_s"] < 40, failed  # 31 s seen on a loaded machine; the fault is a hang
    run_dir = small_disk / "full"
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["attempt_0"]  # despite max_failures=3
    print(f"fit() failed on the full disk after {failed['elapsed_s']:.1f} s: {failed['message'].splitlines()[1]}")

    filler.unlink()
    resumed = _fit_in_child(small_disk, "big_checkpoint_loop", {"size": 512 * 1024})
    assert resumed["ok"], resumed
    assert resumed["return_value"] == 1
    staging = run_dir / storage.RunLayout.STAGING
    assert not staging.exists() or not any(staging.iterdir())


def _committed(run_dir: Path) -> tuple[list[str], list[str], str | None]:
    """The run's checkpoint folders on disk (hidden ones too: a partial one is a fault), those
    its index lists, and its latest."""
    own = storage.RunLayout.RESERVED | {storage.RunLayout.STAGING}
    on_disk = sorted(p.name for p in run_dir.iterdir() if p.is_dir() and p.name not in own)
    index = json.loads((run_dir / storage.RunLayout.INDEX).read_text())
    return on_disk, sorted(entry["dir_name"] for entry in index["checkpoints"]), index["latest"]


@pytest.mark.timeout(300)
def test_async_checkpoint_that_fills_the_disk_fails_without_restarts_and_the_run_resumes(small_disk: Path) -> None:
    filler = small_disk / "filler"
    _fill(filler, leave=600 * 1024)
    config = {"sizes": [100, 512 * 1024]}
    failed = _fit_in_child(small_disk, "async_big_checkpoint_loop", config)
    _assert_clear_disk_error(failed, small_disk)  # as with SYNC: same type, path and text
    assert failed["type"] == "WorkerGroupError"  # staged by a worker's upload process
    assert "not restarted" in failed["message"]
    assert failed["elapsed_s"] < 40, failed  # the fault is a hang
    run_dir = small_disk / "full"
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["attempt_0"]  # despite max_failures=3
    assert _committed(run_dir) == (["checkpoint_000001"], ["checkpoint_000001"], "checkpoint_000001")  # no partial one
    print(f"fit() failed on the full disk after {failed['elapsed_s']:.1f} s: {failed['message'].splitlines()[1]}")

    filler.unlink()
    resumed = _fit_in_child(small_disk, "async_big_checkpoint_loop", config)
    assert resumed["ok"], resumed
    assert resumed["return_value"] == 1  # from the last whole checkpoint
    assert os.path.basename(resumed["checkpoint"]) == "checkpoint_000001"
    staging = run_dir / storage.RunLayout.STAGING
    assert not staging.exists() or not any(staging.iterdir())


@pytest.mark.timeout(300)
def test_full_disk_with_async_uploads_queued_commits_nothing_after_it_and_leaves_no_process(
    small_disk: Path, tmp_path: Path
) -> None:
    filler = small_disk / "filler"
    _fill(filler, leave=600 * 1024)
    pids = tmp_path / "pids"
    pids.mkdir()
    # Reports 3 and 4 are queued behind the one that fills the disk, and fit in the space it gives back.
    config = {"sizes": [100, 512 * 1024, 100, 100], "pids": str(pids)}
    env = {"DDPTRAIN_MAX_PENDING_UPLOADS": "4"}
    failed = _fit_in_child(small_disk, "async_big_checkpoint_loop", config, env)
    _assert_clear_disk_error(failed, small_disk)
    assert "not restarted" in failed["message"]
    assert failed["elapsed_s"] < 40, failed  # the fault is a hang
    run_dir = small_disk / "full"
    assert _committed(run_dir) == (["checkpoint_000001"], ["checkpoint_000001"], "checkpoint_000001")
    lines = (run_dir / storage.RunLayout.METRICS).read_text().splitlines()
    steps = [json.loads(line)["metrics"]["step"] for line in lines]
    assert steps == [1, 2, 3, 4][: len(steps)] and steps, steps  # each report persisted, in order

    # The workers and their upload processes are gone (and conftest's leftover check sees them: tagged).
    seen = [json.loads(f.read_text()) for f in sorted(pids.iterdir())]
    assert len(seen) == 2 and all(s["tagged"] for s in seen), seen
    left = [pid for s in seen for pid in (s["worker"], s["uploader"])]
    deadline = time.monotonic() + 10
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if os.path.exists(f"/proc/{pid}")]
    assert not left, f"processes outlived the failed fit(): {left}"

    filler.unlink()
    resumed = _fit_in_child(small_disk, "async_big_checkpoint_loop", config, env)
    assert resumed["ok"], resumed
    assert resumed["return_value"] == 1
    assert os.path.basename(resumed["checkpoint"]) == "checkpoint_000001"
    staging = run_dir / storage.RunLayout.STAGING
    assert not staging.exists() or not any(staging.iterdir())


def test_full_disk_while_writing_the_index_keeps_the_run_resumable(small_disk: Path, tmp_path: Path) -> None:
    run_dir = small_disk / "run"
    run_dir.mkdir()
    manager = CheckpointManager(str(run_dir), CheckpointConfig())
    source = tmp_path / "src"
    source.mkdir()
    (source / "state.json").write_text('{"step": 1}')
    manager.commit([storage.stage_files(str(run_dir), str(source), 0, 1, 0)], "checkpoint_000001", {"step": 1}, 1)
    index_before = (run_dir / storage.RunLayout.INDEX).read_text()
    (source / "state.json").write_text('{"step": 2}')
    staged = storage.stage_files(str(run_dir), str(source), 0, 2, 0)

    filler = small_disk / "filler"
    _fill(filler, leave=0)  # every last page
    with pytest.raises(DiskFullError) as info:
        manager.commit([staged], "checkpoint_000002", {"step": 2}, 2)
    assert info.value.path.startswith(str(run_dir))
    assert info.value.free_bytes is not None and info.value.free_bytes < 8192
    assert "No space left on device" in str(info.value) and str(run_dir) in str(info.value)

    filler.unlink()
    assert (run_dir / storage.RunLayout.INDEX).read_text() == index_before
    resumed = CheckpointManager(str(run_dir), CheckpointConfig())
    resumed.recover()
    assert resumed.latest is not None and os.path.basename(resumed.latest.path) == "checkpoint_000001"
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint_000001", storage.RunLayout.INDEX]


def test_upload_process_raises_a_full_disk_as_staging_in_the_worker_does(small_disk: Path, tmp_path: Path) -> None:
    """An ``ASYNC`` upload's full disk crosses the upload process's pipe as the ``DiskFullError``
    (same text, path and space) that a ``SYNC`` report's staging raises."""
    run_dir = small_disk / "run"
    run_dir.mkdir()
    spec = StorageSpec(kind="local", storage_path=str(small_disk), run_dir=str(run_dir))
    source = tmp_path / "src"
    source.mkdir()
    (source / "weights.bin").write_bytes(os.urandom(512 * 1024))
    _fill(small_disk / "filler", leave=256 * 1024)
    with pytest.raises(DiskFullError) as sync:
        worker_storage(spec, "run").stage(str(source), "checkpoint_000001", 0, 1, 0)
    uploader = UploadProcess(spec, "run")
    try:
        with pytest.raises(DiskFullError) as async_:
            uploader.stage(str(source), "checkpoint_000001", 0, 1, 0)
    finally:
        uploader.close()
    assert str(async_.value) == str(sync.value)
    assert async_.value.errno == errno.ENOSPC and async_.value.path == str(run_dir / ".staging" / "a0_r1" / "rank_0")
    assert (async_.value.free_bytes, async_.value.total_bytes) == (sync.value.free_bytes, sync.value.total_bytes)
    assert not any((run_dir / storage.RunLayout.STAGING).rglob("*.bin"))  # nothing staged is left
    assert (source / "weights.bin").stat().st_size == 512 * 1024  # the worker's folder is untouched


def test_disk_full_error_survives_pickling_and_names_path_and_space(tmp_path: Path) -> None:
    import pickle

    error = DiskFullError(str(tmp_path / "x"), 1536, 2 << 20)
    again = pickle.loads(pickle.dumps(error))
    assert isinstance(again, OSError) and again.errno == error.errno
    assert (again.path, again.free_bytes, again.total_bytes) == (error.path, 1536, 2 << 20)
    assert str(again) == str(error)
    assert str(tmp_path / "x") in str(error) and "1.5 KiB free of 2.0 MiB" in str(error)
