"""The persistent worker group: workers started once, many functions run on them; and warm
workers handed from one ``fit()`` to the next inside ``reuse_workers()``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ddptrain as train
from ddptrain import WorkerDiedError, WorkerGroupError
from ddptrain.torch import TorchTrainer
from ddptrain.worker_group import WorkerGroup


def _rank_and_sum() -> tuple[int, float]:
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return dist.get_rank(), float(t)


def _set_env(name: str, value: str) -> None:
    os.environ[name] = value


def _get_env(name: str) -> str | None:
    return os.environ.get(name)


def _fails_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("bad batch on rank 1")
    return dist.get_rank()


def test_a_group_runs_successive_functions_on_the_same_workers(capfd) -> None:
    with WorkerGroup.launch(train.ScalingConfig(num_workers=2)) as group:
        pids = group.execute(os.getpid)
        assert len(set(pids)) == 2
        assert group.execute(_rank_and_sum) == [(0, 3.0), (1, 3.0)]
        # State set by one call is there for the next one: the processes live on.
        group.execute(_set_env, "STEP", "1")
        assert group.execute(_get_env, "STEP") == ["1", "1"]
        assert group.execute_single(1, os.getpid) == pids[1]
        assert [w.pid for w in group.get_workers()] == pids
        assert group.execute(lambda: train.get_context().get_world_rank()) == [0, 1]
        group.execute(print, "hello from a worker")
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    out = capfd.readouterr().out
    assert "[rank0] hello from a worker" in out and "[rank1] hello from a worker" in out


def test_an_error_in_a_function_reaches_the_caller_with_the_workers_traceback() -> None:
    with WorkerGroup.launch(train.ScalingConfig(num_workers=2)) as group:
        with pytest.raises(WorkerGroupError) as info:
            group.execute(_fails_on_rank_1)
        assert isinstance(info.value.worker_failures[1], ValueError)
        assert "bad batch on rank 1" in str(info.value)
        assert "_fails_on_rank_1" in info.value.failures[0].traceback_str


def test_a_killed_worker_fails_the_call_at_once_and_the_group_refuses_more_work() -> None:
    with WorkerGroup.launch(train.ScalingConfig(num_workers=2)) as group:
        victim = group.execute_single(1, os.getpid)
        started = time.monotonic()
        with pytest.raises(WorkerGroupError) as info:
            # Rank 0 waits in a collective for rank 1, which the kernel kills meanwhile.
            group.execute(_kill_rank_1_then_allreduce)
        assert time.monotonic() - started < 20
        assert any(isinstance(e, WorkerDiedError) for e in info.value.worker_failures.values())
        assert not group.alive
        with pytest.raises(WorkerGroupError, match="not running"):
            group.execute(os.getpid)
    assert not Path(f"/proc/{victim}/cmdline").exists() or not Path(f"/proc/{victim}/cmdline").read_bytes()


def _kill_rank_1_then_allreduce() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def _report_and_return_pid(config: dict) -> int:
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"run {config['i']} on rank {dist.get_rank()}")
    train.report({"i": config["i"], "world": float(t)})
    return os.getpid()


def _fit(storage: str, i: int, workers: int = 2, **kwargs) -> train.Result:
    return TorchTrainer(
        _report_and_return_pid,
        train_loop_config={"i": i},
        scaling_config=train.ScalingConfig(num_workers=workers),
        run_config=train.RunConfig(storage_path=storage, name=f"run{i}", **kwargs),
    ).fit()


def test_fits_inside_reuse_workers_run_on_warm_workers(storage: str) -> None:
    with train.reuse_workers():
        results = [_fit(storage, i) for i in range(3)]
    pids = [r.return_values for r in results]
    assert pids[0] == pids[1] == pids[2]
    for i, result in enumerate(results):
        assert result.metrics == {"i": i, "world": 2.0}
        # Each run's output is in its own run directory, and only there.
        log = Path(result.path, "logs", "attempt_0", "rank_1.log").read_text()
        assert log.strip() == f"run {i} on rank 1"
    assert all(not Path(f"/proc/{pid}/cmdline").exists() for pid in pids[0])


def test_fits_outside_reuse_workers_start_fresh_workers(storage: str) -> None:
    first, second = _fit(storage, 0), _fit(storage, 1)
    assert not set(first.return_values) & set(second.return_values)


def test_a_failed_fit_never_hands_on_its_workers(storage: str) -> None:
    def crash() -> None:
        if train.get_context().get_world_rank() == 0:
            raise RuntimeError("boom")
        dist.barrier()

    with train.reuse_workers():
        before = _fit(storage, 0).return_values
        with pytest.raises(train.TrainingFailedError, match="boom"):
            TorchTrainer(
                crash,
                scaling_config=train.ScalingConfig(num_workers=2),
                run_config=train.RunConfig(storage_path=storage, name="crash"),
            ).fit()
        after = _fit(storage, 1).return_values
        assert not set(before) & set(after)
        assert _fit(storage, 2).return_values == after


def test_groups_of_different_scaling_are_kept_apart(storage: str) -> None:
    with train.reuse_workers():
        two = _fit(storage, 0, workers=2).return_values
        one = _fit(storage, 1, workers=1).return_values
        assert _fit(storage, 2, workers=2).return_values == two
        assert _fit(storage, 3, workers=1).return_values == one
    assert len(set(two) | set(one)) == 3


def test_a_warm_fit_resumes_its_own_run(storage: str) -> None:
    def count(config: dict) -> int:
        start = 0
        checkpoint = train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as folder:
                start = int(Path(folder, "step").read_text())
        with __import__("tempfile").TemporaryDirectory() as folder:
            Path(folder, "step").write_text(str(start + 1))
            train.report({"step": start + 1}, checkpoint=train.Checkpoint.from_directory(folder))
        return os.getpid()

    def fit(name: str) -> train.Result:
        return TorchTrainer(
            count,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage, name=name),
        ).fit()

    with train.reuse_workers():
        assert fit("a").metrics == {"step": 1}
        assert fit("b").metrics == {"step": 1}  # a new run: not run a's checkpoint
        assert fit("a").metrics == {"step": 2}  # resumed by name, on the same warm workers


def test_a_restarted_attempt_hands_on_its_new_workers(storage: str, tmp_path: Path) -> None:
    marker = tmp_path / "died-once"

    def die_once(config: dict) -> int:
        if train.get_context().get_world_rank() == 1 and not marker.exists():
            marker.write_text("x")
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
        train.report({"ok": 1})
        return os.getpid()

    with train.reuse_workers():
        first = TorchTrainer(
            die_once,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(
                storage_path=storage, name="restarts", failure_config=train.FailureConfig(max_failures=1)
            ),
        ).fit()
        assert first.metrics == {"ok": 1}
        assert _fit(storage, 1).return_values == first.return_values


def test_host_list_groups_are_not_kept(storage: str) -> None:
    def pid() -> int:
        return os.getpid()

    def fit() -> list[int]:
        return (
            TorchTrainer(
                pid,
                scaling_config=train.ScalingConfig(num_workers=2, hosts=["localhost slots=2"]),
                run_config=train.RunConfig(storage_path=storage),
            )
            .fit()
            .return_values
        )

    with train.reuse_workers():
        assert not set(fit()) & set(fit())


@pytest.mark.ssh
def test_a_group_on_two_ssh_hosts(ssh) -> None:
    scaling = train.ScalingConfig(num_workers=2, hosts=["h0 slots=1", "h1 slots=1"])
    with WorkerGroup.launch(scaling) as group:
        assert group.execute(_rank_and_sum) == [(0, 3.0), (1, 3.0)]
        assert [w.hostname for w in group.get_workers()] == [group.plan.hostname] * 2  # loopback hosts
        assert group.execute(_get_env, "NODE_RANK") == ["0", "1"]
