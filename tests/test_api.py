"""Ray Train's developer API: DataParallelTrainer subclasses, Backend hooks, callbacks,
collectives, datasets, and the errors users get for misuse."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain.backend import Backend, BackendConfig
from ddptrain.data_parallel_trainer import DataParallelTrainer


# --- the seed's dataset example --------------------------------------------------------
def one_batch_per_worker() -> int:
    shard = train.get_dataset_shard("train")
    batches = list(shard.iter_batches(batch_size=1))
    assert len(batches) == 1
    return int(batches[0]["item"][0])  # Ray's row format: from_items([1, 2, 3]) has the column "item"


def test_dataset_example_from_the_ray_docs(storage: str) -> None:
    dataset = train.data.from_items([1, 2, 3])
    assert dataset.count() == 3
    result = DataParallelTrainer(
        one_batch_per_worker,
        datasets={"train": dataset},
        scaling_config=train.ScalingConfig(num_workers=3),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert result.return_values == [1, 2, 3]


def unknown_dataset() -> None:
    train.get_dataset_shard("valid")


def test_unknown_dataset_name_lists_the_known_ones(storage: str) -> None:
    with pytest.raises(train.TrainingFailedError) as info:
        DataParallelTrainer(
            unknown_dataset,
            datasets={"train": train.data.from_items([1, 2])},
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert isinstance(info.value.__cause__, KeyError)
    assert "'valid' not found" in str(info.value) and "['train']" in str(info.value)


# --- subclassing use case 1: a predefined loop -------------------------------------------
class PredefinedTrainer(DataParallelTrainer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(predefined_loop, *args, **kwargs)


def predefined_loop() -> int:
    return 1


def test_subclass_with_a_predefined_loop(storage: str) -> None:
    result = PredefinedTrainer(
        scaling_config=train.ScalingConfig(num_workers=2), run_config=train.RunConfig(storage_path=storage)
    ).fit()
    assert result.return_values == [1, 1]


# --- subclassing use case 2: a custom Backend -------------------------------------------
EVENTS = "DDPTRAIN_TEST_BACKEND_EVENTS"


def set_env_var(value: str) -> int:
    os.environ["MY_ENV_VAR"] = value
    return os.getpid()


class MyBackend(Backend):
    def on_start(self, worker_group, backend_config) -> None:
        pids = worker_group.execute(set_env_var, backend_config.env_var)
        assert len(set(pids)) == len(worker_group) == 2
        assert worker_group.execute_single(1, os.getpid) == pids[1]
        assert [w.pid for w in worker_group.get_workers()] == pids
        _append(backend_config.events, "on_start")

    def on_training_start(self, worker_group, backend_config) -> None:
        _append(backend_config.events, "on_training_start")

    def on_shutdown(self, worker_group, backend_config) -> None:
        values = worker_group.execute(read_env_var)
        _append(backend_config.events, f"on_shutdown:{values}")


def _append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text + "\n")


@dataclass
class MyBackendConfig(BackendConfig):
    env_var: str = "default_value"
    events: str = ""

    @property
    def backend_cls(self):
        return MyBackend


class MyTrainer(DataParallelTrainer):
    def __init__(self, train_loop_per_worker, my_backend_config: MyBackendConfig, **kwargs) -> None:
        super().__init__(train_loop_per_worker, backend_config=my_backend_config, **kwargs)


def read_env_var() -> str | None:
    return os.environ.get("MY_ENV_VAR")


def test_custom_backend_sets_an_environment_variable(storage: str, tmp_path: Path) -> None:
    events = tmp_path / "events.txt"
    trainer = MyTrainer(
        read_env_var,
        MyBackendConfig(env_var="from-backend", events=str(events)),
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    )
    result = trainer.fit()
    assert result.return_values == ["from-backend", "from-backend"]
    assert events.read_text().splitlines() == [
        "on_start",
        "on_training_start",
        "on_shutdown:['from-backend', 'from-backend']",
    ]


class FailingBackend(Backend):
    def on_start(self, worker_group, backend_config) -> None:
        worker_group.execute(_raise_setup_error)


def _raise_setup_error() -> None:
    raise OSError("no such device")


@dataclass
class FailingBackendConfig(BackendConfig):
    @property
    def backend_cls(self):
        return FailingBackend


def test_backend_setup_failure_fails_the_run(storage: str) -> None:
    with pytest.raises(train.TrainingFailedError) as info:
        DataParallelTrainer(
            read_env_var,
            backend_config=FailingBackendConfig(),
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert isinstance(info.value.__cause__, OSError)
    assert sorted(info.value.worker_failures) == [0, 1]


# --- callbacks and collectives ----------------------------------------------------------
class Recorder(train.UserCallback):
    def __init__(self, path: str) -> None:
        self.path = path

    def after_report(self, run_context, metrics, checkpoint) -> None:
        assert run_context.get_run_config().name == "cb"
        _append(self.path, f"{[m['rank'] for m in metrics]} {checkpoint is not None}")


def report_with_ranks() -> None:
    rank = train.get_context().get_world_rank()
    train.report({"rank": rank})
    train.report({"rank": rank})


def test_after_report_gets_every_ranks_metrics(storage: str, tmp_path: Path) -> None:
    log = tmp_path / "reports.txt"
    DataParallelTrainer(
        report_with_ranks,
        scaling_config=train.ScalingConfig(num_workers=3),
        run_config=train.RunConfig(name="cb", storage_path=storage, callbacks=[Recorder(str(log))]),
    ).fit()
    assert log.read_text().splitlines() == ["[0, 1, 2] False", "[0, 1, 2] False"]


def collectives() -> tuple[str, float]:
    rank = train.get_context().get_world_rank()
    value = train.collective.broadcast_from_rank_zero({"tag": "from-zero"} if rank == 0 else None)
    if rank == 1:
        time.sleep(0.5)
    start = time.time()
    train.collective.barrier()
    return value["tag"], start


def test_broadcast_and_barrier(storage: str) -> None:
    result = DataParallelTrainer(
        collectives, scaling_config=train.ScalingConfig(num_workers=2), run_config=train.RunConfig(storage_path=storage)
    ).fit()
    assert [tag for tag, _ in result.return_values] == ["from-zero", "from-zero"]


def late_rank_one() -> None:
    if train.get_context().get_world_rank() == 1:
        time.sleep(2.0)
    train.report({"x": 1})
    train.collective.barrier()


def test_a_late_rank_is_named_in_a_warning(storage: str, caplog, monkeypatch) -> None:
    monkeypatch.setenv("DDPTRAIN_REPORT_WARN_INTERVAL_S", "0.5")
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        DataParallelTrainer(
            late_rank_one,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    warnings = [r.getMessage() for r in caplog.records if "have not reached" in r.getMessage()]
    assert any("rank(s) [1] have not reached report() call #1" in w for w in warnings)


def reports_unevenly() -> None:
    if train.get_context().get_world_rank() == 0:
        train.report({"extra": 1})


def test_uneven_report_counts_are_named_at_the_end(storage: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        DataParallelTrainer(
            reports_unevenly,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert any("never by rank(s) [1]" in r.getMessage() for r in caplog.records)


# --- misuse ---------------------------------------------------------------------------
def test_worker_functions_outside_a_worker_raise() -> None:
    for call in (
        train.get_context,
        train.get_checkpoint,
        lambda: train.report({}),
        lambda: train.get_dataset_shard("train"),
        train.collective.barrier,
    ):
        with pytest.raises(RuntimeError, match="only be called inside a training function"):
            call()


def test_unpicklable_function_fails_before_anything_starts(storage: str) -> None:
    from conftest import tagged_processes

    lock = threading.Lock()

    def uses_lock() -> None:
        with lock:
            pass

    with pytest.raises(ValueError, match="Could not pickle the training function `uses_lock`"):
        DataParallelTrainer(
            uses_lock,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert tagged_processes() == []
    assert not os.path.exists(storage)


def test_unpicklable_config_fails_before_anything_starts(storage: str) -> None:
    with pytest.raises(ValueError, match="Could not pickle"):
        DataParallelTrainer(
            read_env_var,
            train_loop_config={"lock": threading.Lock()},
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()


def reports_a_tensor() -> None:
    import torch

    train.report({"loss": torch.tensor(0.5)})


def test_tensor_metrics_fail_at_the_report_call(storage: str) -> None:
    with pytest.raises(train.TrainingFailedError) as info:
        DataParallelTrainer(
            reports_a_tensor,
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert isinstance(info.value.__cause__, ValueError)
    assert "metrics['loss'] is a torch.Tensor" in str(info.value)
    assert 'train.report({"loss": torch.tensor(0.5)})' in str(info.value)


def reports_a_lock() -> None:
    train.report({"loss": 0.5, "guard": threading.Lock()})


def test_an_unpicklable_metric_is_named_at_the_report_call(storage: str) -> None:
    """It failed with the pickler's "cannot pickle '_thread.lock' object", from deep in the
    channel, naming no metric."""
    with pytest.raises(train.TrainingFailedError) as info:
        DataParallelTrainer(
            reports_a_lock,
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert isinstance(info.value.__cause__, TypeError)
    message = str(info.value)
    assert "metrics['guard'] cannot be sent to the driver: cannot pickle '_thread.lock' object" in message
    assert "in reports_a_lock" in message and "cloudpickle" not in message


def test_fit_at_import_time_asks_for_a_main_guard(tmp_path: Path, storage: str) -> None:
    (tmp_path / "noguard.py").write_text(
        textwrap.dedent(
            f"""
        import ddptrain as train

        def loop():
            return 1

        train.DataParallelTrainer(
            loop, scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(storage_path={storage!r}),
        ).fit()
        """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-c", "import noguard"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr


def test_the_preprocessor_argument_raises_rays_deprecation_text() -> None:
    from ddptrain import DataParallelTrainer
    from ddptrain.torch import TorchTrainer

    for trainer_cls in (DataParallelTrainer, TorchTrainer):
        with pytest.raises(DeprecationWarning) as info:
            trainer_cls(lambda: None, preprocessor=object())
        assert str(info.value).startswith("The `preprocessor` argument to Trainers is deprecated as of Ray 2.7. ")
        assert "use the Preprocessor `fit` and `transform` APIs directly on the Ray Dataset." in str(info.value)


def test_tensorflow_trainer_without_tensorflow_fails_at_construction(tmp_path: Path) -> None:
    # ddptrain.tensorflow imported while a (stub) TensorFlow was there, which is then gone: the
    # trainer must refuse to start instead of running a function that never imports TensorFlow.
    for name in ("tensorflow", "tf_keras"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    code = textwrap.dedent(
        f"""
        import importlib, shutil, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from ddptrain.tensorflow import TensorflowTrainer
        shutil.rmtree({str(tmp_path / "tensorflow")!r})
        importlib.invalidate_caches()
        try:
            TensorflowTrainer(lambda: None)
        except ImportError as exc:
            print("error:", exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "error: TensorflowTrainer needs tensorflow, which this Python cannot import" in out.stdout
    assert "`pip install ddptrain[tensorflow]`" in out.stdout


def test_the_framework_trainers_raise_the_same_preprocessor_deprecation() -> None:
    from ddptrain.base_trainer import PREPROCESSOR_DEPRECATION_MESSAGE
    from ddptrain.huggingface import TransformersTrainer
    from ddptrain.lightning import LightningConfigBuilder, LightningTrainer

    with pytest.raises(DeprecationWarning) as lightning:
        LightningTrainer(LightningConfigBuilder().build(), preprocessor=object())
    with pytest.raises(DeprecationWarning) as transformers:
        TransformersTrainer(lambda train, evaluation, **config: None, preprocessor=object())
    assert str(lightning.value) == str(transformers.value) == PREPROCESSOR_DEPRECATION_MESSAGE
