"""ddptrain.integrations: real MLflow (sqlite store) and real W&B (offline) in 2-worker runs."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ddptrain as train
from ddptrain.integrations._tracking import NoOp
from ddptrain.torch import TorchTrainer

pytestmark = pytest.mark.slow


def _steps(config: dict[str, Any], log: Any) -> None:
    """Three steps of a tiny model; ``log(step, loss)`` and ``report`` on every rank. (No DDP:
    its first use in a process costs seconds here, and tracking does not depend on it.)"""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(train.get_context().get_world_rank()))
    for step in range(config.get("first_step", 0), 3):
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        log(step, loss.item())
        train.report({"loss": loss.item()})
        torch.distributed.barrier()  # in step, as DDP would keep them: rank 0 has logged this step
        crash = config.get("crash_file")
        if crash and train.get_context().get_world_rank() == 1 and not os.path.exists(crash):
            Path(crash).touch()
            os.kill(os.getpid(), signal.SIGKILL)  # attempt 0 dies after its first report


def _mlflow_func(config: dict[str, Any]) -> str:
    from ddptrain.integrations.mlflow import setup_mlflow

    mlflow = setup_mlflow(config, tracking_uri=config["uri"], tags={"team": "ddptrain"})
    attempt = 0 if config.get("crash_file") is None or not os.path.exists(config["crash_file"]) else 1
    mlflow.log_metric("attempt", attempt)
    _steps(config, lambda step, loss: mlflow.log_metric("loss", loss, step=step))
    if config.get("raise_at_end"):
        raise RuntimeError("the function failed after logging")
    if config.get("end_run", True):
        mlflow.end_run()
    return f"{type(mlflow).__name__}, imported: {'mlflow' in sys.modules}"


def _fit(func: Any, storage: str, config: dict[str, Any], name: str, max_failures: int = 0) -> train.Result:
    return TorchTrainer(
        func,
        train_loop_config=config,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(
            name=name, storage_path=storage, failure_config=train.FailureConfig(max_failures=max_failures)
        ),
    ).fit()


def _mlflow_runs(uri: str, experiment: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment named {experiment!r}"
    return client.search_runs([found.experiment_id])


@pytest.fixture(scope="module")
def _migrated_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow sqlite database with its schema made: each new one costs seconds of migrations."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "template.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_uri(_migrated_db: Path, tmp_path: Path) -> str:
    """A test's own tracking URI: a copy of the migrated database."""
    path = tmp_path / "mlflow.db"
    shutil.copyfile(_migrated_db, path)
    return f"sqlite:///{path}"


def test_mlflow_one_run_from_rank_zero_with_params_and_metrics(storage: str, mlflow_uri: str) -> None:
    from mlflow.tracking import MlflowClient

    uri = mlflow_uri
    # No end_run() in the function: ddptrain ends the run when the function returns.
    config = {"uri": uri, "lr": 0.05, "model": {"width": 4}, "end_run": False}
    result = _fit(_mlflow_func, storage, config, "mlrun")

    # Rank 1 got the no-op, without the seconds of importing mlflow.
    assert result.return_values == ["module, imported: True", "NoOp, imported: False"]
    runs = _mlflow_runs(uri, "mlrun")  # the experiment defaults to the ddptrain run's name
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "mlrun"
    assert run.info.status == "FINISHED"
    assert run.data.tags["team"] == "ddptrain"
    assert run.data.params == {"uri": uri, "lr": "0.05", "model/width": "4", "end_run": "False"}
    history = MlflowClient(tracking_uri=uri).get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [0, 1, 2]  # logged once per step: rank 1 logged nothing
    reported = [m["loss"] for m in result.metrics_history]
    assert [m.value for m in history] == pytest.approx(reported)


def test_mlflow_restart_logs_on_into_the_same_run(storage: str, tmp_path: Path, mlflow_uri: str) -> None:
    from mlflow.tracking import MlflowClient

    uri = mlflow_uri
    config = {"uri": uri, "lr": 0.05, "crash_file": str(tmp_path / "crashed")}
    _fit(_mlflow_func, storage, config, "restarted", max_failures=1)

    assert (tmp_path / "crashed").exists()  # there was a restart
    runs = _mlflow_runs(uri, "restarted")
    assert len(runs) == 1  # not one per attempt
    attempts = MlflowClient(tracking_uri=uri).get_metric_history(runs[0].info.run_id, "attempt")
    assert sorted(m.value for m in attempts) == [0.0, 1.0]
    assert runs[0].info.status == "FINISHED"


def test_mlflow_run_of_a_failed_function_ends_failed(storage: str, mlflow_uri: str) -> None:
    uri = mlflow_uri
    with pytest.raises(train.TrainingFailedError, match="the function failed after logging"):
        _fit(_mlflow_func, storage, {"uri": uri, "lr": 0.05, "raise_at_end": True}, "failing")
    runs = _mlflow_runs(uri, "failing")
    assert [r.info.status for r in runs] == ["FAILED"]


def test_mlflow_named_experiment_must_exist_unless_created(mlflow_uri: str) -> None:
    import mlflow

    from ddptrain.integrations.mlflow import setup_mlflow

    uri = mlflow_uri
    try:
        with pytest.raises(ValueError, match="create_experiment_if_not_exists"):
            setup_mlflow(tracking_uri=uri, experiment_name="nowhere")
        # Outside a training function it starts a run in this process, as Ray's does.
        module = setup_mlflow({"a": 1}, tracking_uri=uri, experiment_name="made", create_experiment_if_not_exists=True)
        assert module is mlflow
        assert mlflow.active_run() is not None
        assert mlflow.get_run(mlflow.active_run().info.run_id).data.params == {"a": "1"}
    finally:
        mlflow.end_run()


def _wandb_func(config: dict[str, Any]) -> str:
    from ddptrain.integrations.wandb import setup_wandb

    run = setup_wandb(config, project="ddptrain-tests")
    _steps(config, lambda step, loss: run.log({"loss": loss, "step": step}))
    # No run.finish(): ddptrain finishes it when the function returns.
    return f"{type(run).__name__}, imported: {'wandb' in sys.modules}"


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def test_wandb_offline_one_run_from_rank_zero_with_history(
    storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    import json

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = _fit(_wandb_func, storage, {"lr": 0.05, "model": {"width": 4}}, "wbrun")

    assert result.return_values[1] == "NoOp, imported: False"  # the no-op, without importing wandb
    assert result.return_values[0].endswith(", imported: True") and not result.return_values[0].startswith("NoOp")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = list(_wandb_records(next(runs[0].glob("run-*.wandb"))))
    started = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert started[0].display_name == "wbrun" and started[0].run_group == "wbrun"
    assert started[0].project == "ddptrain-tests"
    config = {item.key: json.loads(item.value_json) for item in started[0].config.update}
    assert config["lr"] == 0.05 and config["model"] == {"width": 4}
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [h["step"] for h in history] == [0, 1, 2]
    assert [h["loss"] for h in history] == pytest.approx([m["loss"] for m in result.metrics_history])
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # the run was finished


def test_noop_accepts_anything() -> None:
    noop = NoOp()
    assert noop.log_metric("x", 1, step=2) is noop
    assert noop.anything.nested(1)[0] is noop
    noop.summary["best"] = 1
    noop.name = "ignored"
    with noop.start_run() as run:
        run.log({"a": 1})
    assert list(noop) == []
    import pickle

    assert isinstance(pickle.loads(pickle.dumps(noop)), NoOp)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("library", ["mlflow", "wandb"])
def test_missing_library_names_the_extra(library: str) -> None:
    proc = _python(
        f"""
        import sys
        sys.modules[{library!r}] = None  # as if it were not installed
        from ddptrain.integrations.{library} import setup_{library}
        try:
            setup_{library}()
        except ImportError as exc:
            print("ImportError:", exc)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert f"`pip install ddptrain[{library}]`" in proc.stdout


def test_import_ddptrain_imports_no_tracking_library() -> None:
    proc = _python(
        """
        import sys
        import ddptrain, ddptrain.integrations.mlflow, ddptrain.integrations.wandb
        print(sorted(m for m in ("mlflow", "wandb") if m in sys.modules))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_ray_air_integrations_resolve_under_ray_compat() -> None:
    proc = _python(
        """
        from ddptrain import ray_compat
        ray_compat.install()
        from ray.air.integrations.mlflow import setup_mlflow
        from ray.air.integrations.wandb import setup_wandb
        import ddptrain.integrations.mlflow, ddptrain.integrations.wandb
        assert setup_mlflow is ddptrain.integrations.mlflow.setup_mlflow
        assert setup_wandb is ddptrain.integrations.wandb.setup_wandb
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
