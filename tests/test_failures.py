"""Failures: the first failed rank brings the whole group down, and fit() says why."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from forked_driver import ForkedDriver

import ddptrain as train
from ddptrain.torch import TorchConfig, TorchTrainer


class DataError(Exception):
    pass


def fail_on_rank_one(config: dict) -> None:
    import torch
    import torch.distributed as dist

    rank = train.get_context().get_world_rank()
    print(f"rank {rank} starting", flush=True)
    if rank == 1:
        time.sleep(0.3)
        mode = config["mode"]
        if mode == "raise":
            raise DataError("bad batch 17")
        if mode == "exit":
            os._exit(7)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "unpicklable":
            error = RuntimeError("holds a lock")
            error.lock = threading.Lock()  # type: ignore[attr-defined]
            raise error
    if config.get("rank0") == "sleep":
        time.sleep(600)  # not in a collective: only the driver can stop it
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here, waiting for rank 1


def run_failing(storage: str, mode: str, **extra: object) -> train.TrainingFailedError:
    trainer = TorchTrainer(
        fail_on_rank_one,
        train_loop_config={"mode": mode, **extra},
        torch_config=TorchConfig(timeout_s=900),
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="fail", storage_path=storage),
    )
    with pytest.raises(train.TrainingFailedError) as info:
        trainer.fit()
    return info.value


@pytest.mark.timeout(60)
def test_worker_exception_names_rank_traceback_and_log(storage: str) -> None:
    error = run_failing(storage, "raise")

    assert isinstance(error, train.WorkerGroupError)
    assert isinstance(error.__cause__, DataError)
    assert isinstance(error.worker_failures[1], DataError)
    message = str(error)
    assert "Root cause (first failure): rank 1" in message
    assert "DataError: bad batch 17" in message
    assert 'raise DataError("bad batch 17")' in message  # the user's own line
    assert "ddptrain/worker.py" not in message  # no library frames on top
    log = Path(storage, "fail", "logs", "attempt_0", "rank_1.log")
    assert str(log) in message
    assert "rank 1 starting" in log.read_text()
    assert "DataError: bad batch 17" in log.read_text()


@pytest.mark.timeout(60)
def test_worker_exit_code_is_reported(storage: str) -> None:
    error = run_failing(storage, "exit")
    assert "rank 1" in str(error) and "exit code 7 before its training function returned or raised" in str(error)
    assert "os._exit()" in str(error)  # what ends a process without a word
    assert isinstance(error.worker_failures[1], train.WorkerDiedError)
    assert error.worker_failures[1].exitcode == 7


@pytest.mark.timeout(60)
def test_worker_killed_by_signal_is_reported(storage: str) -> None:
    error = run_failing(storage, "kill")
    assert "killed by signal SIGKILL (9)" in str(error)
    # Rank 0's all_reduce broke ("Connection closed by peer") before rank 1's death was seen:
    # the killed rank is the root cause all the same.
    assert "Root cause (first failure): rank 1 " in str(error)
    assert error.worker_failures[1].exitcode == -9
    assert "probably out of memory" not in str(error)  # it killed itself: no OOM kill was counted


@pytest.mark.timeout(60)
def test_survivor_outside_any_collective_is_stopped(storage: str) -> None:
    # Rank 0 sleeps for 10 minutes where no collective can notice; the driver stops it.
    error = run_failing(storage, "raise", rank0="sleep")
    assert list(error.worker_failures) == [1]


@pytest.mark.timeout(60)
def test_unpicklable_exception_keeps_its_traceback(storage: str) -> None:
    error = run_failing(storage, "unpicklable")
    stand_in = error.worker_failures[1]
    assert isinstance(stand_in, train.WorkerError)
    assert "RuntimeError: holds a lock" in str(stand_in)
    assert "error.lock = threading.Lock()" not in str(error)  # the raise line, not the setup line
    assert "raise error" in str(error)


class RecordingCallback(train.UserCallback):
    def __init__(self, path: str) -> None:
        self.path = path

    def after_exception(self, run_context, worker_exceptions) -> None:
        Path(self.path).write_text(",".join(f"{r}:{type(e).__name__}" for r, e in worker_exceptions.items()))


@pytest.mark.timeout(60)
def test_after_exception_callback_sees_the_failure(storage: str, tmp_path: Path) -> None:
    record = tmp_path / "exceptions.txt"
    with pytest.raises(train.TrainingFailedError):
        TorchTrainer(
            fail_on_rank_one,
            train_loop_config={"mode": "raise", "rank0": "sleep"},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage, callbacks=[RecordingCallback(str(record))]),
        ).fit()
    assert record.read_text() == "1:DataError"


DRIVER_SCRIPT = textwrap.dedent(
    """
    import signal, sys, time
    # Ctrl-C reaches this driver even when the test suite runs from a background job (whose
    # children inherit SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import ddptrain as train

    def loop():
        print("worker up", flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        train.DataParallelTrainer(
            loop,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="bg", storage_path=sys.argv[1]),
        ).fit()
    """
)


def start_driver(tmp_path: Path, storage: str) -> ForkedDriver:
    """The driver script in a process of its own (forked from this one: no torch import of its
    own), returned once both workers run."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER_SCRIPT)
    proc = ForkedDriver(script, [storage], stderr="stdout")
    seen = 0
    for line in proc.stdout:
        seen += "worker up" in line
        if seen == 2:
            return proc
    proc.kill()
    raise AssertionError("the workers never started")


@pytest.mark.timeout(60)
def test_ctrl_c_in_the_driver_stops_every_worker(tmp_path: Path, storage: str) -> None:
    proc = start_driver(tmp_path, storage)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert "KeyboardInterrupt" in out
    # The autouse fixture fails the test if a worker or agent is still alive.


@pytest.mark.timeout(60)
def test_workers_exit_when_the_driver_is_killed(tmp_path: Path, storage: str) -> None:
    from conftest import tagged_processes

    proc = start_driver(tmp_path, storage)
    assert proc.pid in tagged_processes() and len(tagged_processes()) >= 4  # the driver, the agent and two workers
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while tagged_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tagged_processes() == []


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(60)
def test_a_stopped_agent_does_not_outlive_a_killed_driver(tmp_path: Path, storage: str) -> None:
    # A stopped agent never saw its stdin end: it stayed stopped (state T) for good after its
    # driver was killed, holding its workers' exit statuses and its own memory.
    from conftest import tagged_processes

    proc = start_driver(tmp_path, storage)
    parents = [_parent(pid) for pid in tagged_processes() if pid != proc.pid]
    (agent,) = {pid for pid in parents if parents.count(pid) == 2}  # the parent of both workers
    os.kill(agent, signal.SIGSTOP)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    deadline = time.monotonic() + 10
    while tagged_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = tagged_processes()
    if agent in left:
        os.kill(agent, signal.SIGCONT)  # let it go for the next tests
    assert left == []


def crash_with_a_child_holding_the_pipes() -> None:
    import subprocess

    if train.get_context().get_world_rank() == 1:
        # A long-lived child (think DataLoader worker) inherits stdout/stderr.
        subprocess.Popen(["sleep", "300"])
        raise DataError("crashed while a child process runs")
    time.sleep(300)


@pytest.mark.timeout(60)
def test_a_crash_is_seen_even_while_the_workers_children_hold_its_pipes(storage: str) -> None:
    start = time.monotonic()
    with pytest.raises(train.TrainingFailedError) as info:
        train.DataParallelTrainer(
            crash_with_a_child_holding_the_pipes,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert isinstance(info.value.__cause__, DataError)
    assert time.monotonic() - start < 30  # not the child's 300 s


# --- what fails before any process starts --------------------------------------------------
def never_runs() -> None:
    raise AssertionError("no worker may start")


def fit_quickly_failing(storage_path: str, **kwargs: object) -> tuple[BaseException, float]:
    trainer = train.DataParallelTrainer(
        never_runs,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="r", storage_path=storage_path),
    )
    start = time.monotonic()
    with pytest.raises(train.ConfigError) as info:
        trainer.fit()
    return info.value, time.monotonic() - start


@contextlib.contextmanager
def read_only_folder(path: Path) -> Iterator[None]:
    """A folder nobody can write in: a read-only tmpfs as root (who may write anywhere), else mode 0o500."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        try:
            yield
        finally:
            path.chmod(0o700)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_storage_path_that_is_a_file_fails_at_once(tmp_path: Path) -> None:
    file = tmp_path / "results.txt"
    file.write_text("not a folder")
    for storage_path in (file, file / "runs"):
        error, elapsed_s = fit_quickly_failing(str(storage_path))
        assert f"`storage_path` {storage_path} cannot hold the run: {file} is not a folder" in str(error)
        assert elapsed_s < 1.0  # no process was started: starting one takes seconds


def test_an_unwritable_storage_path_fails_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "read-only"
    with read_only_folder(folder):
        for storage_path in (folder, folder / "deeper" / "runs"):
            error, elapsed_s = fit_quickly_failing(str(storage_path))
            assert f"`storage_path` {storage_path} cannot hold the run: cannot write in {folder}" in str(error)
            assert elapsed_s < 1.0
        assert os.listdir(folder) == []


@pytest.mark.parametrize("value", ["zero", "-1", "0;1", ","])
def test_a_bad_console_ranks_variable_fails_before_anything_starts(
    value: str, storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDPTRAIN_CONSOLE_RANKS", value)
    error, elapsed_s = fit_quickly_failing(storage)
    expected = f"`DDPTRAIN_CONSOLE_RANKS` must be 'all' or comma-separated ranks such as '0' or '0,3', got {value!r}"
    assert expected in str(error)
    assert elapsed_s < 1.0
    assert not os.path.exists(storage)  # not even the run directory was made


# --- a worker killed by the kernel's OOM killer ------------------------------------------
def _memory_cgroup_parent() -> tuple[Path, int] | None:
    """A memory cgroup this test may create children in, and its version (2, else 1)."""
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    v2 = [line.split()[4] for line in mounts if " - cgroup2 " in line]
    if v2 and "memory" in Path(v2[0], "cgroup.controllers").read_text().split():
        root = Path(v2[0])
        if "memory" not in Path(root, "cgroup.subtree_control").read_text().split():
            try:
                Path(root, "cgroup.subtree_control").write_text("+memory")
            except OSError:
                return None
        return root, 2
    for line in mounts:
        left, _, right = line.partition(" - ")
        if right.split()[0] == "cgroup" and "memory" in right.split()[2].split(","):
            own = next(p for p in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in p)
            return Path(left.split()[4], own.split(":", 2)[2].lstrip("/")), 1
    return None


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[Path]:
    """A new memory cgroup limited to ``limit_bytes`` (no swap); skips the test if none can be made."""
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root (CI runs as root)")
    try:
        found = _memory_cgroup_parent()
    except (OSError, StopIteration, IndexError) as exc:
        pytest.skip(f"no memory cgroup: {exc!r}")
    if found is None:
        pytest.skip("no memory cgroup controller that this process may use")
    parent, version = found
    group = parent / f"ddptrain-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup in {parent}: {exc}")
    try:
        if version == 2:
            (group / "memory.max").write_text(str(limit_bytes))
            if (group / "memory.swap.max").exists():
                (group / "memory.swap.max").write_text("0")
        else:
            (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
            if (group / "memory.memsw.limit_in_bytes").exists():
                (group / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        yield group
    finally:
        deadline = time.monotonic() + 10
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        group.rmdir()


OOM_DRIVER = textwrap.dedent(
    """
    import sys
    import ddptrain as train

    def hog():
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # the OOM killer's first choice in the cgroup
        chunks = []
        for _ in range(256):
            chunks.append(bytearray(64 << 20))  # zero-filled: every page is touched
        print("the limit did not stop me", flush=True)

    if __name__ == "__main__":
        try:
            train.DataParallelTrainer(hog, run_config=train.RunConfig(name="oom", storage_path=sys.argv[1])).fit()
        except train.TrainingFailedError as exc:
            print(exc)
    """
)


@pytest.mark.timeout(120)
def test_a_worker_killed_by_the_oom_killer_says_so(tmp_path: Path, storage: str) -> None:
    script = tmp_path / "oom_driver.py"
    script.write_text(OOM_DRIVER)
    with memory_cgroup(768 << 20) as group:
        # The driver starts inside the cgroup; its agent and worker inherit it.
        command = f'echo $$ > "{group}/cgroup.procs" && exec "$0" "$1" "$2"'
        proc = subprocess.run(
            ["sh", "-c", command, sys.executable, str(script), storage], capture_output=True, text=True, timeout=100
        )
    out = proc.stdout
    assert "Root cause (first failure): rank 0 " in out, out + proc.stderr
    expected = "killed by signal SIGKILL (9), probably out of memory: the kernel's OOM killer acted in cgroup"
    assert f"{expected} {group} (memory limit 768.0 MiB" in out
    peak_mib = float(out.split("the worker's peak RSS was ")[1].split(" MiB")[0])
    assert 300 < peak_mib <= 768


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (None, "connection lost"),
        (3, "exit code 3"),
        (-9, "killed by signal SIGKILL (9); SIGKILL often means the kernel's out-of-memory killer"),
        (138, "exit code 138, as a remote process killed by SIGUSR1 ends"),  # srun's and ssh's form
        (137, "exit code 137, as a remote process killed by SIGKILL ends; SIGKILL often means"),
    ],
)
def test_an_agents_death_names_the_signal_that_killed_it_on_another_host(code: int | None, text: str) -> None:
    from ddptrain.driver.group_events import agent_death

    assert agent_death(code).startswith(text)
