"""Each ``RunStorage`` implementation without processes: the driver's side and a worker's side
(built from the ``StorageSpec`` the driver sends) in one test process.

Local storage works in a temporary folder; fsspec storage against fsspec's local file system
(a folder standing for the store: the driver's working copy is elsewhere); copy-back storage
with a fake file transfer that copies a folder standing for a host's staging folder.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest

import ddptrain as train
from ddptrain.errors import DiskFullError, LaunchError, StorageError
from ddptrain.storage import layout
from ddptrain.storage.base import RunStorage
from ddptrain.storage.copyback import CopyBackRunStorage
from ddptrain.storage.fsspec import FsspecRunStorage
from ddptrain.storage.local import LocalRunStorage
from ddptrain.storage.location import RunLocation
from ddptrain.storage.open import resume_checkpoint, run_storage, worker_storage
from ddptrain.storage.remote import RemoteRoot

NAME = "exp"


def _files(tmp_path: Path, tag: str, rank: int = 0) -> str:
    """A rank's checkpoint folder, as the training function writes it."""
    folder = tmp_path / "src" / f"{tag}_rank{rank}"
    folder.mkdir(parents=True)
    (folder / f"rank{rank}.txt").write_text(f"{tag} of rank {rank}")
    return str(folder)


def _local(tmp_path: Path, keep: int | None = None, over_hosts: bool = False) -> RunStorage:
    root = tmp_path / "runs"
    where = RunLocation(NAME, str(root), str(root / NAME), str(root / NAME), None)
    return run_storage(where, train.CheckpointConfig(num_to_keep=keep), over_hosts=over_hosts)


def _store(tmp_path: Path) -> RemoteRoot:
    fsspec = pytest.importorskip("fsspec")
    return RemoteRoot(fsspec.filesystem("file"), str(tmp_path / "bucket" / "prefix"), None)


def _fsspec(tmp_path: Path, keep: int | None = None, cache: str = "cache") -> FsspecRunStorage:
    remote = _store(tmp_path)
    where = RunLocation(NAME, remote.display(), str(tmp_path / cache / NAME), remote.path(NAME), remote)
    storage = run_storage(where, train.CheckpointConfig(num_to_keep=keep), over_hosts=False)
    assert isinstance(storage, FsspecRunStorage)
    return storage


def _open(storage: RunStorage) -> None:
    """What ``Run.opened`` does with a storage before the first attempt (the lock is left out)."""
    Path(storage.run_dir).mkdir(parents=True, exist_ok=True)
    storage.load_earlier()
    storage.save_status({"name": storage.name, "run_id": "r1", "status": "RUNNING"}, ended=False)
    storage.open_metrics()


def _report(storage: RunStorage, index: int, metrics: dict[str, Any]) -> None:
    line = {"time": 0.0, "attempt": 0, "metrics": metrics}
    storage.append_metrics([(line, json.dumps(line) + "\n")])


def _report_and_commit(storage: RunStorage, tmp_path: Path, index: int, metrics: dict[str, Any]) -> str:
    """One report of rank 0 with a checkpoint: staged on the worker's side, committed by the driver."""
    _report(storage, index, metrics)
    worker = worker_storage(storage.spec(storage.checkpoints.latest), storage.name)
    name = f"checkpoint_{index:06d}"
    staged = worker.stage(_files(tmp_path, name), name, 0, index, 0)
    committed = storage.commit([storage.collect(0, 0, index, staged, None)], name, metrics, index)
    return committed.path


# ----------------------------------------------------------------- which storage holds a run
def test_the_run_config_picks_the_storage(tmp_path: Path) -> None:
    assert type(_local(tmp_path)) is LocalRunStorage
    assert type(_local(tmp_path, over_hosts=True)) is CopyBackRunStorage  # a host list, a local folder
    assert type(_fsspec(tmp_path)) is FsspecRunStorage
    for storage in (_local(tmp_path), _local(tmp_path, over_hosts=True), _fsspec(tmp_path)):
        spec = storage.spec(None)
        assert spec.kind == storage.kind and spec.run_dir == storage.run_dir
        assert type(worker_storage(spec, NAME)) is type(storage)


# ----------------------------------------------------------------- local
def test_local_commit_and_retention(tmp_path: Path) -> None:
    storage = _local(tmp_path, keep=1)
    _open(storage)
    first = _report_and_commit(storage, tmp_path, 1, {"step": 1})
    assert Path(first, "rank0.txt").read_text() == "checkpoint_000001 of rank 0"
    second = _report_and_commit(storage, tmp_path, 2, {"step": 2})
    assert not Path(first).exists() and Path(second, "rank0.txt").is_file()  # num_to_keep=1
    index = json.loads(storage.layout.index.read_text())
    assert [c["dir_name"] for c in index["checkpoints"]] == ["checkpoint_000002"]
    assert not storage.layout.staging.exists()  # the staged files went into the checkpoint
    assert storage.name_problem("checkpoint_000002") is None  # replacing its own checkpoint
    (Path(storage.run_dir) / "notes").mkdir()
    assert "not a checkpoint of this run" in (storage.name_problem("notes") or "")
    assert "plain folder name" in (storage.name_problem("../x") or "")


def test_local_resume_picks_up_checkpoints_and_metrics(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = _local(tmp_path)
    _open(storage)
    _report(storage, 1, {"step": 1})
    latest = _report_and_commit(storage, tmp_path, 2, {"step": 2})
    storage.close_metrics()

    again = _local(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ddptrain"), again.lock():
        earlier = again.load_earlier()
    assert earlier.metrics == [{"step": 1}, {"step": 2}] and earlier.last_attempt == 0
    assert again.checkpoints.latest is not None and again.checkpoints.latest.path == latest
    assert f"resuming run {NAME!r} from checkpoint {latest}" in caplog.text
    assert resume_checkpoint(again.spec(again.checkpoints.latest)) == again.checkpoints.latest


def test_local_commit_cut_short_by_a_crash_is_not_listed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = _local(tmp_path)
    _open(storage)
    kept = _report_and_commit(storage, tmp_path, 1, {"step": 1})
    # The driver dies in the middle of the next commit: merged into a hidden folder, the
    # intent written, the rename (the commit point) never done.
    staged = layout.stage_files(storage.run_dir, _files(tmp_path, "next"), 0, 2, 0)
    building = layout.build_checkpoint(storage.run_dir, [staged], "checkpoint_000002")
    entry = {"dir_name": "checkpoint_000002", "metrics": {"step": 2}, "report_index": 2}
    layout.write_json_atomic(storage.layout.intent, {"entry": entry, "building": building.name, "delete": []})

    again = _local(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ddptrain"), again.lock():
        again.load_earlier()
    assert again.checkpoints.latest is not None and again.checkpoints.latest.path == kept
    assert [c.path for c, _ in again.checkpoints.reported_checkpoints()] == [kept]
    assert sorted(p.name for p in Path(storage.run_dir).iterdir() if p.name.startswith(".checkpoint")) == []
    assert not Path(storage.run_dir, "checkpoint_000002").exists()
    assert "discarded checkpoint 'checkpoint_000002' of report #2" in caplog.text


def test_local_full_disk_names_the_metrics_file(tmp_path: Path) -> None:
    storage = _local(tmp_path)
    _open(storage)

    class FullFile:
        def write(self, text: str) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self) -> None:
            pass

    storage._metrics_file = FullFile()  # type: ignore[assignment]
    with pytest.raises(DiskFullError) as caught:
        _report(storage, 1, {"step": 1})
    assert caught.value.path == str(storage.layout.metrics) and "metrics.jsonl" in str(caught.value)


def test_local_full_disk_while_staging_names_the_folder_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = _local(tmp_path)
    _open(storage)

    def full(src: str, dst: str, **kwargs: Any) -> None:
        Path(dst).mkdir(parents=True)
        raise OSError(errno.ENOSPC, "No space left on device", dst)

    monkeypatch.setattr(shutil, "copytree", full)
    with pytest.raises(DiskFullError) as caught:
        storage.stage(_files(tmp_path, "c"), "checkpoint_000001", 0, 1, 0)
    assert caught.value.path == str(storage.layout.staged(0, 1, 0))
    assert list(storage.layout.staged(0, 1, 0).parent.iterdir()) == []  # the partial copy is gone


# ----------------------------------------------------------------- fsspec
def test_fsspec_commit_retention_and_upload(tmp_path: Path) -> None:
    storage = _fsspec(tmp_path, keep=1)
    _open(storage)
    store = Path(storage.remote.path(NAME))
    assert json.loads((store / "run.json").read_text())["status"] == "RUNNING"  # uploaded at once
    first = _report_and_commit(storage, tmp_path, 1, {"step": 1})
    assert first == storage.remote.path(NAME, "checkpoint_000001")  # a path on the store
    assert (store / "checkpoint_000001" / "rank0.txt").read_text() == "checkpoint_000001 of rank 0"
    second = _report_and_commit(storage, tmp_path, 2, {"step": 2})
    assert not (store / "checkpoint_000001").exists() and Path(second, "rank0.txt").is_file()
    index = json.loads((store / "checkpoints.json").read_text())  # the commit point is its upload
    assert [c["dir_name"] for c in index["checkpoints"]] == ["checkpoint_000002"]
    assert not Path(storage.run_dir, "checkpoint_000002").exists()  # checkpoints live on the store only
    assert storage.checkpoints.latest is not None and storage.checkpoints.latest.filesystem is not None

    storage.reported(storage.checkpoints.latest)  # a report round with a checkpoint: metrics go at once
    lines = (store / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["metrics"] for line in lines] == [{"step": 1}, {"step": 2}]
    storage.close_metrics()
    storage.save_status({"name": NAME, "run_id": "r1", "status": "FINISHED"}, ended=True)
    assert json.loads((store / "run.json").read_text())["status"] == "RUNNING"  # the final one waits ...
    assert storage.close(failed=False) is True
    assert json.loads((store / "run.json").read_text())["status"] == "FINISHED"  # ... for close()


def test_fsspec_resume_picks_up_the_store_and_drops_an_unlisted_upload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = _fsspec(tmp_path)
    _open(storage)
    _report(storage, 1, {"step": 1})
    latest = _report_and_commit(storage, tmp_path, 2, {"step": 2})
    storage.close_metrics()
    assert storage.close(failed=False)
    # A worker uploaded the next checkpoint, and the driver died before listing it.
    worker = worker_storage(storage.spec(storage.checkpoints.latest), NAME)
    orphan = worker.stage(_files(tmp_path, "orphan"), "checkpoint_000003", 0, 3, 0)
    assert Path(orphan).is_dir()

    again = _fsspec(tmp_path, cache="elsewhere")  # another machine: nothing cached there
    with caplog.at_level(logging.WARNING, logger="ddptrain"), again.lock():
        earlier = again.load_earlier()
    assert earlier.metrics == [{"step": 1}, {"step": 2}]
    assert again.checkpoints.latest is not None and again.checkpoints.latest.path == latest
    assert not Path(orphan).exists()
    assert "a checkpoint upload that was never committed" in caplog.text
    resumed = resume_checkpoint(again.spec(again.checkpoints.latest))
    assert resumed is not None and resumed.path == latest and resumed.filesystem is not None


def test_fsspec_upload_failure_names_the_checkpoint_and_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = _fsspec(tmp_path)
    _open(storage)
    worker = worker_storage(storage.spec(None), NAME)
    assert isinstance(worker, FsspecRunStorage)

    def refused(local: str, remote: str, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, "Access Denied", remote)

    monkeypatch.setattr(worker.remote.fs, "put_file", refused)  # fsspec caches the instance: put back after
    with pytest.raises(StorageError, match=r"Uploading checkpoint 'ck' of report #4 to .*bucket/prefix/exp"):
        worker.stage(_files(tmp_path, "ck"), "ck", 0, 4, 0)


# ----------------------------------------------------------------- copy-back
class FakeTransfer:
    """Copies the folders of "hosts" (local folders standing for their staging folders)."""

    def __init__(self, unshared: Collection[int], error: BaseException | None = None) -> None:
        self.unshared_ranks = set(unshared)
        self.error = error
        self.fetched: list[tuple[int, str, str]] = []

    def fetch_dir(self, rank: int, remote: str, local: str) -> None:
        if self.error is not None:
            raise self.error
        self.fetched.append((rank, remote, local))
        shutil.copytree(remote, local)
        shutil.rmtree(remote)


def _host_side(storage: RunStorage, host_cache: Path) -> RunStorage:
    """A worker's storage on a host that cannot see the run directory (as the launcher marks it)."""
    spec = dataclasses.replace(storage.spec(None), local_cache=str(host_cache))
    return worker_storage(spec, NAME)


def test_copy_back_fetches_the_files_of_hosts_that_cannot_see_the_run_dir(tmp_path: Path) -> None:
    storage = _local(tmp_path, keep=1, over_hosts=True)
    _open(storage)
    host = tmp_path / "host1-staging"
    on_driver = worker_storage(storage.spec(None), NAME).stage(_files(tmp_path, "a", 0), "c1", 0, 1, 0)
    on_host = _host_side(storage, host).stage(_files(tmp_path, "a", 1), "c1", 0, 1, 1)
    assert Path(on_host).is_relative_to(host) and Path(on_driver).is_relative_to(storage.run_dir)

    transfer = FakeTransfer(unshared={1})
    staged = [storage.collect(r, 0, 1, folder, transfer) for r, folder in ((0, on_driver), (1, on_host))]
    assert [rank for rank, _, _ in transfer.fetched] == [1]  # rank 0's host sees the run directory
    assert staged[1] == str(storage.layout.fetched(0, 1, 1)) and not Path(on_host).exists()
    checkpoint = storage.commit(staged, "c1", {"step": 1}, 1)
    assert sorted(p.name for p in Path(checkpoint.path).iterdir()) == ["rank0.txt", "rank1.txt"]
    assert not storage.layout.staging.exists()

    storage.commit([_host_fetch(storage, tmp_path, transfer, host)], "c2", {"step": 2}, 2)
    assert not Path(checkpoint.path).exists()  # retention works on what was copied back too
    assert storage.checkpoints.latest is not None and storage.checkpoints.latest.path.endswith("c2")


def _host_fetch(storage: RunStorage, tmp_path: Path, transfer: FakeTransfer, host: Path) -> str:
    staged = _host_side(storage, host).stage(_files(tmp_path, "b", 1), "c2", 0, 2, 1)
    return storage.collect(1, 0, 2, staged, transfer)


def test_copy_back_errors_name_the_host_or_the_full_disk(tmp_path: Path) -> None:
    storage = _local(tmp_path, over_hosts=True)
    _open(storage)
    staged = _host_side(storage, tmp_path / "host1").stage(_files(tmp_path, "a", 1), "c1", 0, 1, 1)
    lost = LaunchError("host 'h1': copying it back failed", hosts=["h1"])
    with pytest.raises(LaunchError, match="host 'h1'"):
        storage.collect(1, 0, 1, staged, FakeTransfer({1}, lost))
    full = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(DiskFullError) as caught:
        storage.collect(1, 0, 1, staged, FakeTransfer({1}, full))
    assert caught.value.path == str(storage.layout.fetched(0, 1, 1))


def test_copy_back_resume_is_a_local_resume(tmp_path: Path) -> None:
    storage = _local(tmp_path, over_hosts=True)
    _open(storage)
    latest = _report_and_commit(storage, tmp_path, 1, {"step": 1})
    storage.close_metrics()
    again = _local(tmp_path, over_hosts=True)
    with again.lock():
        earlier = again.load_earlier()
    assert earlier.metrics == [{"step": 1}]
    assert again.checkpoints.latest is not None and again.checkpoints.latest.path == latest
    assert again.spec(again.checkpoints.latest).checkpoint == latest  # what the launcher pushes to hosts
