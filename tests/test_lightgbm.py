"""ddptrain.lightgbm: real LightGBM in real worker processes over LightGBM's own network."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

lightgbm = pytest.importorskip("lightgbm")

from example_runner import run_example_in_process  # noqa: E402

import ddptrain as train  # noqa: E402
from ddptrain.lightgbm import (  # noqa: E402
    LightGBMConfig,
    LightGBMTrainer,
    RayTrainReportCallback,
    get_network_params,
)

pytestmark = pytest.mark.slow

FEATURES = [f"f{i}" for i in range(8)]
PARAMS = {
    "objective": "binary",
    "metric": ["binary_logloss"],
    "num_leaves": 31,
    "learning_rate": 0.05,
    "min_data_in_leaf": 50,
    "verbose": -1,
}


def _rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A binary task with an interaction, a curve and some label noise: 4000 rows give a
    clearly better model than 2000 (validation logloss about 0.21 against 0.24 after 200
    rounds)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(FEATURES))).astype("float32")
    y = (x[:, 0] + x[:, 1] * x[:, 2] + np.sin(2 * x[:, 3]) + 0.3 * rng.normal(size=n) > 0).astype("float32")
    return x, y


def _dataset(x: np.ndarray, y: np.ndarray) -> Any:
    return train.data.from_numpy({**{name: x[:, i] for i, name in enumerate(FEATURES)}, "y": y})


def _logloss(booster: Any, x: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(booster.predict(x), 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def _lgb_dataset(name: str, **kwargs: Any) -> tuple[Any, int]:
    df = train.get_dataset_shard(name).materialize().to_pandas()
    return lightgbm.Dataset(df[FEATURES], label=df["y"], **kwargs), len(df)


def _crash_once(at: int | None) -> Any:
    """A LightGBM callback that SIGKILLs rank 1 after round ``at`` of the first attempt."""
    at = at if train.get_checkpoint() is None else None

    def callback(env: Any) -> None:
        if env.iteration == at and train.get_context().get_world_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    return callback


def _train_fn(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("die_before_network") and train.get_context().get_world_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # rank 0 is left waiting for its peer in LightGBM's network
    train_set, rows = _lgb_dataset("train")
    valid_sets, names = [], []
    for name in config.get("valid", ["valid"]):
        valid_sets.append(_lgb_dataset(name, reference=train_set)[0])
        names.append(name)
    start = None
    checkpoint = train.get_checkpoint()
    if checkpoint:
        start = RayTrainReportCallback.get_model(checkpoint)
    done = start.current_iteration() if start is not None else 0
    booster = lightgbm.train(
        {**PARAMS, **get_network_params()},
        train_set,
        num_boost_round=config["rounds"] - done,
        valid_sets=valid_sets,
        valid_names=names,
        init_model=start,
        callbacks=[RayTrainReportCallback(frequency=config["frequency"]), _crash_once(config.get("crash_at"))],
    )
    network = get_network_params()
    return {
        "rows": rows,
        "start": done,
        "trees": str(booster.dump_model()["tree_info"]),
        "machines": network["machines"],
        "port": network["local_listen_port"],
    }


def _trainer(storage: str, config: dict[str, Any], max_failures: int = 1, **kwargs: Any) -> LightGBMTrainer:
    x, y = _rows(4000, 0)
    xv, yv = _rows(2000, 1)
    kwargs.setdefault("scaling_config", train.ScalingConfig(num_workers=2))
    return LightGBMTrainer(
        _train_fn,
        train_loop_config=config,
        datasets={"train": _dataset(x, y), "valid": _dataset(xv, yv), "valid_split": _dataset(xv, yv)},
        dataset_config=train.DataConfig(datasets_to_split=["train", "valid_split"]),
        run_config=train.RunConfig(storage_path=storage, failure_config=train.FailureConfig(max_failures=max_failures)),
        **kwargs,
    )


@pytest.mark.timeout(120)
def test_two_workers_on_half_the_rows_train_one_model_as_good_as_one_process(storage: str) -> None:
    """Both ranks end with the same trees, within 0.01 validation logloss of one process on
    all rows. The metric of the unsplit validation set covers all of it; that of a split one
    covers rank 0's half only (LightGBM does not combine them)."""
    rounds = 200
    result = _trainer(storage, {"rounds": rounds, "frequency": 50, "valid": ["valid", "valid_split"]}).fit()
    assert [v["rows"] for v in result.return_values] == [2000, 2000]
    assert result.return_values[0]["trees"] == result.return_values[1]["trees"]

    booster = RayTrainReportCallback.get_model(result.checkpoint)
    assert booster.current_iteration() == rounds
    assert len(result.metrics_history) == rounds
    xv, yv = _rows(2000, 1)
    assert result.metrics["valid-binary_logloss"] == pytest.approx(_logloss(booster, xv, yv), rel=1e-6)
    assert result.metrics["valid_split-binary_logloss"] == pytest.approx(
        _logloss(booster, xv[:1000], yv[:1000]), rel=1e-6
    )

    x, y = _rows(4000, 0)
    alone = {
        n: _logloss(
            lightgbm.train({**PARAMS, "num_threads": 1}, lightgbm.Dataset(x[:n], label=y[:n]), num_boost_round=rounds),
            xv,
            yv,
        )
        for n in (4000, 2000)
    }
    print(f"validation logloss: 2 workers {_logloss(booster, xv, yv):.4f}, one process {alone}")
    assert _logloss(booster, xv, yv) == pytest.approx(alone[4000], abs=0.01)
    assert _logloss(booster, xv, yv) < alone[2000] - 0.01  # what one worker's rows alone give


@pytest.mark.timeout(120)
def test_a_killed_worker_resumes_from_the_last_checkpoint(storage: str) -> None:
    """Rank 1 is SIGKILLed after round 13; the restart starts from the checkpoint of round 10
    and the rounds go on to 25."""
    result = _trainer(storage, {"rounds": 25, "frequency": 5, "crash_at": 12}).fit()
    assert [v["start"] for v in result.return_values] == [10, 10]
    assert result.return_values[0]["trees"] == result.return_values[1]["trees"]
    assert RayTrainReportCallback.get_model(result.checkpoint).current_iteration() == 25


@pytest.mark.timeout(60)
def test_a_port_in_use_and_a_worker_dying_during_network_setup_fail_fast(storage: str) -> None:
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        started = time.monotonic()
        with pytest.raises(train.TrainingFailedError) as info:
            _trainer(
                storage, {"rounds": 5, "frequency": 0}, lightgbm_config=LightGBMConfig(local_listen_port=port)
            ).fit()
        assert time.monotonic() - started < 45  # two attempts, each seconds, on a busy machine: not a hang
        message = str(info.value)
        assert f"LightGBM's port {port} on host" in message and "local_listen_port" in message
    finally:
        taken.close()

    started = time.monotonic()
    with pytest.raises(train.TrainingFailedError) as info:
        _trainer(storage, {"rounds": 5, "frequency": 0, "die_before_network": True}, max_failures=0).fit()
    assert time.monotonic() - started < 30
    assert "rank 1" in str(info.value) and "SIGKILL" in str(info.value)


@pytest.mark.ssh
@pytest.mark.timeout(120)
def test_workers_on_two_hosts_with_their_own_networks(netns, storage: str) -> None:
    """Each worker must give the others an address of its own host they can reach (the
    bridge), not 127.0.0.1."""
    result = _trainer(
        storage,
        {"rounds": 8, "frequency": 4},
        scaling_config=train.ScalingConfig(num_workers=2, hosts=["n0 slots=1", "n1 slots=1"]),
    ).fit()
    assert [v["rows"] for v in result.return_values] == [2000, 2000]
    assert result.return_values[0]["trees"] == result.return_values[1]["trees"]
    machines = {v["machines"] for v in result.return_values}
    assert machines == {
        f"{netns.hosts[0].addr}:{result.return_values[0]['port']},{netns.hosts[1].addr}:"
        f"{result.return_values[1]['port']}"
    }


@pytest.mark.timeout(120)
def test_the_example_restarts_and_loads_the_final_model(
    storage: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # The example's main() in this process (a script driver would import torch and start a
    # fork server of its own first): the crash, the restart and the loaded model are the point.
    out = run_example_in_process(
        "lightgbm_classifier.py",
        *("--rounds", "60", "--crash-at", "23", "--storage-path", storage),
        monkeypatch=monkeypatch,
        capfd=capfd,
    )
    assert "rank 1: simulating a crash after round 23" in out
    assert "attempt starts at round 20" in out  # resumed from the checkpoint of round 20
    assert "loaded a booster of" in out and "validation logloss" in out


def test_configs_and_callbacks_check_their_arguments() -> None:
    with pytest.raises(ValueError, match="local_listen_port"):
        LightGBMConfig(local_listen_port=80)
    with pytest.raises(ValueError, match="tree_learner"):
        LightGBMConfig(tree_learner="serial")
    with pytest.raises(ValueError, match="frequency"):
        RayTrainReportCallback(frequency=-1)
    with pytest.raises(ValueError, match="lightgbm_config"):
        LightGBMTrainer(_train_fn, lightgbm_config=train.BackendConfig())  # type: ignore[arg-type]
    assert get_network_params() == {}  # outside a LightGBMTrainer (with a warning), as in Ray


def test_ddptrain_does_not_import_lightgbm_and_a_missing_one_names_the_extra() -> None:
    code = (
        "import sys\n"
        "import ddptrain\n"
        "assert 'lightgbm' not in sys.modules, 'import ddptrain imported lightgbm'\n"
        "sys.modules['lightgbm'] = None\n"
        "try:\n"
        "    import ddptrain.lightgbm\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install ddptrain[lightgbm]" in out.stdout
