"""Runs on remote storage (``s3://``), against a real S3 server: moto's standalone server,
started on a local port, behind a TCP proxy the tests can cut to take the store away."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from forked_driver import ForkedDriver

import ddptrain as train
from ddptrain.errors import ConfigError, StorageError, WorkerGroupError
from ddptrain.storage.checkpoint_manager import RunDirectoryError
from ddptrain.torch import TorchTrainer

pytestmark = pytest.mark.slow
s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proxy:
    """A TCP forwarder to the S3 server that can be cut (the store goes away), stalled (it
    accepts connections and never answers), and restored."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = _free_port()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.stalled = False
        self.restore()

    def stall(self) -> None:
        """From now on nothing gets an answer: bytes sent either way are dropped, and new
        connections are accepted and left alone."""
        self.stalled = True

    def restore(self) -> None:
        if self.stalled:
            self.stalled = False
            self.cut()  # the connections that saw no answer go
        if self._listener is not None and self._listener.fileno() != -1:
            return  # not cut
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self.stalled:
                with self._lock:
                    self._conns.append(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                if not self.stalled:
                    b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        assert self._listener is not None
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept(): the port is free at once
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class S3:
    def __init__(self, proxy: Proxy, server_port: int) -> None:
        self.proxy = proxy
        self.endpoint = f"http://127.0.0.1:{proxy.port}"
        # A client that talks to the server directly: it still sees the store while the proxy is cut.
        self.direct = s3fs.S3FileSystem(
            key="testing", secret="testing", client_kwargs={"endpoint_url": f"http://127.0.0.1:{server_port}"}
        )

    def bucket(self) -> str:
        name = f"b{uuid.uuid4().hex[:12]}"
        self.direct.mkdir(name)
        return name

    def listing(self, prefix: str) -> list[str]:
        self.direct.invalidate_cache()
        return sorted(p[len(prefix) + 1 :] for p in self.direct.find(prefix))

    def index(self, run: str) -> dict[str, Any]:
        self.direct.invalidate_cache()
        return json.loads(self.direct.cat_file(f"{run}/checkpoints.json"))


@pytest.fixture(scope="module")
def _s3_server() -> Iterator[tuple[Proxy, int]]:
    port = _free_port()
    # Untagged: it outlives single tests on purpose (the leak check looks for the tag).
    env = {k: v for k, v in os.environ.items() if k != "DDPTRAIN_TEST_TAG"}
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.1)
        proxy = Proxy(port)
        yield proxy, port
        proxy.cut()
    finally:
        server.kill()
        server.wait()


@pytest.fixture
def s3(_s3_server: tuple[Proxy, int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[S3]:
    proxy, port = _s3_server
    env = S3(proxy, port)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", env.endpoint)
    monkeypatch.setenv("DDPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    s3fs.S3FileSystem.clear_instance_cache()
    yield env
    s3fs.S3FileSystem.clear_instance_cache()


def _loop(config: dict[str, Any]) -> None:
    """Reports `epochs` epochs with a checkpoint each; resumes from get_checkpoint(); rank 1
    kills itself once at `crash_at` (a marker file says it did)."""
    rank = train.get_context().get_world_rank()
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            start = int(Path(d, "epoch").read_text()) + 1
    for epoch in range(start, config["epochs"]):
        marker = config.get("marker")
        if rank == 1 and epoch == config.get("crash_at") and marker and not os.path.exists(marker):
            Path(marker).touch()
            if config.get("mode") == "ASYNC":
                train.get_all_reported_checkpoints()  # this rank's uploads so far are committed
            os.kill(os.getpid(), signal.SIGKILL)
        d = tempfile.mkdtemp()  # ASYNC deletes it once uploaded
        if rank == 0:
            Path(d, "epoch").write_text(str(epoch))
        Path(d, f"shard_{rank}.bin").write_bytes(os.urandom(1000))
        score = [0.5, 0.9, 0.1, 0.7, 0.3, 0.8][epoch % 6]
        mode = config.get("mode", "SYNC")
        train.report(
            {"epoch": epoch, "score": score, "resumed_from": start},
            checkpoint=train.Checkpoint.from_directory(d),
            checkpoint_dir_name=config.get("dir_name"),
            checkpoint_upload_mode=mode,
        )
        if mode == "SYNC":
            shutil.rmtree(d)
        time.sleep(config.get("sleep", 0))


def _trainer(storage_path: str, name: str, **config: Any) -> TorchTrainer:
    failure = train.FailureConfig(max_failures=config.pop("max_failures", 0))
    callbacks = config.pop("callbacks", None)
    return TorchTrainer(
        _loop,
        train_loop_config={"epochs": 4, **config},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(
            name=name,
            storage_path=storage_path,
            failure_config=failure,
            checkpoint_config=train.CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score"),
            callbacks=callbacks,
        ),
    )


def _complete(s3: S3, checkpoint_path: str) -> bool:
    files = set(s3.listing(checkpoint_path))
    return {"epoch", "shard_0.bin", "shard_1.bin"} <= files


def test_fit_retention_resume_by_name_and_result_from_path(s3: S3) -> None:
    bucket = s3.bucket()
    result = _trainer(f"s3://{bucket}/exp", "run").fit()
    run = f"{bucket}/exp/run"
    assert result.path == f"s3://{run}"
    assert result.checkpoint is not None and result.checkpoint.path == f"s3://{run}/checkpoint_000004"
    assert [m["epoch"] for m in result.metrics_history] == [0, 1, 2, 3]
    # Retention deleted remotely: the 2 best by score (epochs 1 and 3) plus the latest (epoch 3).
    listing = s3.listing(run)
    assert sorted({p.split("/")[0] for p in listing if p.startswith("checkpoint_")}) == [
        "checkpoint_000002",
        "checkpoint_000004",
    ]
    assert {"run.json", "metrics.jsonl", "checkpoints.json", "logs/attempt_0/rank_0.log"} <= set(listing)
    assert all(_complete(s3, f"{run}/{c}") for c in ("checkpoint_000002", "checkpoint_000004"))
    with result.checkpoint.as_directory() as d:
        assert Path(d, "epoch").read_text() == "3"
    assert json.loads(s3.direct.cat_file(f"{run}/run.json"))["status"] == "FINISHED"

    again = train.Result.from_path(f"s3://{run}")
    assert again.metrics_history == result.metrics_history
    assert again.checkpoint == result.checkpoint
    assert [c.path for c, _ in again.best_checkpoints] == [c.path for c, _ in result.best_checkpoints]
    assert again.get_best_checkpoint("score", "max").path.endswith("checkpoint_000002")
    local = again.checkpoint.to_directory()
    assert sorted(os.listdir(local)) == ["epoch", "shard_0.bin", "shard_1.bin"]

    # Resume by name, from another machine's point of view: the local working copy is gone.

    shutil.rmtree(os.environ["DDPTRAIN_CACHE_DIR"])
    more = _trainer(f"s3://{bucket}/exp", "run", epochs=6).fit()
    assert [m["epoch"] for m in more.metrics_history] == [0, 1, 2, 3, 4, 5]
    assert more.metrics["resumed_from"] == 4
    assert more.checkpoint.path == f"s3://{run}/checkpoint_000006"


def test_validation_of_checkpoints_on_remote_storage(s3: S3) -> None:
    # Defined in here: pickled by value, so each validation process does not import this module
    # (torch, the S3 test server's helpers: ~4 s of CPU each).
    def validate_remote(checkpoint: train.Checkpoint) -> dict[str, Any]:
        with checkpoint.as_directory() as d:  # downloaded from the store
            epoch = int(Path(d, "epoch").read_text())
        return {"val": [0.5, 0.9, 0.1][epoch]}

    def loop() -> None:
        for epoch in range(3):
            d = tempfile.mkdtemp()
            Path(d, "epoch").write_text(str(epoch))
            checkpoint = train.Checkpoint(d)
            train.report({"epoch": epoch}, checkpoint=checkpoint, checkpoint_upload_mode="ASYNC", validation=True)

    bucket = s3.bucket()
    result = train.DataParallelTrainer(
        loop,
        validation_config=train.ValidationConfig(validate_remote),
        run_config=train.RunConfig(
            name="val",
            storage_path=f"s3://{bucket}/exp",
            checkpoint_config=train.CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="val"),
        ),
    ).fit()
    run = f"{bucket}/exp/val"
    # Ranked by the validated metric on the store's index: the best (0.9) and the latest are kept.
    assert [(c.path, m["val"]) for c, m in result.best_checkpoints] == [(f"s3://{run}/checkpoint_000002", 0.9)]
    listing = s3.listing(run)
    assert sorted({p.split("/")[0] for p in listing if p.startswith("checkpoint_0")}) == [
        "checkpoint_000002",
        "checkpoint_000003",
    ]
    index = json.loads(s3.direct.cat_file(f"{run}/checkpoints.json"))
    assert {(c["dir_name"], c["status"], c["metrics"]["val"]) for c in index["checkpoints"]} == {
        ("checkpoint_000002", "VALIDATED", 0.9),
        ("checkpoint_000003", "VALIDATED", 0.1),
    }
    lines = s3.direct.cat_file(f"{run}/metrics.jsonl").decode().splitlines()
    assert sum('"validation"' in line for line in lines) == 3


@pytest.mark.parametrize("mode", ["SYNC", "ASYNC"])
def test_a_killed_worker_restarts_from_the_remote_checkpoint(s3: S3, tmp_path: Path, mode: str) -> None:
    bucket = s3.bucket()
    marker = str(tmp_path / "crashed")
    result = _trainer(f"s3://{bucket}/exp", "crash", crash_at=2, marker=marker, max_failures=1, mode=mode).fit()
    assert (tmp_path / "crashed").exists()
    epochs = [m["epoch"] for m in result.metrics_history]
    if mode == "SYNC":
        # Rank 0's report of epoch 2 in attempt 0 is kept too (its round was cut short).
        assert epochs == [0, 1, 2, 2, 3]
    else:  # rank 0 does not wait for the uploads: it may have reported epoch 3 before the kill
        assert epochs in ([0, 1, 2, 2, 3], [0, 1, 2, 3, 2, 3])
    assert result.metrics["resumed_from"] == 2
    run = f"{bucket}/exp/crash"
    tops = {p.split("/")[0] for p in s3.listing(run)}
    # Kept: the best two by score, report #2 (epoch 1) and the last (epoch 3, also the latest);
    # what rank 0 uploaded alone before the kill was never committed and is gone.
    run_files = {"checkpoints.json", "logs", "metrics.jsonl", "run.json", "trainer.pkl"}
    latest = f"checkpoint_{len(epochs):06d}"
    assert result.checkpoint.path == f"s3://{run}/{latest}"
    assert tops == {"checkpoint_000002", latest} | run_files
    assert _complete(s3, f"{run}/{latest}") and _complete(s3, f"{run}/checkpoint_000002")
    assert {"logs/attempt_0/rank_1.log", "logs/attempt_1/rank_1.log"} <= set(s3.listing(run))


def test_a_checkpoint_replaced_under_its_own_name(s3: S3) -> None:
    bucket = s3.bucket()
    result = _trainer(f"s3://{bucket}/exp", "same", dir_name="model", epochs=3).fit()
    assert result.checkpoint.path == f"s3://{bucket}/exp/same/model"
    with result.checkpoint.as_directory() as d:
        assert Path(d, "epoch").read_text() == "2"
    assert set(s3.listing(f"{bucket}/exp/same/model")) == {"epoch", "shard_0.bin", "shard_1.bin"}
    assert ".staging" not in {p.split("/")[0] for p in s3.listing(f"{bucket}/exp/same")}


def test_a_missing_bucket_fails_before_any_worker_starts(s3: S3) -> None:
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"s3://no-such-bucket-here/exp cannot hold the run.*bucket exists"):
        _trainer("s3://no-such-bucket-here/exp", "x").fit()
    assert time.monotonic() - started < 30


class _CutAfter(train.UserCallback):
    """Takes the store away (``stall``: it stops answering) after ``reports`` reports."""

    def __init__(self, proxy: Proxy, reports: int, stall: bool = False) -> None:
        self.proxy, self.reports, self.seen, self.stall = proxy, reports, 0, stall
        self.at = 0.0

    def after_report(self, run_context: Any, metrics: Any, checkpoint: Any) -> None:
        self.seen += 1
        if self.seen == self.reports:
            self.at = time.monotonic()
            self.proxy.stall() if self.stall else self.proxy.cut()


def test_the_store_going_away_mid_run(s3: S3) -> None:
    bucket = s3.bucket()
    cut = _CutAfter(s3.proxy, 2)
    try:
        with pytest.raises(WorkerGroupError, match=r"Uploading checkpoint 'checkpoint_000003' of report #3 to s3://"):
            _trainer(f"s3://{bucket}/exp", "outage", epochs=6, callbacks=[cut]).fit()
        # With botocore's default retries this took 43-86 s (8.8 s a call); ddptrain's S3 clients
        # try each request 3 times.
        assert time.monotonic() - cut.at < 25
    finally:
        s3.proxy.restore()
    run = f"{bucket}/exp/outage"
    index = s3.index(run)
    assert [c["dir_name"] for c in index["checkpoints"]] == ["checkpoint_000001", "checkpoint_000002"]
    assert all(_complete(s3, f"{run}/{c['dir_name']}") for c in index["checkpoints"])
    # Resuming finishes the run from the last committed checkpoint, and deletes what the
    # outage left half-uploaded.
    s3fs.S3FileSystem.clear_instance_cache()
    result = _trainer(f"s3://{bucket}/exp", "outage", epochs=4).fit()
    assert result.metrics["resumed_from"] == 2
    names = [c["dir_name"] for c in s3.index(run)["checkpoints"]]
    on_store = sorted({p.split("/")[0] for p in s3.listing(run) if p.startswith("checkpoint_")})
    assert on_store == sorted(names)


def test_a_store_that_stops_answering_fails_the_run_within_the_bound(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    """The endpoint accepts connections and never answers: the run fails with a StorageError
    naming the store after DDPTRAIN_STORAGE_TIMEOUT_S, instead of hanging."""
    monkeypatch.setenv("DDPTRAIN_STORAGE_TIMEOUT_S", "3")
    bucket = s3.bucket()
    stall = _CutAfter(s3.proxy, 2, stall=True)
    try:
        with pytest.raises((train.TrainingFailedError, StorageError)) as info:
            _trainer(f"s3://{bucket}/exp", "stalled", epochs=6, callbacks=[stall]).fit()
        took = time.monotonic() - stall.at
    finally:
        s3.proxy.restore()
    error = info.value if isinstance(info.value, StorageError) else info.value.__cause__
    assert isinstance(error, StorageError) and error.timed_out, repr(info.value)
    assert f"s3://{bucket}/exp" in str(error) and "did not answer for 3 s" in str(error)
    assert took < 25, took  # the bound, the teardown, and a busy machine's slack
    run = f"{bucket}/exp/stalled"
    index = s3.index(run)
    assert [c["dir_name"] for c in index["checkpoints"]] == ["checkpoint_000001", "checkpoint_000002"]
    assert all(_complete(s3, f"{run}/{c['dir_name']}") for c in index["checkpoints"])
    s3fs.S3FileSystem.clear_instance_cache()
    # The resume is not about the bound: the default bound, so that a busy machine's slow
    # answer (3 s was once too short for the first write) does not fail it.
    monkeypatch.delenv("DDPTRAIN_STORAGE_TIMEOUT_S")
    result = _trainer(f"s3://{bucket}/exp", "stalled", epochs=4).fit()
    assert result.metrics["resumed_from"] == 2


CTRL_C_SCRIPT = textwrap.dedent(
    """
    import sys, tempfile, time
    from pathlib import Path
    import ddptrain as train

    def loop(config):
        rank = train.get_context().get_world_rank()
        if config["at_end"]:  # one report, whose metrics are uploaded meanwhile; then it returns
            train.report({"step": 0})
            time.sleep(3)
            if rank == 0:
                print("done", flush=True)
            return
        for step in range(1000):
            with tempfile.TemporaryDirectory() as d:
                Path(d, "w.bin").write_bytes(b"x" * 1000)
                train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(d))
            if rank == 0:
                print("step", step, flush=True)
            time.sleep(0.2)

    if __name__ == "__main__":
        train.DataParallelTrainer(
            loop,
            train_loop_config={"at_end": sys.argv[2] == "at-end"},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="interrupted", storage_path=sys.argv[1]),
        ).fit()
    """
)


def _children(pid: int) -> list[str]:
    """The processes ``pid`` started to run its workers: its agents, whether its own children or
    those of its agent fork server (a child that lives as long as the driver, on purpose)."""

    def children(of: str | int) -> list[str]:
        return [c for task in Path(f"/proc/{of}/task").iterdir() for c in (task / "children").read_text().split()]

    found = []
    for child in children(pid):
        try:
            server = b"DDPTRAIN_AGENT_FORKSERVER_FD=" in Path(f"/proc/{child}/environ").read_bytes()
            found += children(child) if server else [child]
        except OSError:
            continue  # gone meanwhile
    return found


@pytest.mark.parametrize("when", ["mid-run", "at-end"])
def test_ctrl_c_ends_a_driver_whose_store_stopped_answering(s3: S3, tmp_path: Path, when: str) -> None:
    """Even with a bound of 10 minutes, Ctrl-C ends the driver within seconds: the uploads it
    makes on its way out get a bound of seconds. Mid-run, or in the run's last uploads after
    the training finished (its workers are gone)."""
    bucket = s3.bucket()
    script = tmp_path / "driver.py"
    script.write_text(CTRL_C_SCRIPT)
    env = {**os.environ, "DDPTRAIN_STORAGE_TIMEOUT_S": "600", "PYTHONPATH": ROOT}
    proc = ForkedDriver(script, [f"s3://{bucket}/exp", when], env=env)  # a driver process of its own
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        if ("done" if when == "at-end" else "step 0") not in line:
            proc.kill()
            raise AssertionError(line + proc.communicate()[1])
        s3.proxy.stall()
        if when == "at-end":  # the workers returned: the driver is in its last uploads
            deadline = time.monotonic() + 30
            while _children(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _children(proc.pid)
        time.sleep(2)  # every process is waiting for the store now
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            raise AssertionError(f"Ctrl-C did not end the driver in 30 s:\n{err[-3000:]}") from None
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        s3.proxy.restore()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-3000:]
    assert took < 15, (took, err[-3000:])


@pytest.mark.parametrize("kind", ["s3fs", "pyarrow"])
def test_a_storage_filesystems_credentials_never_reach_the_bucket(s3: S3, kind: str) -> None:
    """trainer.pkl holds no file system (its key and secret would be readable by anyone who
    can read the bucket): restore() takes the file system again."""
    import pyarrow.fs as pafs

    bucket = s3.bucket()
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    if kind == "s3fs":
        fs: Any = s3fs.S3FileSystem(key="AKIDDPTRAINTEST", secret=secret, endpoint_url=s3.endpoint)
    else:
        host = s3.endpoint.split("//", 1)[1]
        fs = pafs.S3FileSystem(
            access_key="AKIDDPTRAINTEST", secret_key=secret, endpoint_override=host, scheme="http", region="us-east-1"
        )

    s3.direct.pipe_file(f"{bucket}/given/epoch", b"0")  # a start checkpoint on the same file system

    def trainer(epochs: int) -> TorchTrainer:
        return TorchTrainer(
            _loop,
            train_loop_config={"epochs": epochs},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="creds", storage_path=f"{bucket}/exp", storage_filesystem=fs),
            resume_from_checkpoint=train.Checkpoint(f"{bucket}/given", filesystem=fs),
        )

    assert trainer(2).fit().metrics_history[0]["resumed_from"] == 1
    run = f"{bucket}/exp/creds"
    stored = {path: s3.direct.cat_file(path) for path in s3.direct.find(bucket)}
    assert f"{run}/trainer.pkl" in stored
    assert [path for path, data in stored.items() if secret.encode() in data] == []

    assert TorchTrainer.can_restore(run, storage_filesystem=fs)
    with pytest.raises(RunDirectoryError, match=r"restore\(path, storage_filesystem=fs\)"):
        TorchTrainer.restore(run)
    restored = TorchTrainer.restore(run, storage_filesystem=fs, train_loop_config={"epochs": 3})
    assert restored.resume_from_checkpoint == train.Checkpoint(f"{bucket}/given", filesystem=fs)
    result = restored.fit()
    assert result.metrics["resumed_from"] == 2 and result.path == run


def test_pyarrow_style_uri_options(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    """``s3://bucket?region=...&endpoint_override=...&scheme=http``, as Ray's tests give it:
    the options configure the client (no AWS_ENDPOINT_URL here), and paths go with it."""
    import pyarrow.fs as pafs

    monkeypatch.delenv("AWS_ENDPOINT_URL")
    bucket = s3.bucket()
    options = f"region=us-east-1&endpoint_override={s3.endpoint.split('//', 1)[1]}&scheme=http"
    result = _trainer(f"s3://{bucket}/exp?{options}", "opts", epochs=2).fit()
    assert result.path == f"{bucket}/exp/opts"
    assert result.checkpoint.path == f"{bucket}/exp/opts/checkpoint_000002"
    assert isinstance(result.checkpoint.filesystem, pafs.FileSystem)
    assert _complete(s3, f"{bucket}/exp/opts/checkpoint_000002")
    again = train.Result.from_path(f"s3://{bucket}/exp/opts?{options}")
    assert again.metrics_history == result.metrics_history
    with again.checkpoint.as_directory() as d:
        assert Path(d, "epoch").read_text() == "1"
    show = _ddptrain("show", f"s3://{bucket}/exp/opts?{options}")
    assert show.returncode == 0 and f"run 'opts': FINISHED  ({bucket}/exp/opts)" in show.stdout, show.stderr


def test_storage_filesystem_and_pyarrow(s3: S3) -> None:
    import pyarrow.fs as pafs

    bucket = s3.bucket()
    fs = s3fs.S3FileSystem()
    trainer = TorchTrainer(
        _loop,
        train_loop_config={"epochs": 2},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="fsrun", storage_path=f"{bucket}/exp", storage_filesystem=fs),
    )
    result = trainer.fit()
    # Ray's rule: with storage_filesystem, paths are paths on it, and the file system comes with them.
    assert result.path == f"{bucket}/exp/fsrun"
    assert result.checkpoint.path == f"{bucket}/exp/fsrun/checkpoint_000002"
    assert isinstance(result.checkpoint.filesystem, pafs.FileSystem)
    assert isinstance(result.filesystem, pafs.FileSystem)
    info = result.checkpoint.filesystem.get_file_info(f"{result.checkpoint.path}/epoch")
    assert info.type == pafs.FileType.File
    again = train.Result.from_path(result.path, storage_filesystem=fs)
    assert again.checkpoint == result.checkpoint

    # A pyarrow file system works too.
    arrow = pafs.S3FileSystem(
        access_key="testing", secret_key="testing", endpoint_override=s3.endpoint, scheme="http", region="us-east-1"
    )
    from_arrow = train.Result.from_path(f"{bucket}/exp/fsrun", storage_filesystem=arrow)
    assert from_arrow.metrics_history == result.metrics_history
    with from_arrow.checkpoint.as_directory() as d:
        assert Path(d, "epoch").read_text() == "1"


def test_remote_checkpoint_objects(s3: S3, tmp_path: Path) -> None:
    bucket = s3.bucket()
    s3.direct.pipe_file(f"{bucket}/ck/a.txt", b"A")
    s3.direct.pipe_file(f"{bucket}/ck/sub/b.txt", b"B")
    checkpoint = train.Checkpoint(f"s3://{bucket}/ck")
    checkpoint.set_metadata({"step": 3})
    assert checkpoint.get_metadata() == {"step": 3}
    target = checkpoint.to_directory(str(tmp_path / "copy"))
    assert Path(target, "a.txt").read_bytes() == b"A" and Path(target, "sub", "b.txt").read_bytes() == b"B"
    with checkpoint.as_directory() as d:
        kept = d
        assert Path(d, "sub", "b.txt").read_bytes() == b"B"
    assert not os.path.exists(kept)  # the download is deleted afterwards
    with pytest.raises(ConfigError, match="memory:// file system cannot hold a run"):
        train.RunConfig(storage_path="memory://x/y")._check_storage()


def test_a_missing_extra_is_named() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["s3fs"] = None
        import ddptrain as train
        try:
            train.RunConfig(name="x", storage_path="s3://bucket/prefix")._check_storage()
        except train.errors.ConfigError as exc:
            print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install ddptrain[s3]" in out.stdout, out.stdout + out.stderr


@pytest.mark.ssh
def test_a_validation_on_an_ssh_host_reads_the_checkpoint_from_the_store(s3: S3, ssh) -> None:
    def validate_on_host(checkpoint: train.Checkpoint) -> dict[str, Any]:  # pickled by value, as above
        with checkpoint.as_directory() as d:  # downloaded from the store, with the driver's credentials
            epoch = int(Path(d, "epoch").read_text())
        return {"val": 0.5 + epoch, "path": checkpoint.path, "over_ssh": "SSH_CONNECTION" in os.environ}

    def loop() -> None:
        d = tempfile.mkdtemp()
        Path(d, "epoch").write_text("0")
        train.report({"epoch": 0}, checkpoint=train.Checkpoint(d), validation=True)

    bucket = s3.bucket()
    result = train.DataParallelTrainer(
        loop,
        scaling_config=train.ScalingConfig(num_workers=0, hosts=["localhost", "h0"]),
        validation_config=train.ValidationConfig(validate_on_host, host="h0"),
        run_config=train.RunConfig(name="val", storage_path=f"s3://{bucket}/exp"),
    ).fit()
    # Passed as it is (no copy): the host read it from the store.
    assert result.metrics == {
        "epoch": 0,
        "val": 0.5,
        "path": f"s3://{bucket}/exp/val/checkpoint_000001",
        "over_ssh": True,
    }


@pytest.mark.ssh
def test_workers_on_ssh_hosts_upload_with_the_drivers_credentials(s3: S3, ssh) -> None:
    bucket = s3.bucket()
    trainer = TorchTrainer(
        _loop,
        train_loop_config={"epochs": 2},
        scaling_config=train.ScalingConfig(num_workers=2, hosts=["h0 slots=1", "h1 slots=1"]),
        run_config=train.RunConfig(name="ssh", storage_path=f"s3://{bucket}/exp"),
    )
    result = trainer.fit()
    assert result.checkpoint.path == f"s3://{bucket}/exp/ssh/checkpoint_000002"
    assert _complete(s3, f"{bucket}/exp/ssh/checkpoint_000002")


KILL_SCRIPT = textwrap.dedent(
    """
    import json, shutil, sys, tempfile
    from pathlib import Path
    import ddptrain as train

    def loop(config):
        start = 0
        checkpoint = train.get_checkpoint()
        if checkpoint:  # the checkpoint a resumed run gets is complete
            with checkpoint.as_directory() as d:
                assert len(list(Path(d).glob("*.bin"))) == 6, checkpoint.path
                start = json.loads(Path(d, "state.json").read_text())["step"] + 1
        rank = train.get_context().get_world_rank()
        steps = config["steps"]
        stop = start + int(steps[1:]) if steps.startswith("+") else int(steps)  # "+2": two more steps
        for step in range(start, stop):
            d = tempfile.mkdtemp()  # ASYNC deletes it once uploaded
            for i in range(3):
                Path(d, f"rank{rank}_{i}.bin").write_bytes(b"x" * 2000)
            if rank == 0:
                Path(d, "state.json").write_text(json.dumps({"step": step}))
            train.report(
                {"step": step, "score": step % 3},
                checkpoint=train.Checkpoint.from_directory(d),
                checkpoint_dir_name=config["name"] or None,
                checkpoint_upload_mode=config["mode"],
            )
            if config["mode"] == "SYNC":
                shutil.rmtree(d)
            print("step", step, flush=True)
        return start

    if __name__ == "__main__":
        storage, name, steps, mode = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
        result = train.DataParallelTrainer(
            loop,
            train_loop_config={"steps": steps, "name": name, "mode": mode},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(
                name="killed",
                storage_path=storage,
                checkpoint_config=train.CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score"),
            ),
        ).fit()
        print("RESULT", json.dumps({"start": result.return_value, "checkpoint": result.checkpoint.path}))
    """
)


def _assert_store_consistent(s3: S3, run: str) -> int:
    """Every checkpoint the index lists is whole; returns the latest one's step (-1: none)."""
    index = s3.index(run) if s3.direct.exists(f"{run}/checkpoints.json") else {"checkpoints": [], "latest": None}
    for entry in index["checkpoints"]:
        files = set(s3.listing(f"{run}/{entry['dir_name']}"))
        assert {f"rank{r}_{i}.bin" for r in (0, 1) for i in range(3)} | {"state.json"} <= files, entry
    if index["latest"] is None:
        return -1
    return int(json.loads(s3.direct.cat_file(f"{run}/{index['latest']}/state.json"))["step"])


@pytest.mark.parametrize(
    ("name", "modes"),
    [("", ("SYNC", "ASYNC")), ("latest", ("ASYNC", "SYNC"))],
    ids=["default names", "one replaced name"],
)
def test_random_driver_kills_never_leave_a_half_checkpoint_on_the_store(
    s3: S3, tmp_path: Path, name: str, modes: tuple[str, str]
) -> None:
    """Two kills at random moments of the uploads with each naming scheme, one with uploads in
    the training thread (SYNC), one with uploads in the workers' background (ASYNC): the first
    in a fresh run, the second in a run that resumed from the first kill's leftovers; then a run
    finishes (in the second kill's mode). (The moment a replacement is cut short is covered one
    by one below.) DDPTRAIN_SOAK_KILLS=25 for a soak run."""
    import random

    bucket = s3.bucket()
    script = tmp_path / "killed.py"
    script.write_text(KILL_SCRIPT)
    storage, run = f"s3://{bucket}/exp", f"{bucket}/exp/killed"
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    seen = -1  # the latest committed step seen on the store so far
    for kill in range(int(os.environ.get("DDPTRAIN_SOAK_KILLS", "2"))):
        proc = ForkedDriver(script, [storage, name, "100000", modes[kill % 2]])  # a driver process of its own
        assert proc.stdout is not None
        proc.stdout.readline()  # checkpoints are being committed
        time.sleep(rng.uniform(0.0, 1.0))
        proc.kill()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, f"kill {kill} (seed {seed}): the run failed on its own:\n{err}"
        seen = max(seen, _assert_store_consistent(s3, run))
    last = max(seen, _assert_store_consistent(s3, run))
    done = ForkedDriver(script, [storage, name, "+2", modes[1]])
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    summary = json.loads(out.split("RESULT ", 1)[1])
    # Never from scratch, never from before a checkpoint once committed: a checkpoint whose
    # replacement a kill interrupted is put back (the store may not list it right after the kill).
    assert summary["start"] >= last + 1, f"seed {seed}"
    if name == "":
        assert summary["start"] == last + 1, f"seed {seed}"
    assert _assert_store_consistent(s3, run) == summary["start"] + 1
    # Nothing is left on the store that the index does not list.
    listed = {c["dir_name"] for c in s3.index(run)["checkpoints"]}
    tops = {p.split("/")[0] for p in s3.listing(run)}
    assert tops - {"checkpoints.json", "logs", "metrics.jsonl", "run.json", "trainer.pkl"} == listed, f"seed {seed}"


def test_a_replacement_cut_short_puts_the_old_checkpoint_back(s3: S3, tmp_path: Path, caplog) -> None:
    """The moment the random kills above may or may not hit: the committed checkpoint was put
    aside and unlisted, its successor not yet listed, when the driver died."""
    from ddptrain.storage import remote
    from ddptrain.storage.remote_checkpoints import RemoteCheckpointManager

    bucket = s3.bucket()
    root = remote.resolve(f"s3://{bucket}/exp")
    assert root is not None
    run = root.path("run")

    def manager(folder: str) -> RemoteCheckpointManager:
        os.makedirs(tmp_path / folder)
        return RemoteCheckpointManager(str(tmp_path / folder), train.CheckpointConfig(), root, run)

    first = manager("a")
    s3.direct.pipe_file(f"{run}/latest/state.json", b"1")
    first.commit([f"{run}/latest"], "latest", {"step": 1}, 1)
    first._put_aside(first._entries[0])  # ... and the driver dies here
    assert s3.index(run)["latest"] is None and not s3.direct.exists(f"{run}/latest")

    second = manager("b")
    second.run_dir and Path(second.run_dir, "checkpoints.json").write_bytes(
        s3.direct.cat_file(f"{run}/checkpoints.json")
    )
    second.recover()
    assert "restored checkpoint 'latest' of report #1" in caplog.text
    assert s3.index(run)["latest"] == "latest"
    assert s3.direct.cat_file(f"{run}/latest/state.json") == b"1"
    assert sorted(s3.listing(run)) == ["checkpoints.json", "latest/state.json"]  # backup and record gone


def test_reports_only_the_local_copy_has_survive_a_resume(s3: S3, tmp_path: Path) -> None:
    """An earlier driver here could not upload its last reports (the store was away): the
    next start keeps them and uploads them, instead of taking the store's shorter copy."""
    from ddptrain.storage import remote
    from ddptrain.storage.mirror import RunMirror

    bucket = s3.bucket()
    root = remote.resolve(f"s3://{bucket}/exp")
    assert root is not None
    run = root.path("run")
    s3.direct.pipe_file(f"{run}/run.json", b"{}")
    s3.direct.pipe_file(f"{run}/metrics.jsonl", b'{"metrics": {"step": 1}}\n')
    local = tmp_path / "copy"
    local.mkdir()
    (local / "metrics.jsonl").write_bytes(b'{"metrics": {"step": 1}}\n{"metrics": {"step": 2}}\n')
    RunMirror(root, str(local), run).pull()
    expected = b'{"metrics": {"step": 1}}\n{"metrics": {"step": 2}}\n'
    assert (local / "metrics.jsonl").read_bytes() == expected
    assert s3.direct.cat_file(f"{run}/metrics.jsonl") == expected
    # A copy that does not extend the store's (another driver's run) is replaced by the store's.
    (local / "metrics.jsonl").write_bytes(b'{"metrics": {"step": 9}}\n')
    RunMirror(root, str(local), run).pull()
    assert (local / "metrics.jsonl").read_bytes() == expected


ROOT = str(Path(__file__).resolve().parent.parent)


def _chatty() -> None:
    rank = train.get_context().get_world_rank()
    for epoch in range(3):
        print(f"rank {rank} at epoch {epoch}", flush=True)
        with tempfile.TemporaryDirectory() as d:
            Path(d, f"shard_{rank}.bin").write_bytes(b"x")
            score = [0.5, 0.9, 0.1][epoch]
            train.report({"epoch": epoch, "score": score}, checkpoint=train.Checkpoint.from_directory(d))


def _ddptrain(*args: str) -> subprocess.CompletedProcess[str]:
    """The real `ddptrain` command, with the fixture's endpoint, credentials and cache folder."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-m", "ddptrain", *args], capture_output=True, text=True, timeout=120, env=env
    )


def _ddptrain_here(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """The `ddptrain` command's own entry point, in this process (no interpreter to start)."""
    from ddptrain.cli.main import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's errors
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["ddptrain", *args], code, out, err)


def test_the_cli_reads_a_run_on_remote_storage(s3: S3, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`ddptrain runs/show/logs/export/plot` on a run's URI, from a machine without the driver's
    working copy. The first command is the real `ddptrain` process; the others call its entry
    point in this process (each process would import s3fs and the CLI again)."""
    bucket = s3.bucket()
    TorchTrainer(
        _chatty,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(
            name="run",
            storage_path=f"s3://{bucket}/exp",
            checkpoint_config=train.CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score"),
        ),
    ).fit()
    uri = f"s3://{bucket}/exp/run"
    shutil.rmtree(os.environ["DDPTRAIN_CACHE_DIR"])  # another machine: no driver's working copy here

    runs = _ddptrain("runs", f"s3://{bucket}/exp")
    assert runs.returncode == 0, runs.stderr
    row = next(line for line in runs.stdout.splitlines() if line.startswith("run "))
    assert row.split()[1] == "FINISHED" and "epoch=2" in row and "checkpoint_000002" in row
    assert f"1 run(s) in s3://{bucket}/exp" in runs.stdout

    show = _ddptrain_here(capsys, "show", uri)
    assert show.returncode == 0, show.stderr
    assert f"run 'run': FINISHED  ({uri})" in show.stdout
    assert "epoch: last 2, min 0, max 2" in show.stdout
    assert "checkpoint_000002  epoch=1 score=0.9  [best]" in show.stdout
    assert "checkpoint_000003  epoch=2 score=0.1  [latest]" in show.stdout
    data = json.loads(_ddptrain_here(capsys, "show", uri, "--json").stdout)
    assert data["path"] == uri and data["latest_checkpoint"] == f"{uri}/checkpoint_000003"

    logs = _ddptrain_here(capsys, "logs", uri, "--rank", "1")
    assert logs.returncode == 0, logs.stderr
    assert [line for line in logs.stdout.splitlines() if "at epoch" in line] == [
        f"rank 1 at epoch {e}" for e in range(3)
    ]
    missing = _ddptrain_here(capsys, "logs", uri, "--rank", "5")
    assert missing.returncode == 1 and f"no log {uri}/logs/attempt_0/rank_5.log (attempts: [0])" in missing.stderr
    follow = _ddptrain_here(capsys, "logs", uri, "--follow")
    assert follow.returncode == 2 and "without --follow" in follow.stderr

    export = _ddptrain_here(capsys, "export", uri, "--format", "json")
    assert [(r["report"], r["epoch"], r["score"]) for r in json.loads(export.stdout)] == [
        (1, 0, 0.5),
        (2, 1, 0.9),
        (3, 2, 0.1),
    ]
    if importlib.util.find_spec("matplotlib") is not None:
        plot = _ddptrain_here(capsys, "plot", uri, "-o", str(tmp_path / "plot.png"))
        assert plot.returncode == 0 and (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG"), plot.stderr

    nothing = _ddptrain_here(capsys, "show", f"s3://{bucket}/exp/nope")
    assert nothing.returncode == 2
    assert f"ddptrain show: no run 's3://{bucket}/exp/nope'" in nothing.stderr and "run.json" in nothing.stderr
    assert "no runs in" in _ddptrain_here(capsys, "runs", f"s3://{bucket}/empty").stdout


def test_the_cli_names_the_missing_extra_for_a_uri() -> None:
    code = "import sys; sys.modules['s3fs'] = None; from ddptrain.cli.main import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-c", code, "show", "s3://bucket/prefix/run"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 2 and "ddptrain show:" in out.stderr and "pip install ddptrain[s3]" in out.stderr


def test_the_bound_holds_for_any_file_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system whose uploads hang (a stand-in for a hung NFS mount or an SDK without
    timeouts): the call fails after the bound, the next ones fail at once while it hangs, and
    all is well once it returns. A slow upload that reports progress is not cut."""
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    from ddptrain.storage import remote

    release = threading.Event()

    class Hanging(DirFileSystem):
        slow = False

        def put_file(self, lpath: str, rpath: str, callback: Any = None, **kwargs: Any) -> None:
            if self.slow:  # 2.5 s in all, progress every 0.25 s
                for _ in range(10):
                    time.sleep(0.25)
                    callback.relative_update(1)
            elif not release.wait(60):
                raise AssertionError("never released")
            super().put_file(lpath, rpath, **kwargs)

    monkeypatch.setenv("DDPTRAIN_STORAGE_TIMEOUT_S", "1")
    (tmp_path / "store" / "bucket").mkdir(parents=True)
    root = remote.resolve("bucket", Hanging(path=str(tmp_path / "store"), fs=LocalFileSystem()))
    assert root is not None
    local = tmp_path / "weights.bin"
    local.write_bytes(b"w")
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"bucket did not answer for 1 s while uploading bucket/a\.bin") as info:
        root.upload_file(str(local), "bucket/a.bin")
    assert info.value.timed_out and time.monotonic() - started < 5
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"uploading bucket/a\.bin is still waiting\); not listing bucket"):
        root.list_names("bucket")
    assert time.monotonic() - started < 0.5
    release.set()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert root.list_names("bucket") == ["a.bin"]
            break
        except StorageError:
            assert time.monotonic() < deadline, "the store never answered again"
            time.sleep(0.1)
    Hanging.slow = True
    root.upload_file(str(local), "bucket/b.bin")  # 2.5 s with a bound of 1 s: it made progress
    assert (tmp_path / "store" / "bucket" / "b.bin").read_bytes() == b"w"


def test_the_runs_uploads_are_tried_again_for_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that refuses the driver's uploads (an error, not a hang): a short outage costs a
    wait, not the run; one that lasts DDPTRAIN_STORAGE_TIMEOUT_S is a StorageError naming the
    store, the last error and the local copy, and the next upload is not tried for another bound."""
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    from ddptrain.storage import remote
    from ddptrain.storage.mirror import RunMirror

    class Refusing(DirFileSystem):
        until = 0.0

        def put_file(self, lpath: str, rpath: str, callback: Any = None, **kwargs: Any) -> None:
            if time.monotonic() < Refusing.until:
                raise ConnectionRefusedError(111, "Connection refused")
            super().put_file(lpath, rpath, **kwargs)

    monkeypatch.setenv("DDPTRAIN_STORAGE_TIMEOUT_S", "2")
    (tmp_path / "store" / "bucket").mkdir(parents=True)
    root = remote.resolve("bucket", Refusing(path=str(tmp_path / "store"), fs=LocalFileSystem()))
    assert root is not None
    local = tmp_path / "copy"
    local.mkdir()
    (local / "metrics.jsonl").write_text('{"metrics": {"step": 0}}\n')
    (local / "run.json").write_text("{}")
    mirror = RunMirror(root, str(local), "bucket/run")
    stored = tmp_path / "store" / "bucket" / "run" / "metrics.jsonl"

    Refusing.until = time.monotonic() + 1.0
    mirror.push_file("metrics.jsonl")  # tried again after 0.5 s and 1 s
    assert stored.read_text() == '{"metrics": {"step": 0}}\n'

    Refusing.until = time.monotonic() + 60
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        mirror.push_metrics(force=True)
    took = time.monotonic() - started
    assert 2 <= took < 5, took
    assert str(info.value).startswith(
        "bucket failed every upload for 2 s (the bound is DDPTRAIN_STORAGE_TIMEOUT_S=2 s); the last: uploading "
        "bucket/run/metrics.jsonl: ConnectionRefusedError: [Errno 111] Connection refused. The run's reports, "
        f"run.json and logs are in its local copy {local} "
    ), str(info.value)
    assert not info.value.timed_out
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"failed every upload for [23] s"):
        mirror.push_file("run.json")  # one try: the store has failed for the bound already
    assert time.monotonic() - started < 0.5
    Refusing.until = 0.0
    assert mirror.push_final(failed=False)
    assert (tmp_path / "store" / "bucket" / "run" / "run.json").read_text() == "{}"


def test_a_storage_filesystem_whose_endpoint_never_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's own s3fs, with its own (long) timeouts and retries, at an endpoint that accepts
    connections (the kernel's backlog) and never answers: fit() fails at its first call to the
    store, after the bound, naming the store."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    monkeypatch.setenv("DDPTRAIN_STORAGE_TIMEOUT_S", "2")
    fs = s3fs.S3FileSystem(key="k", secret="s", endpoint_url=f"http://127.0.0.1:{listener.getsockname()[1]}")
    trainer = TorchTrainer(
        _loop,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="x", storage_path="bucket/exp", storage_filesystem=fs),
    )
    started = time.monotonic()
    try:
        with pytest.raises(
            StorageError, match=r"bucket/exp did not answer for 2 s while writing bucket/exp/\.ddptrain_probe"
        ):
            trainer.fit()
        assert time.monotonic() - started < 10
    finally:
        listener.close()


def _reports_only(config: dict[str, Any]) -> None:
    """Reports `steps` steps, no checkpoint; prints "done" (rank 0) before it returns."""
    for step in range(config["steps"]):
        train.report({"step": step})
        time.sleep(config["sleep"])
    if train.get_context().get_world_rank() == 0:
        print("done", flush=True)


def _plain_trainer(bucket: str, name: str, steps: int, sleep: float, callbacks: list[Any]) -> TorchTrainer:
    return TorchTrainer(
        _reports_only,
        train_loop_config={"steps": steps, "sleep": sleep},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name=name, storage_path=f"s3://{bucket}/exp", callbacks=callbacks),
    )


def _local_copy(tmp_path: Path, name: str) -> Path:
    """The driver's working copy of run ``name`` (under the fixture's DDPTRAIN_CACHE_DIR)."""
    (found,) = (tmp_path / "cache" / "runs").glob(f"*/{name}")
    return found


def _steps(metrics: bytes) -> list[int]:
    return [json.loads(line)["metrics"]["step"] for line in metrics.splitlines()]


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """What `ddptrain ARGS` prints (in this process)."""
    from ddptrain.cli.main import main

    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr().out


def _status_in_runs(capsys: pytest.CaptureFixture[str], run: Path) -> str:
    """The STATUS column of `ddptrain runs` for ``run`` (a run folder), listing its parent."""
    row = next(line for line in _cli(capsys, "runs", str(run.parent)).splitlines() if line.startswith(run.name + " "))
    return row.split()[1]


def test_a_run_without_checkpoints_fails_when_its_store_stops_answering(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the driver talks to the store (metrics, run.json, logs): an upload that gets no
    answer for the bound fails the run with a StorageError naming the store and the local copy,
    which has every report; `ddptrain show` of the copy says ERRORED and why."""
    monkeypatch.setenv("DDPTRAIN_STORAGE_TIMEOUT_S", "5")  # 3 s: the first probe timed out on a loaded machine
    bucket = s3.bucket()
    stall = _CutAfter(s3.proxy, 3, stall=True)
    try:
        with pytest.raises(StorageError) as info:
            _plain_trainer(bucket, "plain", steps=60, sleep=0.5, callbacks=[stall]).fit()
        took = time.monotonic() - stall.at
        s3.direct.invalidate_cache()
        stored = _steps(s3.direct.cat_file(f"{bucket}/exp/plain/metrics.jsonl"))  # before the store answers again
    finally:
        s3.proxy.restore()
    local = _local_copy(tmp_path, "plain")
    message = str(info.value)
    assert info.value.timed_out and f"s3://{bucket}/exp did not answer for 5 s while uploading" in message, message
    assert f"local copy {local} " in message, message
    assert took < 25, took  # at most 2 s to the next upload, the bound, the teardown, a busy machine
    reported = _steps((local / "metrics.jsonl").read_bytes())
    assert reported == list(range(len(reported))) and len(reported) > 3
    assert len(stored) < len(reported)
    status = json.loads((local / "run.json").read_text())
    assert status["status"] == "ERRORED" and status["error"].startswith(f"StorageError: s3://{bucket}/exp did not")
    assert (local / "logs" / "attempt_0" / "rank_0.log").is_file()
    shown = _cli(capsys, "show", str(local))
    assert f"run 'plain': ERRORED  ({local})" in shown and "error: StorageError: " in shown, shown
    assert _status_in_runs(capsys, local) == "ERRORED"
    # Resumed on this machine once the store answers: what only the local copy had is uploaded.
    logs = {rank: (local / "logs" / "attempt_0" / f"rank_{rank}.log").read_bytes() for rank in (0, 1)}
    s3fs.S3FileSystem.clear_instance_cache()
    result = _plain_trainer(bucket, "plain", steps=2, sleep=0, callbacks=[]).fit()
    assert [m["step"] for m in result.metrics_history] == [*reported, 0, 1]
    run = f"{bucket}/exp/plain"
    s3.direct.invalidate_cache()
    assert _steps(s3.direct.cat_file(f"{run}/metrics.jsonl")) == [*reported, 0, 1]
    assert all(s3.direct.cat_file(f"{run}/logs/attempt_0/rank_{rank}.log") == logs[rank] for rank in (0, 1))
    assert s3.direct.exists(f"{run}/logs/attempt_1/rank_0.log")


def test_fit_raises_when_the_results_cannot_be_uploaded_at_the_end(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Training finished, then the store stopped answering: fit() does not report success with
    results missing from the bucket; its StorageError says the training finished and where the
    local copy is, and the copy's run.json says what happened."""
    monkeypatch.setenv("DDPTRAIN_STORAGE_TIMEOUT_S", "3")
    bucket = s3.bucket()
    stall = _CutAfter(s3.proxy, 4, stall=True)  # after the last report
    try:
        with pytest.raises(StorageError) as info:
            _plain_trainer(bucket, "end", steps=4, sleep=0, callbacks=[stall]).fit()
        took = time.monotonic() - stall.at
    finally:
        s3.proxy.restore()
    local = _local_copy(tmp_path, "end")
    message = str(info.value)
    assert message.startswith(f"Training finished, but its results could not all be uploaded to s3://{bucket}/exp: ")
    assert f"local copy {local} " in message, message
    assert took < 20, took
    assert _steps((local / "metrics.jsonl").read_bytes()) == [0, 1, 2, 3]
    status = json.loads((local / "run.json").read_text())
    assert status["status"] == "FINISHED" and "error" not in status
    assert status["upload_error"].startswith(f"s3://{bucket}/exp did not answer for 3 s"), status
    assert (local / "logs" / "attempt_0" / "rank_1.log").is_file()
    shown = _cli(capsys, "show", str(local))
    assert f"run 'end': FINISHED  ({local})" in shown, shown
    assert _status_in_runs(capsys, local) == "FINISHED"
    assert f"  upload failed: s3://{bucket}/exp did not answer" in shown, shown
