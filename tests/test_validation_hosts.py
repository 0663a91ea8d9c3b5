"""Asynchronous validation on a listed SSH host (``ValidationConfig(host=...)``), over real
sshd servers: the validation runs there (a checkpoint the host cannot see is copied to it),
its metrics rank the checkpoint; a host that cannot be reached fails that validation only;
a hanging validation is killed at its timeout; and nothing of it is left on the host when
the driver is killed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

import ddptrain as train
from ddptrain import ValidationConfig, ValidationTaskConfig
from tests.test_validation import _alive, _report, _step, _validation_lines

pytestmark = pytest.mark.ssh

ROOT = Path(__file__).resolve().parent.parent


def _fit(
    loop: Any, storage: str, validate: Any, hosts: list[str], host: str, workers: int = 0, gpus: int = 0, **kwargs: Any
):
    task = ValidationTaskConfig(fn_kwargs=kwargs)
    return train.DataParallelTrainer(
        loop,
        scaling_config=train.ScalingConfig(num_workers=workers, hosts=hosts),
        validation_config=ValidationConfig(validate, task, {"num_gpus": gpus} if gpus else None, host=host),
        run_config=train.RunConfig(
            name="run",
            storage_path=storage,
            checkpoint_config=train.CheckpointConfig(checkpoint_score_attribute="acc"),
        ),
    ).fit()


_HOSTILE = ("sub dir $HOME 'q\"", "we ird;$(touch x) ü.txt")  # copied as they are, nothing run


def _checkpoint_with_hostile_names(step: int) -> None:
    folder = tempfile.mkdtemp()
    Path(folder, "step").write_text(str(step))
    Path(folder, _HOSTILE[0]).mkdir()
    Path(folder, *_HOSTILE).write_text(f"nested {step}")
    train.report({"loss": 1.0, "step": step}, checkpoint=train.Checkpoint(folder), validation=True)
    shutil.rmtree(folder)


def _where_it_ran(checkpoint: train.Checkpoint, scores: dict[str, float]) -> dict[str, Any]:
    print("validating on the host", flush=True)
    step = _step(checkpoint)
    server = os.environ.get("SSH_CONNECTION", "").split()
    return {
        "acc": scores[str(step)],
        "nested": Path(checkpoint.path, *_HOSTILE).read_text(),
        "server": server[2] if len(server) == 4 else None,  # the address of the sshd it came through
        "path": checkpoint.path,
        "mode": oct(os.stat(os.path.dirname(checkpoint.path)).st_mode & 0o777),
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


@pytest.mark.slow
def test_a_validation_runs_on_the_listed_host_on_a_copy_of_the_checkpoint(ssh, isolated: tuple[str, str]) -> None:
    storage, iso = isolated  # the host `iso` does not see the storage folder

    def loop() -> None:
        checkpoint = train.get_context().get_world_rank() == 0
        for step in (0, 1):
            if checkpoint:
                _checkpoint_with_hostile_names(step)
            else:
                train.report({"loss": 1.0, "step": step})

    result = _fit(
        loop, storage, _where_it_ran, ["localhost slots=1", f"{iso} slots=1"], iso, 2, scores={"0": 0.9, "1": 0.2}
    )
    lines = _validation_lines(storage)
    assert [(v["checkpoint"], v["error"]) for v in lines] == [("checkpoint_000001", None), ("checkpoint_000002", None)]
    host = ssh.hosts[-1]
    # Two logins on the host: its agent's, and one for both validations.
    assert host.log.read_text().count("Accepted publickey") == 2
    for line in lines:
        metrics = line["metrics"]
        assert metrics["server"] == host.addr  # it ran through the host's sshd
        # It read a copy in a private folder on the host, not the run directory it cannot see.
        assert metrics["path"].startswith("/tmp/ddptrain-validation-") and metrics["path"].endswith("/checkpoint")
        assert metrics["mode"] == "0o700" and metrics["cuda"] == ""
        assert metrics["nested"] == f"nested {line['report'] - 1}"
        assert not os.path.exists(os.path.dirname(metrics["path"]))  # removed afterwards
    # Its metrics rank the checkpoints (0.9 is the best), and the log is the run's.
    [(worse, _), (best, best_metrics)] = result.best_checkpoints
    assert os.path.basename(best.path) == "checkpoint_000001" and best_metrics["acc"] == 0.9
    assert os.path.basename(worse.path) == "checkpoint_000002"
    log = Path(storage, "run", "logs", "validation", "checkpoint_000001.log").read_text()
    assert "validating on the host\n" in log and "ddptrain-pid" not in log


def _hangs(checkpoint: train.Checkpoint, pids: str) -> dict[str, Any]:
    child = subprocess.Popen(["sleep", "60"])  # what it starts is killed with it
    # Its private folder on the host (where its request is): on its command line.
    folder = re.search(r"/tmp/ddptrain-validation-[0-9a-f]+", Path("/proc/self/cmdline").read_text())
    with open(pids, "a") as f:
        started = {
            "pids": [os.getpid(), child.pid],
            "path": checkpoint.path,
            "folder": folder and folder[0],
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        f.write(json.dumps(started) + "\n")
    try:
        time.sleep(60)
    finally:  # a stop is a SIGTERM first, as on the driver's machine: cleanup runs
        Path(pids + ".stopped").write_text("cleanup ran")
    return {"acc": 1.0}


def _started(pids: Path, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not (pids.exists() and pids.read_text().endswith("\n")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return json.loads(pids.read_text().splitlines()[0])


def _gone(pids: list[int], timeout_s: float = 5) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(_alive, pids))


def test_a_hanging_validation_on_a_host_is_killed_at_its_timeout(
    ssh, storage: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("DDPTRAIN_VALIDATION_TIMEOUT_S", "1")
    pids = tmp_path / "pids"

    def loop() -> Any:
        _report(0, validation=True)
        started = _started(pids)
        time.sleep(1.5)  # past its timeout: the next poll kills it
        listed = [r.status.value for r in train.get_all_reported_checkpoints()]
        return started, listed

    start = time.monotonic()
    # Asked for a GPU: the host's GPUs its host list gives stay visible.
    result = _fit(loop, storage, _hangs, ["localhost", "h0 gpus=1,3"], "h0", gpus=1, pids=str(pids))
    assert time.monotonic() - start < 30
    started, listed = result.return_value
    assert listed == ["VALIDATED"]
    [line] = _validation_lines(storage)
    assert "Validation killed after 1 s (DDPTRAIN_VALIDATION_TIMEOUT_S)" in line["error"]
    assert _gone(started["pids"])  # the function and what it started
    assert Path(f"{pids}.stopped").read_text() == "cleanup ran"  # SIGTERM, then SIGKILL
    # h0 sees the run directory (same file system): the checkpoint was not copied.
    assert started["path"] == str(Path(storage, "run", "checkpoint_000001"))
    assert started["cuda"] == "1,3"


def _fails(checkpoint: train.Checkpoint) -> dict[str, Any]:
    raise AssertionError("never runs: the host cannot be reached")


def test_an_unreachable_validation_host_fails_that_validation_and_training_goes_on(
    ssh, storage: str, monkeypatch
) -> None:
    monkeypatch.setenv("DDPTRAIN_SSH_CONNECT_TIMEOUT_S", "2")
    down = ssh.add_host("down", "127.0.0.9")
    ssh.remove_host(down)  # its sshd is stopped: nothing listens there any more

    def loop() -> int:
        _report(0, validation=True)
        _report(1)
        return 7

    start = time.monotonic()
    result = _fit(loop, storage, _fails, ["localhost", "down"], "down")
    assert time.monotonic() - start < 30
    assert result.return_value == 7 and result.metrics["step"] == 1
    [line] = _validation_lines(storage)
    assert line["checkpoint"] == "checkpoint_000001"
    assert "The validation did not run to its end on host 'down': host 'down' (root@127.0.0.9:" in line["error"]
    assert "cannot connect" in line["error"]


def _sshd_serving(pid: int) -> int:
    """The nearest sshd above ``pid``: the one serving its connection."""
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if Path(f"/proc/{pid}/comm").read_text().strip().startswith("sshd"):
            return pid
    raise AssertionError("no sshd above the validation process")


def test_a_connection_dropped_mid_validation_fails_it_and_leaves_nothing_on_the_host(
    ssh, storage: str, tmp_path: Path
) -> None:
    """The sshd serving the validation dies (SIGKILL): that validation fails naming the host,
    training goes on, and the process there stops itself (SIGTERM first: its cleanup runs)."""
    pids = tmp_path / "pids"

    def loop() -> Any:
        _report(0, validation=True)
        started = _started(pids)
        os.kill(_sshd_serving(started["pids"][0]), signal.SIGKILL)
        listed = [r.status.value for r in train.get_all_reported_checkpoints(timeout_s=60)]
        return started, listed

    start = time.monotonic()
    result = _fit(loop, storage, _hangs, ["localhost", "h0"], "h0", pids=str(pids))
    assert time.monotonic() - start < 45
    started, listed = result.return_value
    assert listed == ["VALIDATED"]
    [line] = _validation_lines(storage)
    assert "on host 'h0': the connection to host 'h0' was lost while it ran" in line["error"], line["error"]
    assert _gone(started["pids"], timeout_s=15)  # the function and what it started
    assert Path(f"{pids}.stopped").read_text() == "cleanup ran"


def _quiet_then_chatty(checkpoint: train.Checkpoint, seconds: float) -> dict[str, Any]:
    time.sleep(seconds)  # silent
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # output all the time
        print("x" * 200, flush=True)
    return {"acc": 0.5}


def test_a_validation_longer_than_the_heartbeat_timeout_runs_to_its_end(ssh, storage: str, monkeypatch) -> None:
    """The driver's heartbeats keep the process on the host going, whether it prints or not."""
    monkeypatch.setenv("DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S", "1")

    def loop() -> list[str]:
        _report(0, validation=True)
        return [r.status.value for r in train.get_all_reported_checkpoints(timeout_s=60)]

    result = _fit(loop, storage, _quiet_then_chatty, ["localhost", "h0"], "h0", seconds=2.0)
    assert result.return_value == ["VALIDATED"]
    [line] = _validation_lines(storage)
    assert line["error"] is None and line["metrics"]["acc"] == 0.5


def _pulls_its_cable(checkpoint: train.Checkpoint, pids: str, ip: str) -> dict[str, Any]:
    """On n1: its network link goes down while it runs (nothing reaches the driver any more)."""
    with open(pids, "a") as f:
        f.write(json.dumps({"pids": [os.getpid()]}) + "\n")
    subprocess.run([ip, "link", "set", "eth0", "down"], check=True)
    Path(pids + ".cut").write_text(str(time.time()))
    try:
        time.sleep(60)
    finally:  # a stop is a SIGTERM first: cleanup runs
        Path(pids + ".stopped").write_text(str(time.time()))
    return {"acc": 1.0}


@pytest.mark.timeout(120)
def test_a_host_cut_off_mid_validation_fails_it_and_its_process_stops_within_the_heartbeat_timeout(
    netns, storage: str, tmp_path: Path, monkeypatch
) -> None:
    """n1's link goes down while a validation runs there: no FIN reaches either side. The
    validation fails naming n1 within the heartbeat bounds, training goes on, and the process on
    n1 stops itself once the driver's heartbeats stop (SIGTERM first: its cleanup runs), long
    before n1's sshd would drop the session (ClientAliveInterval 5, ClientAliveCountMax 3)."""
    monkeypatch.setenv("DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S", "2")
    pids = tmp_path / "pids"

    def loop() -> Any:
        _report(0, validation=True)
        started = _started(pids)
        listed = [r.status.value for r in train.get_all_reported_checkpoints(timeout_s=60)]
        return started, listed

    start = time.monotonic()
    result = _fit(loop, storage, _pulls_its_cable, ["localhost", "n1"], "n1", pids=str(pids), ip=shutil.which("ip"))
    assert time.monotonic() - start < 45
    started, listed = result.return_value
    assert listed == ["VALIDATED"]
    [line] = _validation_lines(storage)
    assert "on host 'n1': the connection to host 'n1' was lost while it ran" in line["error"], line["error"]
    assert _gone(started["pids"], timeout_s=15)
    cut = float(Path(f"{pids}.cut").read_text())
    stopped = float(Path(f"{pids}.stopped").read_text())
    assert stopped - cut < 8, f"the validation on n1 ran {stopped - cut:.1f} s after its link went down"


def test_a_host_with_another_ddptrain_says_so_and_training_goes_on(ssh, storage: str, tmp_path: Path) -> None:
    """The request is pickled: before it is unpickled there, the host's versions are checked."""
    site = tmp_path / "site"
    site.mkdir()  # the host's ddptrain says it is another version
    (site / "sitecustomize.py").write_text("import ddptrain.wire.boot as b\nb.__version__ = '0.0.1'\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)

    def loop() -> int:
        _report(0, validation=True)
        _report(1)
        return 7

    def never_runs(checkpoint: train.Checkpoint) -> dict[str, Any]:
        raise AssertionError("never runs: the host has another version")

    result = _fit(loop, storage, never_runs, ["localhost", f"h0 python={python}"], "h0")
    assert result.return_value == 7 and result.metrics["step"] == 1
    [line] = _validation_lines(storage)
    assert f"version mismatch on {os.uname().nodename} ({sys.executable}): ddptrain 0.0.1 here, " in line["error"]
    assert "Install the same versions on every host" in line["error"]


_DRIVER = """
import sys, time
import ddptrain as train
from tests.test_validation import _report
from tests.test_validation_hosts import _hangs

def loop():
    _report(0, validation=True)
    time.sleep(60)

train.DataParallelTrainer(
    loop,
    scaling_config=train.ScalingConfig(num_workers=0, hosts=["localhost", "h0"]),
    validation_config=train.ValidationConfig(
        _hangs, task_config=train.ValidationTaskConfig({"pids": sys.argv[2]}), host="h0"
    ),
    run_config=train.RunConfig(name="run", storage_path=sys.argv[1]),
).fit()
"""


@pytest.mark.slow
def test_nothing_of_a_validation_is_left_on_its_host_when_the_driver_is_killed(
    ssh, storage: str, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, storage, str(pids)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        started = _started(pids)
        folder = started["folder"]
        assert folder and os.path.isdir(folder)  # h0 shares this machine's /tmp: seen from here
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(30)
    finally:
        driver.kill()
        driver.wait()
    assert _gone(started["pids"])
    deadline = time.monotonic() + 5
    while (os.path.exists(folder) or ssh.ssh_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ssh.ssh_processes()  # nothing started over SSH is left (a test tag in its environment)
    assert not os.path.exists(folder)  # nor the pickled function
