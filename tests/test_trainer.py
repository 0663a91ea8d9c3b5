"""The core runtime end to end: real worker processes joined over gloo."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain.torch import TorchConfig, TorchTrainer

ENV_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
)


def allreduce_and_report(config: dict) -> dict:
    import torch
    import torch.distributed as dist

    ctx = train.get_context()
    total = torch.tensor([float(ctx.get_world_rank() + 1)])
    dist.all_reduce(total)
    for step in range(config["steps"]):
        train.report({"step": step, "rank": ctx.get_world_rank(), "sum": total.item()})
    return {
        "env": {name: os.environ.get(name) for name in ENV_NAMES},
        "backend": dist.get_backend(),
        "context": [
            ctx.get_world_size(),
            ctx.get_world_rank(),
            ctx.get_local_rank(),
            ctx.get_local_world_size(),
            ctx.get_node_rank(),
            ctx.get_experiment_name(),
        ],
        "storage": ctx.get_storage().experiment_fs_path,
        "config": config,
    }


@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_workers_train_together_and_report(storage: str, num_workers: int) -> None:
    trainer = TorchTrainer(
        allreduce_and_report,
        train_loop_config={"steps": 3},
        scaling_config=train.ScalingConfig(num_workers=num_workers),
        run_config=train.RunConfig(name="run", storage_path=storage),
    )
    result = trainer.fit()

    expected_sum = float(sum(range(1, num_workers + 1)))
    assert result.metrics == {"step": 2, "rank": 0, "sum": expected_sum}
    assert [m["step"] for m in result.metrics_history] == [0, 1, 2]
    assert result.path == os.path.join(storage, "run")
    assert len(result.return_values) == num_workers
    assert result.return_value == result.return_values[0]
    for rank, value in enumerate(result.return_values):
        env = value["env"]
        assert env["RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(num_workers)
        assert env["LOCAL_RANK"] == str(rank)
        assert env["NODE_RANK"] == env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] and env["MASTER_PORT"]
        assert env["OMP_NUM_THREADS"] == "1"
        assert value["backend"] == "gloo"
        assert value["context"] == [num_workers, rank, rank, num_workers, 0, "run"]
        assert value["storage"] == os.path.join(storage, "run")
        assert value["config"] == {"steps": 3}
    lines = Path(storage, "run", "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["metrics"]["step"] for line in lines] == [0, 1, 2]
    assert Path(storage, "run", "run.json").exists()


def returns_omp_threads() -> str | None:
    return os.environ.get("OMP_NUM_THREADS")


def test_user_omp_num_threads_is_kept(storage: str, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    result = TorchTrainer(
        returns_omp_threads,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_values == ["3", "3"]


def returns_env_var() -> tuple[str | None, str | None]:
    import torch

    return os.environ.get("MY_SETTING"), str(torch.get_num_threads())


def test_runtime_env_vars_and_cpu_resources_reach_workers(storage: str, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    result = TorchTrainer(
        returns_env_var,
        scaling_config=train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2}),
        run_config=train.RunConfig(storage_path=storage, worker_runtime_env={"env_vars": {"MY_SETTING": "on"}}),
    ).fit()
    assert result.return_values == [("on", "2"), ("on", "2")]


def returns_a_model() -> dict:
    import torch

    model = torch.nn.Linear(3, 2)
    return {"model": model, "state": model.state_dict(), "double": lambda x: 2 * x}


def test_return_values_keep_modules_parameters_and_closures(storage: str) -> None:
    # What workers send back goes through a pickler that copies GPU tensors to the CPU; on the
    # CPU it must change nothing: a module keeps its Parameters, a lambda still runs.
    import torch

    value = TorchTrainer(returns_a_model, run_config=train.RunConfig(storage_path=storage)).fit().return_value
    assert isinstance(value["model"].weight, torch.nn.Parameter) and value["model"].weight.requires_grad
    assert torch.equal(value["model"].weight, value["state"]["weight"]) and value["double"](4) == 8


def tcp_init() -> str:
    import torch.distributed as dist

    return dist.get_backend()


def test_torch_config_tcp_init_method(storage: str) -> None:
    result = TorchTrainer(
        tcp_init,
        torch_config=TorchConfig(init_method="tcp", timeout_s=60),
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_values == ["gloo", "gloo"]


def no_argument_function() -> int:
    train.report({"x": 1})
    return train.get_context().get_world_size()


def test_function_without_arguments_and_default_name(storage: str) -> None:
    result = train.DataParallelTrainer(
        no_argument_function,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_values == [2, 2]
    assert os.path.basename(result.path).startswith("ddptrain_run-")


def test_local_mode_runs_in_the_driver_process(storage: str) -> None:
    def loop(config: dict) -> int:
        train.report({"pid": os.getpid(), "lr": config["lr"]})
        ctx = train.get_context()
        assert (ctx.get_world_size(), ctx.get_world_rank()) == (1, 0)
        return 7

    result = TorchTrainer(
        loop,
        train_loop_config={"lr": 0.1},
        scaling_config=train.ScalingConfig(num_workers=0),
        run_config=train.RunConfig(name="local", storage_path=storage),
    ).fit()
    assert result.metrics == {"pid": os.getpid(), "lr": 0.1}
    assert result.return_value == 7
    assert result.path == os.path.join(storage, "local")


def _local_epochs(config: dict) -> None:
    start = 0
    if train.get_checkpoint() is not None:
        with train.get_checkpoint().as_directory() as d:
            start = int(Path(d, "epoch").read_text()) + 1
    for epoch in range(start, config["epochs"]):
        with tempfile.TemporaryDirectory() as d:
            Path(d, "epoch").write_text(str(epoch))
            train.report(
                {"epoch": epoch, "score": [3, 9, 1, 7, 5][epoch]}, checkpoint=train.Checkpoint.from_directory(d)
            )
        assert train.get_checkpoint().path == os.path.join(config["run"], f"checkpoint_{epoch + 1:06d}")
    assert len(train.get_all_reported_checkpoints()) <= 3


def test_local_mode_persists_like_a_worker_group(storage: str) -> None:
    """num_workers=0 goes through the run's storage: metrics.jsonl, committed checkpoints with
    retention, run.json, Result.from_path, and resume by name."""
    run_dir = os.path.join(storage, "localrun")

    def fit(epochs: int) -> train.Result:
        return train.DataParallelTrainer(
            _local_epochs,
            train_loop_config={"epochs": epochs, "run": run_dir},
            scaling_config=train.ScalingConfig(num_workers=0),
            run_config=train.RunConfig(
                name="localrun",
                storage_path=storage,
                checkpoint_config=train.CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score"),
            ),
        ).fit()

    result = fit(3)
    assert [m["epoch"] for m in result.metrics_history] == [0, 1, 2]

    def on_disk() -> list[str]:
        return sorted(p for p in os.listdir(run_dir) if p.startswith("checkpoint_"))

    # The two best by score (9: #2, 3: #1) and the latest (#3), as with workers.
    assert on_disk() == ["checkpoint_000001", "checkpoint_000002", "checkpoint_000003"]
    assert json.loads(Path(run_dir, "run.json").read_text())["status"] == "FINISHED"
    assert len(Path(run_dir, "metrics.jsonl").read_text().splitlines()) == 3
    assert train.Result.from_path(run_dir).metrics_history == result.metrics_history

    more = fit(5)  # resumes from the latest checkpoint (epoch 2)
    assert [m["epoch"] for m in more.metrics_history] == [0, 1, 2, 3, 4]
    assert more.checkpoint.path == os.path.join(run_dir, "checkpoint_000005")
    assert on_disk() == ["checkpoint_000002", "checkpoint_000004", "checkpoint_000005"]  # 9, 7, latest


def test_local_mode_failure_is_a_training_failed_error(storage: str) -> None:
    def loop() -> None:
        train.report({"step": 1})
        raise KeyError("missing")

    with pytest.raises(train.TrainingFailedError) as info:
        train.DataParallelTrainer(
            loop,
            scaling_config=train.ScalingConfig(num_workers=0),
            run_config=train.RunConfig(name="failing", storage_path=storage),
        ).fit()
    assert isinstance(info.value.__cause__, KeyError)
    run_json = json.loads(Path(storage, "failing", "run.json").read_text())
    assert run_json["status"] == "ERRORED" and "KeyError" in run_json["error"]
    assert train.Result.from_path(os.path.join(storage, "failing")).metrics == {"step": 1}


def test_metrics_dataframe_has_every_report(storage: str) -> None:
    result = TorchTrainer(
        allreduce_and_report,
        train_loop_config={"steps": 4},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="df", storage_path=storage),
    ).fit()
    frame = result.metrics_dataframe
    assert list(frame["step"]) == [0, 1, 2, 3]
    again = train.Result.from_path(result.path)
    assert again.metrics == result.metrics
    assert again.metrics_history == result.metrics_history


def returns_blob_size(config: dict) -> int:
    return len(config["blob"])


def test_large_config_reaches_every_worker(storage: str) -> None:
    blob = os.urandom(8 * 1024 * 1024)
    result = train.DataParallelTrainer(
        returns_blob_size,
        train_loop_config={"blob": blob},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_values == [len(blob), len(blob)]


def test_generated_names_never_resume_another_run(storage: str) -> None:
    first = train.DataParallelTrainer(
        no_argument_function,
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    second = train.DataParallelTrainer(
        no_argument_function,
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert first.path != second.path
    assert len(second.metrics_history) == 1


def test_workers_that_do_not_start_in_time_are_a_launch_error(storage: str, monkeypatch) -> None:
    monkeypatch.setenv("DDPTRAIN_WORKER_START_TIMEOUT_S", "0.01")
    with pytest.raises(train.LaunchError, match=r"Rank\(s\) \[0, 1\] did not start"):
        train.DataParallelTrainer(
            no_argument_function,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()


class SetupTrainer(train.DataParallelTrainer):
    """A subclass that uses the two DeveloperAPI hooks of Ray's DataParallelTrainer."""

    def setup(self) -> None:
        self.train_loop_config = {**(self.train_loop_config or {}), "set_up_in": os.getpid()}


def return_config(config: dict) -> dict:
    return config


def test_setup_runs_at_fit_and_get_dataset_config_returns_a_copy(storage: str) -> None:
    data_config = train.DataConfig(datasets_to_split=[])
    trainer = SetupTrainer(
        return_config,
        train_loop_config={"lr": 0.1},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
        dataset_config=data_config,
    )
    got = trainer.get_dataset_config()
    assert got.datasets_to_split == [] and got is not data_config
    assert train.DataParallelTrainer(return_config).get_dataset_config().datasets_to_split == "all"
    result = trainer.fit()
    # setup() ran in the driver, before the workers got the config.
    assert result.return_values == [{"lr": 0.1, "set_up_in": os.getpid()}] * 2
